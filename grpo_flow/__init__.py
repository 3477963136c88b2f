"""grpo-flow: GRPO for language models as a Prefect workflow around plain worker classes.

The public face, in TRL's style::

    from grpo_flow import GRPOFlowTrainer, GRPOFlowConfig, preset_config

Names load on first use (as TRL's `trl/__init__.py` does), so `import grpo_flow` imports
neither torch nor Prefect. The subpackages are the repository's top-level folders:
`grpo_flow.flows`, `.tasks`, `.workers`, `.schemas`, `.deployments` (benchmarks/ runs from a checkout).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "GRPOFlowTrainer": "grpo_flow.flows.trainer",
    "GRPOFlowConfig": "grpo_flow.schemas.config",
    "preset_config": "grpo_flow.schemas.presets",
    "PRESETS": "grpo_flow.schemas.presets",
    "RewardEnvironment": "grpo_flow.workers.rewards.environments",
    "MathAnswerEnvironment": "grpo_flow.workers.rewards.environments",
    "CodeTestsEnvironment": "grpo_flow.workers.rewards.environments",
    "LLMJudgeEnvironment": "grpo_flow.workers.rewards.environments",
    "RunStorage": "grpo_flow.workers.state.storage",
    "grpo": "grpo_flow.flows.grpo",
    "evaluate": "grpo_flow.flows.evaluate",
}

__all__ = [
    "PRESETS",
    "CodeTestsEnvironment",
    "GRPOFlowConfig",
    "GRPOFlowTrainer",
    "LLMJudgeEnvironment",
    "MathAnswerEnvironment",
    "RewardEnvironment",
    "RunStorage",
    "evaluate",
    "grpo",
    "preset_config",
]

if TYPE_CHECKING:
    from grpo_flow.flows.evaluate import evaluate
    from grpo_flow.flows.grpo import grpo
    from grpo_flow.flows.trainer import GRPOFlowTrainer
    from grpo_flow.schemas.config import GRPOFlowConfig
    from grpo_flow.schemas.presets import PRESETS, preset_config
    from grpo_flow.workers.rewards.environments import (
        CodeTestsEnvironment,
        LLMJudgeEnvironment,
        MathAnswerEnvironment,
        RewardEnvironment,
    )
    from grpo_flow.workers.state.storage import RunStorage


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'grpo_flow' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
