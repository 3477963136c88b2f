"""Exact resume: kill a run anywhere, resume it, and end where an uninterrupted run ends.

The killed runs are `grpo train` processes that SIGKILL themselves at a chosen stage
(GRPO_FLOW_FAIL_AT), talking to the session's Prefect server. Everything else runs in
this process.
"""

import json
import subprocess
import sys

import pyarrow.compute as pc
import pytest

from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.backends.workers import Workers
from grpo_flow.workers.state.lock import this_host
from grpo_flow.workers.state.storage import RunStorage
from grpo_flow.workers.state.faults import injected
from train_cli import (
    cli_env,
    train_argv,
    train_cli as cli,
    final_weights,
    assert_same_weights,
)  # tests/flows/train_cli.py

SMALL = dict(prompts_per_step=8, num_generations=4, num_rollout_workers=2, eval_prompts=0)
CLI_SMALL = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]


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


def grpo_command(*argv):
    """Any other `grpo` command, in its own process (none of them starts Prefect)."""
    return subprocess.run(
        [sys.executable, "-m", "grpo_flow.flows.cli", *argv], capture_output=True, text=True, timeout=120
    )


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
@pytest.mark.slow
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


@pytest.mark.slow
def test_damaged_checkpoint_and_truncated_rollouts_are_set_aside_and_redone(six_steps, storage_root, caplog):
    config = small_config(storage_root, "damaged")
    with pytest.raises(Exception, match="injected failure"):
        with injected("actor@5"):
            grpo(config)
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


def test_a_lora_run_stopped_and_resumed_ends_with_the_unbroken_runs_adapter(prefect_server, storage_root):
    """A LoRA checkpoint holds the adapter and its optimizer state, not the model: resuming from one is exact."""
    lora = {"max_steps": 4, "use_lora": True, "lora_r": 4, "lora_alpha": 8, "learning_rate": 5e-2}
    unbroken = grpo(small_config(storage_root, "lora-unbroken", **lora))
    config = small_config(storage_root, "lora-stopped", **lora)
    with pytest.raises(Exception, match="injected failure"):
        with injected("actor@4"):
            grpo(config)
    storage = RunStorage(storage_root, "lora-stopped")
    assert storage.complete_checkpoints() == [2] and not (storage.checkpoint_dir(2) / "model").exists()

    assert grpo(config)["resumed_from_step"] == 2
    assert_same_weights(final_weights(storage, 4), final_weights(RunStorage(storage_root, "lora-unbroken"), 4))
    assert unbroken["status"] == "completed"


def test_replaced_workers_heal_and_the_run_ends_where_it_would_have(six_steps, storage_root, monkeypatch):
    """After step 3 the actor and rollout worker 1 are swapped for fresh, unloaded objects."""
    from grpo_flow.workers.actor.actor import Actor
    from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine

    original_sync = Workers.sync_weights

    def sync_then_replace(self):
        version = original_sync(self)
        if version == 3:  # as a restarted worker process would hold them (the local backend's servers)
            self.actor.server.actor = Actor(self.config, self.model_path)
            self.rollout[1].server.engine = TransformersRolloutEngine(self.model_path, worker_id="rollout-1")
            self.published = None  # nothing in memory to take the weights from: replay from disk
        return version

    monkeypatch.setattr(Workers, "sync_weights", sync_then_replace)
    grpo(small_config(storage_root, "healed"))
    assert_same_weights(final_weights(RunStorage(storage_root, "healed"), 6), final_weights(six_steps, 6))


