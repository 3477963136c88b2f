"""The actor's options beyond one plain step: micro-batches by token budget, gradient checkpointing,
num_iterations, the importance-sampling correction's trigger, and LoRA (only adapters train, merged
or adapter-only publishing, checkpoints)."""

import json
import math
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.actor import trl_objective
from grpo_flow.workers.actor.actor import Actor, loss_inputs, micro_batches
from grpo_flow.workers.data.loaders import load_task
from grpo_flow.workers.rollout.base import SamplingParams
from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine
from grpo_flow.workers.data.tiny_model import ensure_tiny_model
from grpo_flow.workers.state.resume import BaseModelChangedError, model_fingerprint
from linear_updates import assert_same_update, use_sgd  # tests/linear_updates.py
from same_samples import assert_same_samples  # tests/same_samples.py


@pytest.fixture(scope="module")
def model_path(storage_root):
    return ensure_tiny_model(storage_root)


@pytest.fixture(scope="module")
def rollouts(model_path):
    """Real completions of uneven lengths (so micro-batches differ in size), fixed advantages."""
    engine = TransformersRolloutEngine(model_path)
    engine.load()
    rows = load_task("last_digit").train.select(range(6))
    result = engine.generate(rows["prompt"], SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3))
    generator = torch.Generator().manual_seed(3)
    return pa.table(
        {
            "prompt_token_ids": [ids for ids in result.prompt_token_ids for _ in range(4)],
            "completion_token_ids": result.completion_token_ids,
            "sampling_logprobs": result.sampling_logprobs,
            "finish_reason": result.finish_reasons,
            "policy_version": [0] * len(result.texts),
            "advantage": torch.randn(len(result.texts), generator=generator).tolist(),
        }
    )


def actor_for(model_path, **overrides):
    actor = Actor(
        preset_config("tiny", run_id="options", prompts_per_step=6, num_generations=4, **overrides), model_path
    )
    actor.load()
    assert actor.sampling_matches_actor  # the local backend's fp32 engine computes the actor's log-probs
    return actor


def weights(actor):
    return {k: v.detach().clone() for k, v in actor.policy_state_dict().items()}


