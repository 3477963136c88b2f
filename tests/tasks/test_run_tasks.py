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