@pytest.mark.slow
def test_a_prefect_retry_of_the_failed_flow_run_resumes_at_the_failed_step(
    six_steps, storage_root, tmp_path, monkeypatch
):
    (tmp_path / "flaky_reward.py").write_text(
        "from grpo_flow.workers.rewards.functions import last_digit\n"
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
    from grpo_flow.workers.state.resume import ResumeError

    storage = RunStorage(storage_root, "six-baseline")
    before = sorted(p.name for p in storage.run_dir.rglob("*"))
    with pytest.raises(ResumeError, match=r"learning_rate: 0.005 -> 0.01; loss_type: 'dapo' -> 'grpo'"):
        grpo(small_config(storage_root, "six-baseline", learning_rate=0.01, loss_type="grpo"))
    assert sorted(p.name for p in storage.run_dir.rglob("*")) == before  # nothing on disk changed
    summary = grpo(small_config(storage_root, "six-baseline", max_steps=7, save_steps=5))  # safe fields
    assert summary["status"] == "completed" and summary["steps_completed"] == 7 and summary["resumed_from_step"] == 6
    assert storage.logged_steps() == list(range(1, 8))


@pytest.mark.slow
def test_a_resume_applies_a_changed_learning_rate_and_goes_on_over_a_longer_schedule(prefect_server, storage_root):
    """The checkpoint's optimizer and scheduler state held the old rate (and, for a linear schedule at its
    end, 0): a resumed run trained at the rate it recorded as changed, and step 5 at 0."""
    linear = dict(lr_scheduler_type="linear", max_steps=4, save_steps=2)
    grpo(small_config(storage_root, "longer", **linear))
    storage = RunStorage(storage_root, "longer")
    changed = small_config(storage_root, "longer", **{**linear, "max_steps": 6, "learning_rate": 0.001})
    grpo(changed, allow_config_change=True)
    rates = {row["step"]: row["learning_rate"] for row in storage.read_metrics().to_pylist()}
    assert rates[4] == pytest.approx(0.005 * 1 / 4)  # the first session: 4 steps at 5e-3, linear to 0
    # Steps 5 and 6 at the new rate, at the 6-step schedule's position (TRL logs the step's rate).
    assert rates[5] == pytest.approx(0.001 * 2 / 6) and rates[6] == pytest.approx(0.001 * 1 / 6)
    assert json.loads((storage.run_dir / "resumes" / "resume-001.json").read_text())["changed_fields"][
        "learning_rate"
    ] == [0.005, 0.001]

    # Resuming the completed run again trains nothing and leaves its summary as it was.
    before = storage.summary_path.read_bytes()
    again = grpo(changed)
    assert again["already_completed"] is True and again["steps_completed"] == 6
    assert storage.summary_path.read_bytes() == before and storage.logged_steps() == list(range(1, 7))


# -- hardening (issue 15): backups, two writers, damaged earlier steps, max_steps ------------------------
@pytest.mark.slow
def test_a_run_restored_from_a_backup_resumes_to_the_same_weights(uninterrupted, storage_root, tmp_path):
    """Reported: a run folder restored from a backup, then resumed, failed with "run 'X' has no rollouts
    for step 5" and left `.step-000005.staging` behind. The backup's resume count came back with it, so
    the resume met the Prefect cache keys of the resume made after the backup and skipped committing a
    step that was not on disk."""
    import shutil

    run_id = "restored"
    killed = cli(storage_root, run_id, *KILL_RUN, fail_at="generate@5:kill")
    assert killed.returncode == -9, killed.stderr[-3000:]
    storage = RunStorage(storage_root, run_id)
    backup = tmp_path / "backup"
    shutil.copytree(storage.run_dir, backup)
    resumed = cli(storage_root, run_id, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    shutil.rmtree(storage.run_dir)
    shutil.copytree(backup, storage.run_dir)  # the backup, back in place

    again = cli(storage_root, run_id, "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert_same_weights(final_weights(storage, 8), final_weights(uninterrupted, 8))
    assert_one_set_of_rows_per_step(storage, steps=8, per_step=32)
    assert not list((storage.run_dir / "rollouts").glob(".*"))  # no staging leftover


@pytest.mark.slow
def test_a_second_writer_is_refused_naming_the_first_and_a_killed_writers_lock_is_taken_over(
    prefect_server, storage_root
):
    """Real processes: `grpo train` twice on one run. The first stops (alive) at step 2's actor step."""
    import signal
    import time

    from grpo_flow.workers.state.lock import LOCK_FILE

    run_id = "two-writers"
    argv = train_argv(storage_root, run_id, "--preset", "tiny", "--max-steps", "4", "--save-steps", "3", *CLI_SMALL)
    first = subprocess.Popen(argv, env=cli_env("actor@2:hang"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    storage = RunStorage(storage_root, run_id)
    try:
        deadline = time.monotonic() + 300
        while not storage.rollout_dir(2).exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first.poll() is None, first.communicate()[1][-3000:]

        second = cli(storage_root, run_id, "--resume")
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"pid {first.pid} on host {this_host()} since 20" in second.stderr
        assert "resuming run" not in second.stdout  # refused before anything started
        listed = grpo_command("runs", "--storage-root", str(storage_root))
        assert any(line.split()[:2] == [run_id, "running"] for line in listed.stdout.splitlines())
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    assert (storage.run_dir / LOCK_FILE).exists()  # left behind by the killed process

    third = cli(storage_root, run_id, "--resume")
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"taking over the writer lock of pid {first.pid} on host {this_host()}" in third.stderr
    assert storage.read_summary()["status"] == "completed" and storage.logged_steps() == [1, 2, 3, 4]
    assert not (storage.run_dir / LOCK_FILE).exists()  # released at the end


@pytest.fixture
def damaged_copy(uninterrupted, storage_root, tmp_path):
    """The finished 8-step run (checkpoints 3, 6, 8) in a storage root of its own, its step 2 (before
    the newest checkpoint) cut to half its size, as the issue reported it for step 20 of 30."""
    import shutil

    root = tmp_path / "root"
    shutil.copytree(storage_root / "models", root / "models")
    shutil.copytree(uninterrupted.run_dir, root / "runs" / uninterrupted.run_id)
    storage = RunStorage(root, uninterrupted.run_id)
    shard = storage.rollout_dir(2) / "shard-01.parquet"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    return storage, f"rollouts/step-000002/shard-01.parquet: {size // 2} bytes, its manifest says {size}"


@pytest.mark.slow
def test_a_damaged_earlier_step_is_named_by_every_reader_and_set_aside_by_verify(damaged_copy):
    import pandas as pd

    storage, problem = damaged_copy
    run, root = storage.run_id, str(storage.root)
    listed = grpo_command("runs", "--storage-root", root)
    assert listed.returncode == 0 and problem in listed.stderr and "damaged: 1 file(s)" in listed.stdout
    shown = grpo_command("rollouts", run, "--step", "2", "--limit", "1000", "--storage-root", root)
    assert shown.returncode == 1 and problem in shown.stderr and not shown.stdout  # not half the step, silently
    with pytest.raises(Exception, match="magic bytes"):
        pd.read_parquet(storage.run_dir / "rollouts")  # what the user met: the whole run unreadable

    verified = grpo_command("verify", run, "--storage-root", root)
    assert verified.returncode == 1, verified.stderr
    assert f"damaged: {problem}" in verified.stdout
    assert "step 2's rollouts: moved to quarantine/rollouts-step-000002; not needed to resume (checkpoint 8" in (
        verified.stdout
    )
    assert len(pd.read_parquet(storage.run_dir / "rollouts")) == 7 * 32  # the rest reads again
    again = grpo_command("verify", run, "--storage-root", root)
    assert again.returncode == 0 and "7 step(s) of rollouts (14 shards" in again.stdout
    assert "3 checkpoint(s) and 8 metrics file(s) intact" in again.stdout
    shown = grpo_command("rollouts", run, "--step", "2", "--storage-root", root)
    assert shown.returncode == 1 and "the rollouts of step 2 are moved to quarantine/" in shown.stderr


@pytest.mark.slow
def test_a_resume_sets_a_damaged_earlier_step_aside_and_cleans_killed_writers_files(damaged_copy):
    """Resuming needs only the steps after its checkpoint; one before it is moved aside, named, and the
    run goes on. A temporary file of a writer killed mid-write (its pid gone) is removed at the start."""
    storage, problem = damaged_copy
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    leftover = storage.run_dir / "metrics" / f".step-000009.parquet.w{gone.pid}@{this_host()}.x1y2z3.tmp"
    leftover.write_bytes(b"half a file")
    resumed = cli(storage.root, storage.run_id, "--resume", "--max-steps", "9")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert storage.quarantined() == ["rollouts-step-000002"]
    # On the console, not only in Prefect's log (issue 30, item 8).
    moved = f"grpo-flow: warning: run {storage.run_id}: rollouts/step-000002: damaged ({problem}); moved to "
    assert moved + "quarantine/rollouts-step-000002; not needed to resume (checkpoint 8" in resumed.stderr
    record = json.loads(sorted((storage.run_dir / "resumes").iterdir())[-1].read_text())
    assert record["set_aside_steps"] == [2] and record["checkpoint_step"] == 8
    assert storage.logged_steps()[-1] == 9 and not leftover.exists()


@pytest.mark.slow
def test_a_resume_to_fewer_steps_than_the_run_has_is_refused_everywhere(uninterrupted, six_steps, storage_root):
    """Reported: `--resume --max-steps 5` on a finished 30-step run rewrote its summary as "5 / 5"."""
    from grpo_flow.deployments.grpo import DeploymentConfigError, resolve_config
    from grpo_flow.workers.state.resume import ResumeError, last_step

    summary = uninterrupted.summary_path.read_bytes()
    resumes = sorted(p.name for p in (uninterrupted.run_dir / "resumes").glob("*"))
    refused = cli(storage_root, uninterrupted.run_id, "--resume", "--max-steps", "5")
    assert refused.returncode == 2
    assert "--max-steps: 5 is below the last step of run 'kill-baseline', 8" in refused.stderr
    assert uninterrupted.summary_path.read_bytes() == summary
    assert sorted(p.name for p in (uninterrupted.run_dir / "resumes").glob("*")) == resumes

    last = last_step(six_steps)
    with pytest.raises(ResumeError, match=f"max_steps: 3 is below the last step of run 'six-baseline', {last}"):
        grpo(small_config(storage_root, "six-baseline", max_steps=3))
    with pytest.raises(
        DeploymentConfigError, match=f"max_steps: 3 is below the last step of run 'six-baseline', {last}"
    ):
        resolve_config("tiny", {"run_id": "six-baseline", "storage_root": str(storage_root), "max_steps": 3})
