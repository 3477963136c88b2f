"""Exact resume: kill a run anywhere, resume it, and end where an uninterrupted run ends.

The killed runs are `grpo train` processes that SIGKILL themselves at a chosen stage
(GRPO_FLOW_FAIL_AT), talking to the session's Prefect server. Everything else runs in
this process.
"""

import os
import subprocess
import sys

import pyarrow.compute as pc
import pytest
import torch
from safetensors.torch import load_file

from flows.grpo import grpo
from schemas.presets import preset_config
from workers.backends import local
from workers.state.storage import RunStorage

SMALL = dict(prompts_per_step=8, num_generations=4, num_rollout_workers=2, eval_prompts=0)
CLI_SMALL = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]


def final_weights(storage: RunStorage, step: int) -> dict[str, torch.Tensor]:
    storage.verify_checkpoint(step)
    return load_file(storage.checkpoint_dir(step) / "model" / "model.safetensors")


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs by {float((a[name] - b[name]).abs().max())}"


def assert_one_set_of_rows_per_step(storage: RunStorage, steps: int, per_step: int) -> None:
    table = storage.read_rollouts()
    counts = table.group_by("step").aggregate([("step", "count")]).sort_by("step").to_pylist()
    assert [(c["step"], c["step_count"]) for c in counts] == [(s, per_step) for s in range(1, steps + 1)]
    keys = pc.binary_join_element_wise(
        pc.cast(table["step"], "string"),
        pc.cast(table["group_index"], "string"),
        pc.cast(table["sample_index"], "string"),
        "/",
    )
    assert len(pc.unique(keys)) == table.num_rows
    assert storage.logged_steps() == list(range(1, steps + 1))


def cli(storage_root, run_id, *args, fail_at=None):
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop(("GRPO_FLOW_FAIL_AT"), None)
    if fail_at:
        env["GRPO_FLOW_FAIL_AT"] = fail_at
    argv = [
        sys.executable,
        "-m",
        "flows.cli",
        "train",
        "--run-id",
        run_id,
        "--storage-root",
        str(storage_root),
        "--no-progress",
        *args,
    ]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)


# -- the equality test: SIGKILL at four places, resume, compare with an uninterrupted run ---------
KILL_RUN = ["--preset", "tiny", "--max-steps", "8", "--save-steps", "3", *CLI_SMALL]


