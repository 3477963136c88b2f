"""Presets are starting points: every field can be overridden, LoRA included (schemas/presets.py)."""

import pytest
from pydantic import ValidationError

from grpo_flow.schemas.config import describe_validation_error
from grpo_flow.schemas.presets import preset_config, preset_fields


@pytest.mark.parametrize("off", [False, "false", "0", "no"])
def test_turning_lora_off_drops_the_presets_lora_options(off):
    """`--preset smol-math --use-lora false` was refused ("LoRA options given without use_lora") for
    options the user never gave: they came with the preset (issue 34)."""
    config = preset_config("smol-math", use_lora=off)
    assert config.use_lora is False
    assert (config.lora_r, config.lora_alpha, config.lora_target_modules) == (None, None, None)
    assert config.learning_rate == 5e-4 and config.model == "smollm2-135m"  # the rest of the preset stays


def test_lora_options_the_user_gives_without_lora_are_still_refused():
    with pytest.raises(ValidationError) as caught:
        preset_config("smol-math", use_lora=False, lora_r=8)
    assert describe_validation_error(caught.value) == "lora_r: LoRA options given without use_lora"
    with pytest.raises(ValidationError, match="LoRA options given without use_lora"):
        preset_config("tiny", lora_alpha=16)


def test_lora_options_stay_when_lora_stays_on_or_is_not_mentioned():
    assert preset_fields("smol-math", {"lora_r": 8})["lora_alpha"] == 32
    assert preset_fields("smol-math", {"use_lora": "true"})["lora_r"] == 16
    # A value pydantic refuses keeps the preset's options: the config's own check names the bad value.
    with pytest.raises(ValidationError, match="use_lora"):
        preset_config("smol-math", use_lora="perhaps")
