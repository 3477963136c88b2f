"""What an actor step reports of its own time (`actor/<phase>_s`, `actor/step_s`), and that TRL's
importance-sampling ratio is computed against the batch's logged sampling log-probs (a bfloat16 vLLM engine's
in a run, which differ from the fp32 actor's). No time is asserted beyond the phases' sum."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch

from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.actor.actor import ACTOR_PHASES, Actor

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
COMPLETIONS = [[20, 21, 22], [23, 24], [25, 26, 27, 28], [29]]  # two per prompt


def actor_for(model_path, tmp_path, **overrides):
    config = preset_config(
        "tiny", run_id="phases", storage_root=str(tmp_path), prompts_per_step=2, num_generations=2, **overrides
    )
    actor = Actor(config, model_path)
    actor.load()
    return actor


def batch(actor: Actor, offset: float = 0.0) -> pa.Table:
    """The completions with fixed advantages and, as sampling log-probs, the actor's own shifted by `offset`."""
    logprobs = actor.completion_logprobs(PROMPTS, COMPLETIONS)
    return pa.table(
        {
            "prompt_token_ids": [ids for ids in PROMPTS for _ in range(2)],
            "completion_token_ids": COMPLETIONS,
            "sampling_logprobs": [[lp + offset for lp in row] for row in logprobs],
            "finish_reason": ["length"] * len(COMPLETIONS),
            "policy_version": [0] * len(COMPLETIONS),
            "advantage": [1.0, -1.0, 0.5, -0.5],
        }
    )


def phases(metrics: dict[str, float]) -> dict[str, float]:
    return {name: metrics[f"actor/{name}_s"] for name in ACTOR_PHASES}


def test_an_on_policy_step_reports_its_phases_within_its_own_time(model_path, tmp_path):
    actor = actor_for(model_path, tmp_path)
    metrics = actor.step(0, batch(actor))
    seconds = phases(metrics)
    assert all(value >= 0 for value in seconds.values())
    assert seconds["forward_backward"] > 0 and seconds["optimizer"] > 0 and seconds["prepare"] > 0
    # on-policy from the in-process fp32 engine: no old log-probs, and beta 0: no reference pass (as TRL)
    assert seconds["old_logprobs"] == 0 and seconds["ref_logprobs"] == 0
    assert sum(seconds.values()) <= metrics["actor/step_s"]


def test_the_old_and_reference_passes_are_timed_when_they_run(model_path, tmp_path):
    actor = actor_for(model_path, tmp_path, beta=0.04, num_iterations=2)
    metrics = actor.step(0, batch(actor))
    seconds = phases(metrics)
    assert seconds["old_logprobs"] > 0 and seconds["ref_logprobs"] > 0
    assert sum(seconds.values()) <= metrics["actor/step_s"]


@pytest.mark.parametrize("offset", [0.0, 0.5, -0.25])
def test_the_is_ratio_is_taken_against_the_logged_sampling_logprobs(model_path, tmp_path, offset):
    """A bfloat16 vLLM engine's rows: the correction applies to every step, and its per-token ratio is
    exp(actor - sampling), so sampling log-probs shifted by `offset` move its mean to exp(-offset)."""
    actor = actor_for(
        model_path,
        tmp_path,
        rollout_engine="vllm",
        vllm_dtype="bfloat16",
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=None,
        vllm_importance_sampling_clip_max=None,  # nothing masked: the ratio as computed
    )
    assert not actor.sampling_matches_actor
    metrics = actor.step(0, batch(actor, offset))
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(math.exp(-offset), abs=1e-4)
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(abs(offset), abs=1e-4)
    assert metrics["actor/old_logprobs_s"] > 0


def test_phases_are_timed_after_the_gpu_finishes(monkeypatch):
    """On a GPU each reading of the clock waits for the queued kernels first."""
    from grpo_flow.workers.actor.actor import PhaseClock

    waited: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    clock = PhaseClock("cuda:1")
    with clock.phase("optimizer"):
        pass
    assert waited == ["cuda:1", "cuda:1"] and clock.metrics()["actor/optimizer_s"] >= 0
    PhaseClock("cpu").now()
    assert len(waited) == 2
