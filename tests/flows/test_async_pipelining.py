"""max_staleness 1: step t+1's rollouts are produced (by rollout engines in their own processes)
while the actor takes step t; they are trained one step stale with the IS correction, and a run
resumed after a failure still ends exactly where an unbroken one does."""

import pytest
import torch
from safetensors.torch import load_file

from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers import backends
from grpo_flow.workers.state.storage import RunStorage
from grpo_flow.workers.state.faults import injected

FIELDS = dict(max_steps=4, save_steps=2, prompts_per_step=4, num_generations=4, eval_prompts=0, max_staleness=1)


def final_weights(storage_root, run_id):
    return load_file(RunStorage(storage_root, run_id).checkpoint_dir(4) / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def unbroken(prefect_server, storage_root):
    config = preset_config("tiny", run_id="async-unbroken", storage_root=str(storage_root), **FIELDS)
    summary = grpo(config)
    return config, summary


def test_rows_are_one_step_stale_and_corrected(unbroken, storage_root):
    config, summary = unbroken
    assert summary["status"] == "completed"
    storage = RunStorage(storage_root, config.run_id)
    rollouts = storage.read_rollouts().to_pandas()
    staleness = rollouts.groupby("step").staleness.unique().map(list).to_dict()
    assert staleness == {1: [0], 2: [1], 3: [1], 4: [1]}
    assert (rollouts.step - 1 - rollouts.policy_version == rollouts.staleness).all()
    rows = {r["step"]: r for r in storage.read_metrics().to_pylist()}
    assert rows[1].get("sampling/importance_sampling_ratio/mean") is None  # on-policy: nothing to correct
    for step in (2, 3, 4):
        assert rows[step]["sampling/importance_sampling_ratio/mean"] > 0
        assert rows[step]["sampling/sampling_logp_difference/max"] > 0
        assert rows[step]["num_completions"] == 16 and "time/generate_s" in rows[step]
    # The pipeline's shape on disk: step t+1's rows were committed before step t's metrics row.
    for step in (1, 2, 3):
        assert storage.rollout_dir(step + 1).stat().st_mtime <= storage.metrics_path(step).stat().st_mtime


@pytest.mark.slow
def test_a_failed_async_run_resumes_to_the_unbroken_runs_weights(unbroken, storage_root):
    broken = preset_config("tiny", run_id="async-resumed", storage_root=str(storage_root), **FIELDS)
    with pytest.raises(Exception, match="injected failure at stage 'actor' of step 3"):
        with injected("actor@3"):
            grpo(broken)
    backends.release(broken.run_id)  # as a new process would: fresh actor and engine processes
    summary = grpo(broken)
    assert summary["status"] == "completed"
    storage = RunStorage(storage_root, broken.run_id)
    assert storage.logged_steps() == [1, 2, 3, 4]
    assert sorted(storage.read_rollouts().to_pandas().step.unique()) == [1, 2, 3, 4]
    ours, reference = final_weights(storage_root, broken.run_id), final_weights(storage_root, unbroken[0].run_id)
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], atol=1e-6, rtol=0)
