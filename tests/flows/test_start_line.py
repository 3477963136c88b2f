"""The settings line a run starts with (flows/start_line.py)."""

from grpo_flow.flows.start_line import new_run_sources, settings_line
from grpo_flow.schemas.presets import PRESETS, preset_config


def test_the_line_names_each_setting_and_where_it_came_from():
    options = {"max_completion_length": 64, "num_generations": 4}
    config = preset_config("smol-math", **options)
    sources = new_run_sources("smol-math", PRESETS["smol-math"], options)
    assert settings_line(config, sources) == (
        "grpo-flow: settings: learning_rate 0.0005 (preset smol-math); LoRA rank 16, alpha 32 (preset smol-math); "
        "max_completion_length 64 (option); rollout_engine transformers (default); "
        "prompts x generations 4 x 4 (preset smol-math, option)"
    )


def test_a_model_of_your_own_shows_the_defaults_and_lora_off():
    from grpo_flow.schemas.config import GRPOFlowConfig

    line = settings_line(GRPOFlowConfig(model="/models/mine", use_lora=False), {"use_lora": "option"})
    assert "; LoRA off (every weight trains) (option); " in line
    assert "learning_rate 1e-06 (default)" in line and "max_completion_length 512 (default)" in line


def test_extras_come_last_and_a_resumed_run_names_its_stored_config():
    config = preset_config("tiny")
    line = settings_line(config, {"max_steps": "option"}, extras=[("memory", "~1.2 GiB", "estimate")], unlisted="run")
    assert line.startswith("grpo-flow: settings: learning_rate 0.005 (run); ")
    assert line.endswith("; prompts x generations 32 x 8 (run); memory ~1.2 GiB (estimate)")
