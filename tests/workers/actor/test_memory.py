"""The step's memory estimate and the default micro-batch budget (workers/actor/memory.py): pure
arithmetic on the model's shape, read without loading weights."""

import json

import pytest


from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.actor import memory

GIB = memory.GIB
SMOL = memory.model_info_from_config(memory.KNOWN_SHAPES["smollm2-135m"])
NO_LORA = {"use_lora": False, "lora_r": None, "lora_alpha": None, "lora_target_modules": None}


def test_parameter_counts_follow_the_shape():
    assert SMOL.parameters == 134_515_008  # SmolLM2-135M: the count its converted model loads with
    lora = preset_config("smol-math")  # r 16 on q/k/v/o and the MLP's three projections
    assert memory.trainable_parameters(lora, SMOL) == 30 * 16 * (2 * 1152 + 2 * 768 + 3 * 2112)
    assert memory.trainable_parameters(preset_config("smol-math", **NO_LORA), SMOL) == SMOL.parameters


@pytest.mark.parametrize(
    "shape",
    [
        {"model_type": "qwen2", "tie_word_embeddings": True},  # q/k/v biases
        {"model_type": "llama", "tie_word_embeddings": False, "head_dim": 16},
    ],
    ids=["qwen2", "llama"],
)
def test_a_config_json_read_without_weights_counts_what_the_model_holds(tmp_path, shape):
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}
    config = AutoConfig.for_model(**shape, **sizes, num_key_value_heads=2, vocab_size=300)
    config.save_pretrained(tmp_path)
    info = memory.read_model_info(str(tmp_path), tmp_path)
    model = AutoModelForCausalLM.from_config(config)
    assert info.parameters == sum(p.numel() for p in model.parameters())


def test_a_builtin_model_not_fetched_yet_is_estimated_from_its_published_shape(tmp_path):
    assert memory.read_model_info("smollm2-135m", tmp_path) == SMOL
    assert memory.read_model_info(str(tmp_path / "no-such-model"), tmp_path) is None


def test_a_config_json_that_is_no_decoders_gives_no_estimate(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "something"}))
    assert memory.read_model_info(str(tmp_path), tmp_path) is None


def test_the_parts_add_up_and_follow_the_options():
    total = 24 * GIB
    lora = memory.estimate_step_memory(preset_config("smol-math"), SMOL, total)
    full = memory.estimate_step_memory(preset_config("smol-math", beta=0.04, **NO_LORA), SMOL, total)
    assert lora["total"] == sum(v for k, v in lora.items() if k != "total")
    assert (
        lora["optimizer"] == 2 * lora["gradients"] == 8 * memory.trainable_parameters(preset_config("smol-math"), SMOL)
    )
    assert full["optimizer"] == 8 * SMOL.parameters and full["reference"] == lora["weights"] and lora["reference"] == 0
    checkpointed = memory.estimate_step_memory(
        preset_config("smol-math", gradient_checkpointing=True, max_tokens_per_microbatch=2048), SMOL, total
    )
    plain = memory.estimate_step_memory(preset_config("smol-math", max_tokens_per_microbatch=2048), SMOL, total)
    assert checkpointed["activations"] < 0.7 * plain["activations"]  # the LM head's part stays


def test_micro_batches_bound_the_activations_however_many_completions():
    """Once the batch is larger than the budget, more completions per step add no memory."""
    peaks = [
        memory.estimate_step_memory(preset_config("smol-math", prompts_per_step=n), SMOL, 24 * GIB)["total"]
        for n in (8, 16, 32, 64)
    ]
    assert peaks[0] == peaks[1] == peaks[2] == peaks[3]
    unbounded = [
        memory.estimate_step_memory(
            preset_config("smol-math", prompts_per_step=n, max_tokens_per_microbatch=10**7), SMOL, 24 * GIB
        )["activations"]
        for n in (8, 16)
    ]
    assert unbounded[1] > 1.5 * unbounded[0]


def test_the_default_budget_is_a_power_of_two_from_the_total_memory_and_at_least_one_row():
    config = preset_config("smol-math")
    per_token = memory.activation_bytes_per_token(config, SMOL)
    budget = memory.default_microbatch_tokens(config, SMOL, 24 * GIB)
    assert budget & (budget - 1) == 0
    assert budget * per_token <= 24 * GIB / memory.ACTIVATION_SHARE < 2 * budget * per_token
    assert (
        memory.default_microbatch_tokens(config, SMOL, 24 * GIB + 12345) == budget
    )  # a little more memory: same split
    assert memory.default_microbatch_tokens(config, SMOL, 2 * 24 * GIB) == 2 * budget
    assert memory.default_microbatch_tokens(config, SMOL, 1024) == memory.row_tokens(config)


def test_the_vllm_engine_counts_its_kv_cache_and_overhead():
    from grpo_flow.workers.rollout.vllm_engine import CPU_ENGINE_OVERHEAD

    config = preset_config("smol-math", rollout_engine="vllm")
    engine = memory.estimate_step_memory(config, SMOL, 24 * GIB)["engine"]
    assert engine > (SMOL.parameters + SMOL.vocab_size * SMOL.hidden_size) * 4 + CPU_ENGINE_OVERHEAD
    assert memory.estimate_step_memory(preset_config("smol-math", backend="modal"), SMOL, 24 * GIB)["engine"] == 0


def test_the_start_line_part_names_the_estimate(tmp_path):
    item = memory.estimate_item(preset_config("smol-math", storage_root=str(tmp_path)))
    assert item is not None and item[0] == "peak memory" and item[1].startswith("~") and item[2] == "estimate"
    assert float(item[1][1:].removesuffix(" GiB")) > 1
    assert (
        memory.estimate_item(preset_config("smol-math", model=str(tmp_path / "none"), storage_root=str(tmp_path)))
        is None
    )
