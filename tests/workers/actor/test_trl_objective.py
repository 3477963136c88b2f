"""Pins the one coupling to TRL internals (workers/actor/trl_objective.py) and the actor built on it.

If a TRL upgrade changes what `GRPOTrainer.compute_loss` expects or computes, these fail.
"""

import pyarrow as pa
import pytest
import torch

from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.actor import trl_objective
from grpo_flow.workers.actor.actor import Actor, StaleActorError, loss_inputs
from grpo_flow.workers.data.loaders import load_task
from grpo_flow.workers.rollout.base import SamplingParams
from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine
from grpo_flow.workers.data.tiny_model import ensure_tiny_model


@pytest.fixture(scope="module")
def model_path(storage_root):
    return ensure_tiny_model(storage_root)


def make_actor(model_path, **overrides):
    actor = Actor(preset_config("tiny", run_id="t", **overrides), model_path)
    actor.load()
    return actor


def sampled_rollouts(model_path, temperature=1.0, n=4, prompts=6, seed=0):
    """A table of real completions from the rollout engine, with arbitrary but fixed advantages."""
    engine = TransformersRolloutEngine(model_path)
    engine.load()
    rows = load_task("last_digit").train.select(range(prompts))
    result = engine.generate(rows["prompt"], SamplingParams(n=n, max_tokens=3, temperature=temperature, seed=seed))
    generator = torch.Generator().manual_seed(seed)
    return pa.table(
        {
            "prompt_token_ids": [ids for ids in result.prompt_token_ids for _ in range(n)],
            "completion_token_ids": result.completion_token_ids,
            "sampling_logprobs": result.sampling_logprobs,
            "advantage": torch.randn(len(result.texts), generator=generator).tolist(),
        }
    )


def actor_logprobs(actor, inputs):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logps, _, _ = actor.objective._get_per_token_logps_and_entropies(
        actor.model, ids, mask, inputs["completion_ids"].size(1)
    )
    return logps


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logprobs_equal_the_actors_under_the_same_weights(model_path, temperature):
    actor = make_actor(model_path, temperature=temperature)
    table = sampled_rollouts(model_path, temperature=temperature)
    inputs = loss_inputs(table, actor.tokenizer.pad_token_id)
    with torch.no_grad():
        logps = actor_logprobs(actor, inputs)
    mask = inputs["completion_mask"].bool()
    sampled = torch.zeros_like(logps)
    for i, row in enumerate(table.column("sampling_logprobs").to_pylist()):
        sampled[i, : len(row)] = torch.tensor(row)
    torch.testing.assert_close(logps[mask], sampled[mask], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_trl_loss_has_the_gradient_of_the_documented_objective(model_path, loss_type):
    """On-policy (ratio 1): grpo = -mean_i A_i * mean_t logp_it, dapo = -sum_it A_i logp_it / tokens."""
    table = sampled_rollouts(model_path)
    ours = make_actor(model_path, loss_type=loss_type)
    inputs = loss_inputs(table, ours.tokenizer.pad_token_id)
    loss, metrics = trl_objective.compute_loss(ours.objective, ours.model, inputs)
    loss.backward()
    trl_grad = ours.model.model.embed_tokens.weight.grad.clone()

    reference = make_actor(model_path, loss_type=loss_type)
    logps = actor_logprobs(reference, inputs)
    mask = inputs["completion_mask"].float()
    advantages = inputs["advantages"].unsqueeze(1)
    if loss_type == "grpo":
        manual = -((advantages * logps * mask).sum(1) / mask.sum(1)).mean()
    else:
        manual = -(advantages * logps * mask).sum() / mask.sum()
    manual.backward()
    torch.testing.assert_close(trl_grad, reference.model.model.embed_tokens.weight.grad, atol=1e-6, rtol=1e-4)
    assert {"entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"} <= set(metrics)


def test_grpo_args_carry_every_shared_option_unchanged():
    config = preset_config(
        "tiny",
        learning_rate=2e-4,
        loss_type="grpo",
        beta=0.01,
        epsilon=0.1,
        epsilon_high=0.3,
        scale_rewards="batch",
        temperature=0.9,
        top_p=0.95,
        num_generations=4,
        max_completion_length=7,
    )
    args = trl_objective.grpo_args(config, "unused")
    for name in (
        "learning_rate",
        "loss_type",
        "beta",
        "epsilon",
        "epsilon_high",
        "scale_rewards",
        "temperature",
        "top_p",
        "num_generations",
        "max_completion_length",
        "max_grad_norm",
        "lr_scheduler_type",
    ):
        assert getattr(args, name) == getattr(config, name), name
    assert args.per_device_train_batch_size == config.prompts_per_step * config.num_generations


def test_actor_step_moves_the_weights_and_counts_versions(model_path):
    actor = make_actor(model_path)
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    metrics = actor.step(0, sampled_rollouts(model_path))
    assert actor.policy_version == 1
    assert any(not torch.equal(before[k], v) for k, v in actor.model.state_dict().items())
    assert metrics["grad_norm"] > 0 and metrics["learning_rate"] == pytest.approx(5e-3)


def test_actor_refuses_a_step_for_another_version_and_changes_nothing(model_path):
    actor = make_actor(model_path)
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    with pytest.raises(StaleActorError, match="holds policy version 0, caller expects 3"):
        actor.step(3, sampled_rollouts(model_path))
    assert actor.policy_version == 0
    assert all(torch.equal(before[k], v) for k, v in actor.model.state_dict().items())


def test_beta_loads_a_frozen_reference_and_logs_kl(model_path):
    actor = make_actor(model_path, beta=0.1)
    assert actor.objective.ref_model is not None
    actor.step(0, sampled_rollouts(model_path))
    metrics = actor.step(1, sampled_rollouts(model_path, seed=1))
    assert metrics["kl"] > 0  # the policy moved away from the reference after one step
    no_ref = make_actor(model_path, beta=0.0)
    assert no_ref.objective.ref_model is None


def test_checkpoint_holds_everything_a_resume_needs(model_path, tmp_path):
    actor = make_actor(model_path)
    actor.step(0, sampled_rollouts(model_path))
    state = actor.save_checkpoint(tmp_path)
    assert state["policy_version"] == 1
    for name in (
        "model/model.safetensors",
        "model/tokenizer.json",
        "optimizer.pt",
        "scheduler.pt",
        "rng.pt",
        "actor_state.json",
    ):
        assert (tmp_path / name).exists(), name
    optimizer_state = torch.load(tmp_path / "optimizer.pt")
    assert optimizer_state["state"], "optimizer moments were not saved"
