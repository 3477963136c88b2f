"""Run-level tasks (tasks/run.py): what prepare_run checks before any model loads."""

import pytest
from transformers import Qwen2Config

from grpo_flow.tasks.run import check_lora_targets


def test_lora_target_modules_that_name_no_module_are_refused_naming_the_layers(tmp_path):
    # The model's shape alone (config.json): no weights are read.
    Qwen2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
    ).save_pretrained(tmp_path)
    check_lora_targets(tmp_path, ["q_proj", "v_proj", "self_attn.o_proj"])  # peft's names: last dotted parts
    with pytest.raises(ValueError, match=r"^lora_target_modules: \['query'\] name no module of the model; .*q_proj"):
        check_lora_targets(tmp_path, ["q_proj", "query"])


def test_a_built_models_own_accuracies_are_reported_only_for_the_task_they_were_measured_on(tmp_path):
    """A run on your own data reported the tiny model's random-init and warm-start accuracies on last_digit
    (issue 30, "Also")."""
    import json

    from grpo_flow.schemas.presets import preset_config
    from grpo_flow.tasks.run import model_figures

    record = {"warm_start_task": "last_digit", "heldout_accuracy_random_init": 0.1}
    (tmp_path / "build_info.json").write_text(json.dumps(record))
    assert model_figures(preset_config("tiny"), tmp_path)["model_heldout_accuracy_random_init"] == 0.1
    own_data = preset_config("tiny", dataset="hf:someone/data", reward_funcs=["last_digit"])
    assert model_figures(own_data, tmp_path) == {}
    assert model_figures(preset_config("tiny"), tmp_path / "a-hub-model") == {}
