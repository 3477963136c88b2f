"""Typed config, presets and the Arrow schemas of everything a run writes (pydantic and pyarrow only)."""

from grpo_flow.schemas.config import GRPOFlowConfig, describe_validation_error
from grpo_flow.schemas.presets import PRESETS, preset_config

__all__ = ["GRPOFlowConfig", "PRESETS", "describe_validation_error", "preset_config"]
