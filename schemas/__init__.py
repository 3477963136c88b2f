"""Typed config, presets and the Arrow schemas of everything a run writes (pydantic and pyarrow only)."""

from schemas.config import GRPOFlowConfig, describe_validation_error
from schemas.presets import PRESETS, preset_config

__all__ = ["GRPOFlowConfig", "PRESETS", "describe_validation_error", "preset_config"]
