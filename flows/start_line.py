"""The line `grpo train` prints when a run starts: the settings that matter most and where each came from.

    grpo-flow: settings: learning_rate 0.0005 (preset smol-math); LoRA rank 16, alpha 32 (preset smol-math);
    max_completion_length 64 (option); rollout_engine transformers (default); prompts x generations 4 x 8
    (preset smol-math)

(one line). A source is `option` (given on the command line), `preset NAME`, or, for a field neither set,
`default` (GRPOFlowConfig's, which are TRL's) or what the caller names instead (a resumed run's stored config).
Callers add items of their own as `extras`: (name, value, source) triples, shown last in the same form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grpo_flow.schemas.config import GRPOFlowConfig

# (name, value, source): one item of the line, e.g. ("memory", "~9.1 GiB", "estimate").
SettingItem = tuple[str, str, str]


def settings_line(
    config: GRPOFlowConfig,
    sources: Mapping[str, str],
    extras: Sequence[SettingItem] = (),
    unlisted: str = "default",
) -> str:
    """The start line for `config`; `sources` maps field names to where their values came from (`option`,
    `preset tiny`), and a field it does not list came from `unlisted`."""

    def source(*fields: str) -> str:
        return ", ".join(dict.fromkeys(sources.get(field, unlisted) for field in fields))

    if config.use_lora:
        # peft's defaults as the actor applies them (workers/actor): rank 16, alpha 32.
        lora = ("LoRA", f"rank {config.lora_r or 16}, alpha {config.lora_alpha or 32}", source("use_lora", "lora_r"))
    else:
        lora = ("LoRA", "off (every weight trains)", source("use_lora"))
    items: list[SettingItem] = [
        ("learning_rate", f"{config.learning_rate:g}", source("learning_rate")),
        lora,
        ("max_completion_length", str(config.max_completion_length), source("max_completion_length")),
        ("rollout_engine", config.rollout_engine, source("rollout_engine")),
        (
            "prompts x generations",
            f"{config.prompts_per_step} x {config.num_generations}",
            source("prompts_per_step", "num_generations"),
        ),
        *extras,
    ]
    return "grpo-flow: settings: " + "; ".join(f"{name} {value} ({where})" for name, value, where in items)


def new_run_sources(preset: str | None, preset_fields: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, str]:
    """Where each field of a new run came from: the options given, else the preset's fields."""
    return {**dict.fromkeys(preset_fields, f"preset {preset}"), **dict.fromkeys(options, "option")}