def assert_same_weights(a, b):
    """Bitwise the same tensors (a checkpoint restored)."""
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("correct", [False, True], ids=["plain", "is_correction"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_micro_batches_by_token_budget_give_the_whole_batchs_update(
    model_path, rollouts, loss_type, correct, monkeypatch
):
    """With the IS correction the old log-probs are computed micro-batch by micro-batch too."""
    use_sgd(monkeypatch)
    whole = actor_for(model_path, loss_type=loss_type)
    split = actor_for(model_path, loss_type=loss_type, max_tokens_per_microbatch=60)
    before = weights(whole)
    whole.sampling_matches_actor = split.sampling_matches_actor = not correct
    whole_metrics = whole.step(0, rollouts)
    split_metrics = split.step(0, rollouts)
    assert whole_metrics["actor/micro_batches"] == 1 and split_metrics["actor/micro_batches"] >= 3
    assert split_metrics["loss"] == pytest.approx(whole_metrics["loss"], abs=1e-6)
    if correct:
        name = "sampling/importance_sampling_ratio/mean"
        assert split_metrics[name] == pytest.approx(whole_metrics[name], abs=1e-6)
    assert_same_update(before, weights(whole), weights(split))


def test_by_default_the_budget_comes_from_the_devices_total_memory(model_path, rollouts, monkeypatch):
    from grpo_flow.workers.actor import memory

    use_sgd(monkeypatch)
    whole = actor_for(model_path, beta=0.04)  # a reference pass too
    info = memory.model_info_from_config(whole.model.config.to_dict())
    total = memory.device_total_memory("cpu")
    assert whole.max_tokens_per_microbatch == memory.default_microbatch_tokens(whole.config, info, total)
    monkeypatch.setattr(memory, "device_total_memory", lambda device: 1024**2)  # a machine of 1 MiB
    small = actor_for(model_path, beta=0.04)
    assert small.max_tokens_per_microbatch == memory.row_tokens(small.config)  # one widest row at least
    before = weights(whole)
    whole_metrics, small_metrics = whole.step(0, rollouts), small.step(0, rollouts)
    assert whole_metrics["actor/micro_batches"] == 1 and small_metrics["actor/micro_batches"] > 1
    assert small_metrics["actor/max_tokens_per_microbatch"] == small.max_tokens_per_microbatch
    assert small_metrics["loss"] == pytest.approx(whole_metrics["loss"], abs=1e-6)
    assert_same_update(before, weights(whole), weights(small))


def test_micro_batches_respect_the_budget_and_keep_every_row(model_path, rollouts):
    inputs = loss_inputs(rollouts, pad_token_id=0)
    parts = micro_batches(inputs, max_tokens=40)
    assert sum(p["completion_ids"].size(0) for p in parts) == rollouts.num_rows
    for part in parts:
        tokens = part["completion_ids"].numel() + part["prompt_ids"].numel()
        assert tokens <= 40 or part["completion_ids"].size(0) == 1
        assert part["num_items_in_batch"] == inputs["num_items_in_batch"]


def test_gradient_checkpointing_changes_memory_not_the_update(model_path, rollouts, monkeypatch):
    use_sgd(monkeypatch)
    plain = actor_for(model_path)
    before = weights(plain)
    plain.step(0, rollouts)
    checkpointed = actor_for(model_path, gradient_checkpointing=True)
    assert checkpointed.model.is_gradient_checkpointing
    checkpointed.step(0, rollouts)
    assert_same_update(before, weights(plain), weights(checkpointed))


def test_num_iterations_takes_that_many_optimizer_steps_per_batch(model_path, rollouts):
    actor = actor_for(model_path, num_iterations=3, lr_scheduler_type="linear", max_steps=2)
    metrics = actor.step(0, rollouts)
    assert actor.policy_version == 1
    assert actor.objective.lr_scheduler.last_epoch == 3  # three optimizer steps on one batch
    assert metrics["learning_rate"] == pytest.approx(actor.config.learning_rate)


def test_is_correction_applies_only_where_sampling_can_differ(model_path, rollouts):
    matching = actor_for(model_path)
    assert not any(name.startswith("sampling/") for name in matching.step(0, rollouts))

    other_engine = actor_for(model_path)
    other_engine.sampling_matches_actor = False  # e.g. vLLM
    metrics = other_engine.step(0, rollouts)
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["sampling/sampling_logp_difference/max"] < 1e-3

    stale = actor_for(model_path)
    stale.step(0, rollouts)  # now at version 1; rows sampled at version 0 are stale
    stale_metrics = stale.step(1, rollouts)
    assert stale_metrics["sampling/sampling_logp_difference/max"] > 0

    off = actor_for(model_path, vllm_importance_sampling_correction=False)
    off.sampling_matches_actor = False
    assert not any(name.startswith("sampling/") for name in off.step(0, rollouts))


def test_is_ratio_follows_trls_modes():
    actor_logps = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
    sampling = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])

    class Options:
        vllm_importance_sampling_clip_min = 0.5
        vllm_importance_sampling_clip_max = 2.0

    Options.vllm_importance_sampling_mode = "token_truncate"
    ratio, _ = trl_objective.importance_sampling_ratio(Options, actor_logps, sampling, mask)
    expected = torch.exp((actor_logps - sampling) * mask).clamp(0.5, 2.0)
    torch.testing.assert_close(ratio, expected)
    Options.vllm_importance_sampling_mode = "sequence_mask"
    ratio, metrics = trl_objective.importance_sampling_ratio(Options, actor_logps, sampling, mask)
    # row 0: exp(0.5 - 1.0) = 0.61 kept; row 1: exp(2.0) = 7.4 > 2.0 masked to 0
    torch.testing.assert_close(ratio, torch.tensor([[torch.exp(torch.tensor(-0.5))], [0.0]]))
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(float(torch.exp(torch.tensor(-0.5))))


def test_lora_trains_only_adapters_and_publishes_merged_weights(model_path, rollouts):
    actor = actor_for(
        model_path, use_lora=True, lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"], learning_rate=5e-2
    )
    trainable = [name for name, p in actor.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    base_before = {k: v.clone() for k, v in actor.model.get_base_model().state_dict().items() if "lora_" not in k}
    merged_before = weights(actor)
    actor.step(0, rollouts)
    base_after = {k: v for k, v in actor.model.get_base_model().state_dict().items() if "lora_" not in k}
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)  # base never changes
    merged_after = weights(actor)
    changed = {k for k in merged_after if not torch.equal(merged_before[k], merged_after[k])}
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed)

    # A plain engine loading the merged weights computes the LoRA policy's log-probs.
    engine = TransformersRolloutEngine(model_path)
    engine.load()
    engine.load_state_dict(merged_after, 1)
    adapter_engine = TransformersRolloutEngine(model_path)
    adapter_engine.load()
    adapter = actor.adapter_state_dict()
    adapter_engine.load_state_dict(adapter, 1, trl_objective.lora_config(actor.config))
    prompts = load_task("last_digit").train.select(range(2))["prompt"]
    assert_same_samples(engine, adapter_engine, prompts, SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=5))
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    assert adapter_bytes < sum(t.numel() * t.element_size() for t in merged_after.values()) / 10


