"""Named starting points for a run; every value can be overridden field by field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError

from grpo_flow.schemas.config import LORA_OPTIONS, GRPOFlowConfig

# Named starting points: each preset's fields over GRPOFlowConfig's defaults (`preset_config` applies them,
# then any overrides). `grpo train --preset NAME`, the Python API and the `grpo/<preset>` deployments use them.
PRESETS: dict[str, dict[str, Any]] = {
    # Offline, CPU, about a minute: the project's tiny Qwen2 model learns to answer `35060=`
    # with the last digit. Held-out accuracy starts near 0.3 (after the format warm start,
    # see workers/data/tiny_model.py) and ends near 1.0.
    "tiny": {
        "model": "tiny",
        "dataset": "last_digit",
        "learning_rate": 5e-3,
        "lr_scheduler_type": "constant",
        "num_generations": 8,
        "prompts_per_step": 32,
        "max_steps": 50,
        "max_completion_length": 2,
        "max_prompt_length": 32,
        "temperature": 1.0,
        "loss_type": "dapo",
        "beta": 0.0,
        "num_rollout_workers": 2,
        "save_steps": 20,
        "eval_prompts": 200,
    },
    # Offline, CPU: the same tiny architecture, warm-started on this task's format (`tiny-reverse`),
    # learns to write `35060<` backwards (`06053`). Several tokens per answer, each copied from
    # another position: RL gets the short prompts right long before the long ones, so held-out
    # exact-match accuracy rises well above the warm start's but stays clearly below 1.0.
    "reverse": {
        "model": "tiny-reverse",
        "dataset": "reverse_digits",
        "learning_rate": 2e-3,
        "lr_scheduler_type": "constant",
        "num_generations": 8,
        "prompts_per_step": 32,
        "max_steps": 600,
        "max_completion_length": 7,
        "max_prompt_length": 32,
        "temperature": 1.0,
        "loss_type": "dapo",
        "beta": 0.0,
        "num_rollout_workers": 2,
        "save_steps": 100,
        "eval_prompts": 200,
    },
    # Offline, CPU, minutes: multi-turn episodes with a tool. The tiny model with a chat template that renders
    # tools (`tiny-tools`, warm-started on the call format only) learns `digit_lookup`: every prompt has a
    # hidden table of its own that only the environment's `lookup` tool reads (workers/data/tiny_tools.py).
    # Held-out accuracy goes from about 0.3 (the warm start) to about 1.0 with the tool; docs/tools.md has the figures.
    # A lower learning rate than `tiny`'s: at 5e-3 the first Adam steps knock the tool-call format over.
    "tiny-tools": {
        "model": "tiny-tools",
        "dataset": "digit_lookup",
        "environment_factory": "grpo_flow.workers.data.tiny_tools:DigitTable",
        "max_tool_calling_iterations": 1,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "constant",
        "num_generations": 8,
        "prompts_per_step": 32,
        "max_steps": 120,
        "max_completion_length": 32,
        "max_prompt_length": 32,
        "temperature": 1.0,
        "loss_type": "dapo",
        "beta": 0.0,
        "num_rollout_workers": 2,
        "save_steps": 40,
        "eval_prompts": 200,
    },
    # Offline after one fetch from PyPI, CPU: a real pretrained chat model, SmolLM2-135M-Instruct
    # (`smollm2-135m`), on one-digit sums in GSM8K's format (`smol_math`), its prompts rendered with the
    # model's own chat template and scored by the gsm8k answer check. LoRA adapters on every projection keep
    # a step affordable on a CPU. Held-out accuracy went from 0.19 to 0.99 in the 30 steps (docs/quickstart.md).
    "smol-math": {
        "model": "smollm2-135m",
        "dataset": "smol_math",
        "use_lora": True,
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "learning_rate": 5e-4,
        "lr_scheduler_type": "constant",
        "num_generations": 8,
        "prompts_per_step": 4,
        "max_steps": 30,
        "max_completion_length": 16,
        "max_prompt_length": 128,
        "temperature": 1.0,
        "loss_type": "dapo",
        "beta": 0.0,
        "num_rollout_workers": 1,
        "save_steps": 10,
        "eval_prompts": 100,
    },
    # Qwen2.5-0.5B-Instruct on GSM8K: the model and data come from the Hugging Face hub.
    "gsm8k": {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "dataset": "gsm8k",
        "rollout_engine": "vllm",
        "learning_rate": 1e-6,
        "lr_scheduler_type": "constant",
        "num_generations": 8,
        "prompts_per_step": 16,
        "max_steps": 500,
        "max_completion_length": 512,
        "max_prompt_length": 512,
        "temperature": 1.0,
        "loss_type": "dapo",
        "beta": 0.0,
        "num_rollout_workers": 2,
        "save_steps": 50,
        "eval_prompts": 200,
    },
    # MATH (DigitalLearningGmbH/MATH-lighteval; answers in \boxed{}, compared as math by
    # math-verify). Worked solutions are long, hence 1024 completion tokens; the 1.5B instruct
    # model is the smallest Qwen2.5 that solves enough MATH problems for groups to carry signal.
    "math": {
        "model": "Qwen/Qwen2.5-1.5B-Instruct",
        "dataset": "math",
        "rollout_engine": "vllm",
        "reward_funcs": ["math_accuracy"],
        "learning_rate": 1e-6,
        "lr_scheduler_type": "constant",
        "num_generations": 8,
        "prompts_per_step": 16,
        "max_steps": 500,
        "max_completion_length": 1024,
        "max_prompt_length": 512,
        "temperature": 1.0,
        "loss_type": "dapo",
        "beta": 0.0,
        "num_rollout_workers": 2,
        "save_steps": 50,
        "eval_prompts": 200,
    },
    # MBPP (google-research-datasets/mbpp): completions are Python, scored by running the task's
    # tests in a sandbox. 464 training tasks, so 300 steps of 16 are about ten epochs; a coder
    # model, since a general 0.5B model rarely passes a test and groups would carry no signal.
    "mbpp": {
        "model": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        "dataset": "mbpp",
        "rollout_engine": "vllm",
        "reward_funcs": ["mbpp_tests"],
        "learning_rate": 1e-6,
        "lr_scheduler_type": "constant",
        "num_generations": 8,
        "prompts_per_step": 16,
        "max_steps": 300,
        "max_completion_length": 512,
        "max_prompt_length": 512,
        "temperature": 1.0,
        "loss_type": "dapo",
        "beta": 0.0,
        "num_rollout_workers": 2,
        "save_steps": 50,
        "eval_prompts": 200,
    },
}


def preset_fields(name: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The preset's fields with `overrides` over them; raises KeyError naming the known presets.

    Overrides that turn LoRA off (`use_lora` false) take the preset's LoRA options with them: those came
    with the preset, not from the user, whose own LoRA options are still refused without use_lora."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    preset = PRESETS[name]
    if turns_off("use_lora", overrides):
        preset = {field: value for field, value in preset.items() if field not in LORA_OPTIONS}
    return {**preset, **overrides}


def turns_off(field: str, overrides: Mapping[str, Any]) -> bool:
    """`overrides` sets the boolean `field` to false, in any spelling pydantic takes (`false`, `0`, `no`,
    False); a value it refuses is left for the config's own check to name."""
    if field not in overrides:
        return False
    try:
        return not TypeAdapter(bool).validate_python(overrides[field])
    except ValidationError:
        return False


def preset_config(name: str, **overrides: Any) -> GRPOFlowConfig:
    """The preset's config with `overrides` applied (see `preset_fields`); raises KeyError naming the known
    presets."""
    return GRPOFlowConfig(**preset_fields(name, overrides))