@pytest.fixture(scope="module")
def uninterrupted(prefect_server, storage_root):
    done = cli(storage_root, "kill-baseline", *KILL_RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    return RunStorage(storage_root, "kill-baseline")


@pytest.mark.parametrize(
    "fail_at, resumes_from",
    [
        ("generate@5:kill", 3),  # during generation
        ("actor@5:kill", 3),  # rollouts of step 5 logged, the actor has not stepped
        ("checkpoint@6:kill", 3),  # checkpoint files staged, not committed
        ("checkpointed@6:kill", 6),  # just after a checkpoint
    ],
)
def test_a_killed_run_resumes_to_the_same_weights_and_rows(uninterrupted, storage_root, fail_at, resumes_from):
    run_id = "kill-" + fail_at.split(":")[0].replace("@", "-")
    killed = cli(storage_root, run_id, *KILL_RUN, fail_at=fail_at)
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL: nothing ran after it
    storage = RunStorage(storage_root, run_id)
    assert storage.latest_valid_checkpoint() == resumes_from

    resumed = cli(storage_root, run_id, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming run" in resumed.stdout

    assert_same_weights(final_weights(storage, 8), final_weights(uninterrupted, 8))
    assert_one_set_of_rows_per_step(storage, steps=8, per_step=32)
    ours = storage.read_rollouts(columns=["step", "completion", "advantage"])
    theirs = uninterrupted.read_rollouts(columns=["step", "completion", "advantage"])
    assert ours.equals(theirs)  # regenerated steps sample exactly what the uninterrupted run sampled
    assert not list((storage.run_dir / "rollouts").glob(".*")) and not list(
        (storage.run_dir / "checkpoints").glob(".*")
    )


# -- in-process: damage, self-healing, Prefect retries ---------------------------------------------
def small_config(storage_root, run_id, **overrides):
    fields = {"max_steps": 6, "save_steps": 2, **SMALL, **overrides}
    return preset_config("tiny", run_id=run_id, storage_root=str(storage_root), **fields)


@pytest.fixture(scope="module")
def six_steps(prefect_server, storage_root):
    grpo(small_config(storage_root, "six-baseline"))
    return RunStorage(storage_root, "six-baseline")


def test_damaged_checkpoint_and_truncated_rollouts_are_set_aside_and_redone(six_steps, storage_root, caplog):
    config = small_config(storage_root, "damaged")
    with pytest.raises(Exception, match="injected failure"):
        grpo(config, fail_at="actor@5")
    storage = RunStorage(storage_root, "damaged")
    assert storage.complete_checkpoints() == [2, 4] and storage.rollout_steps() == [1, 2, 3, 4, 5]
    weights = next((storage.checkpoint_dir(4) / "model").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)  # bit rot, same size
    shard = storage.rollout_dir(5) / "shard-01.parquet"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated

    summary = grpo(config)
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 2
    assert "does not match its checksum" in caplog.text
    quarantined = sorted(p.name for p in (storage.run_dir / "quarantine").iterdir())
    assert quarantined == ["checkpoints-step-000004", "rollouts-step-000005"]  # set aside, not deleted
    assert_same_weights(final_weights(storage, 6), final_weights(six_steps, 6))
    assert_one_set_of_rows_per_step(storage, steps=6, per_step=32)


def test_replaced_workers_heal_and_the_run_ends_where_it_would_have(six_steps, storage_root, monkeypatch):
    """After step 3 the actor and rollout worker 1 are swapped for fresh, unloaded objects."""
    from workers.actor.actor import Actor
    from workers.rollout.transformers_engine import TransformersRolloutEngine

    original_sync = local.LocalWorkers.sync_weights

    def sync_then_replace(self):
        version = original_sync(self)
        if version == 3:
            self.actor = Actor(self.config, self.model_path)
            self.rollout[1] = TransformersRolloutEngine(self.model_path, worker_id="rollout-1")
            self.published = None  # nothing in memory to take the weights from: replay from disk
        return version

    monkeypatch.setattr(local.LocalWorkers, "sync_weights", sync_then_replace)
    grpo(small_config(storage_root, "healed"))
    assert_same_weights(final_weights(RunStorage(storage_root, "healed"), 6), final_weights(six_steps, 6))


def test_a_prefect_retry_of_the_failed_flow_run_resumes_at_the_failed_step(
    six_steps, storage_root, tmp_path, monkeypatch
):
    (tmp_path / "flaky_reward.py").write_text(
        "from workers.rewards.functions import last_digit\n"
        "calls = []\n"
        "def flaky(completions, answer, **kwargs):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 9:  # step 5's first shard, first try and both its task retries\n"
        "        raise ConnectionError('reward service went away')\n"
        "    return last_digit(completions, answer)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = small_config(storage_root, "retried", reward_funcs=["flaky_reward:flaky"], score_retries=0)
    summary = grpo.with_options(retries=1, retry_delay_seconds=0)(config)
    storage = RunStorage(storage_root, "retried")
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 4
    resume = storage.effective_config()
    assert resume["run_id"] == "retried" and len(list((storage.run_dir / "resumes").iterdir())) == 1
    assert_one_set_of_rows_per_step(storage, steps=6, per_step=32)
    baseline = six_steps.read_rollouts(columns=["completion", "reward"])
    assert (
        storage.read_rollouts(columns=["completion", "reward_flaky"])
        .column("completion")
        .equals(baseline.column("completion"))
    )


def test_changing_a_training_field_on_resume_is_refused_unless_allowed(six_steps, storage_root):
    from workers.state.resume import ResumeError

    storage = RunStorage(storage_root, "six-baseline")
    before = sorted(p.name for p in storage.run_dir.rglob("*"))
    with pytest.raises(ResumeError, match=r"learning_rate: 0.005 -> 0.01; loss_type: 'dapo' -> 'grpo'"):
        grpo(small_config(storage_root, "six-baseline", learning_rate=0.01, loss_type="grpo"))
    assert sorted(p.name for p in storage.run_dir.rglob("*")) == before  # nothing on disk changed
    summary = grpo(small_config(storage_root, "six-baseline", max_steps=7, save_steps=5))  # safe fields
    assert summary["status"] == "completed" and summary["steps_completed"] == 7 and summary["resumed_from_step"] == 6
    assert storage.logged_steps() == list(range(1, 8))