def test_a_lora_checkpoint_holds_the_adapter_and_a_reference_to_the_base_model(model_path, rollouts, tmp_path):
    actor = actor_for(model_path, use_lora=True, lora_r=4, learning_rate=5e-2)
    actor.step(0, rollouts)
    actor.save_checkpoint(tmp_path)
    saved = weights(actor)
    assert not (tmp_path / "model").exists()
    reference = json.loads((tmp_path / "base_model.json").read_text())
    assert reference == {"model": "tiny", "path": str(model_path), "sha256": model_fingerprint(str(model_path))}
    checkpoint_bytes = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert checkpoint_bytes < (Path(model_path) / "model.safetensors").stat().st_size

    fresh = actor_for(model_path, use_lora=True, lora_r=4, learning_rate=5e-2)
    fresh.restore(tmp_path)
    assert fresh.policy_version == 1
    assert_same_weights(saved, weights(fresh))
    for a, b in zip(actor.objective.optimizer.state.values(), fresh.objective.optimizer.state.values(), strict=True):
        assert all(torch.equal(a[key], b[key]) for key in a)  # Adam's moments, bitwise


def test_a_lora_checkpoint_refuses_another_base_model(model_path, rollouts, tmp_path):
    actor = actor_for(model_path, use_lora=True, lora_r=4)
    actor.save_checkpoint(tmp_path / "checkpoint")
    other = shutil.copytree(model_path, tmp_path / "other-base")
    state = load_file(other / "model.safetensors")
    state["model.norm.weight"] += 1.0
    save_file(state, other / "model.safetensors")
    moved = Actor(actor.config, other)
    with pytest.raises(BaseModelChangedError, match=r"^model: this LoRA checkpoint's adapter was trained on 'tiny'"):
        moved.restore(tmp_path / "checkpoint")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"lora_r": 8}, "lora_r: LoRA options given without use_lora"),
        ({"loss_type": "luspo"}, "luspo' needs importance_sampling_level 'sequence'"),
        ({"vllm_importance_sampling_clip_min": 4.0}, "clip_min \\(4.0\\) must be <= vllm_importance_sampling_clip_max"),
        ({"top_entropy_quantile": 0.0}, "top_entropy_quantile"),
        ({"num_iterations": 0}, "num_iterations"),
        ({"loss_type": "ppo"}, "loss_type"),
    ],
)
def test_bad_objective_options_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ValidationError, match=message):
        preset_config("tiny", **overrides)


def test_top_p_below_1_with_the_is_correction_is_refused_where_the_correction_applies(model_path, monkeypatch):
    from grpo_flow.workers.actor import actor as actor_module

    for fields in ({"rollout_engine": "vllm"}, {"max_staleness": 1}, {"bf16": True}):
        with pytest.raises(ValidationError, match="top_p/vllm_importance_sampling_correction: top_p 0.9 with"):
            preset_config("tiny", top_p=0.9, **fields)
        preset_config("tiny", top_p=0.9, vllm_importance_sampling_correction=False, **fields)
    actor_for(model_path, top_p=0.9)  # the local fp32 engine: its log-probs are the actor's, nothing to correct
    monkeypatch.setattr(actor_module, "sampling_matches_actor", lambda config, bf16: False)  # e.g. bf16 on a GPU
    with pytest.raises(ValueError, match="top_p/vllm_importance_sampling_correction: top_p 0.9 with"):
        actor_for(model_path, top_p=0.9)


def test_top_p_sampling_log_probs_are_the_truncated_distributions_by_hand(model_path):
    """Why the combination is refused: at top_p 0.9 the engine logs log p(token) - log S, S the probability
    mass of the nucleus (the fewest most likely tokens holding 0.9), where the actor computes log p(token);
    the IS ratio would then be S, not 1, for an unchanged policy."""
    engine = TransformersRolloutEngine(model_path)
    engine.load()
    prompt = load_task("last_digit").train[0]["prompt"]
    result = engine.generate([prompt], SamplingParams(n=8, max_tokens=1, temperature=1.0, top_p=0.9, seed=5))
    with torch.no_grad():
        logits = engine.model(torch.tensor([result.prompt_token_ids[0]])).logits[0, -1].double()
    probs = logits.softmax(-1)
    ordered = probs.sort(descending=True).values
    kept = int((ordered.cumsum(0) < 0.9).sum()) + 1  # the nucleus: tokens until 0.9 is reached
    mass = float(ordered[:kept].sum())
    assert 0.9 <= mass < 1.0
    for completion, logged in zip(result.completion_token_ids, result.sampling_logprobs, strict=True):
        full = float(probs[completion[0]].log())
        assert logged[0] == pytest.approx(full - math.log(mass), abs=1e-5)
        assert math.exp(full - logged[0]) == pytest.approx(mass, abs=1e-5)  # the biased ratio: the kept mass
