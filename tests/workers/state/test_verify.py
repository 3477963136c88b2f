"""`verify_run`: every step, checkpoint and metrics file checked; damage named, moved aside, never deleted;
and what resuming does with a damaged step before and after its checkpoint."""

import signal
import subprocess
import sys

import pyarrow as pa

from grpo_flow.schemas.records import metrics_table
from grpo_flow.workers.state.resume import find_resume_point
from grpo_flow.workers.state.storage import RunStorage
from grpo_flow.workers.state.verify import consequence, verify_run


def logged_run(tmp_path, steps=6, checkpoints=(2, 4)):
    storage = RunStorage(tmp_path, "r")
    storage.write_config({"x": 1})
    for step in range(1, steps + 1):
        for shard in range(2):
            table = pa.table({"step": pa.array([step] * 2, pa.int32()), "group_index": [shard, shard], "v": ["a", "b"]})
            storage.write_rollouts(step, shard, table)
        storage.commit_rollouts(step, num_shards=2)
        storage.write_metrics(
            step, metrics_table({"run_id": "r", "step": step, "policy_version": step, "num_completions": 4})
        )
        if step in checkpoints:
            staging = storage.staging_checkpoint_dir(step)
            (staging / "weights.bin").write_bytes(b"w" * step)
            storage.commit_checkpoint(step, staging, {"policy_version": step})
    return storage


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_clean_run_verifies_clean(tmp_path):
    check = verify_run(logged_run(tmp_path))
    assert check.clean and check.steps == 6 and check.shards == 12 and check.metrics == 6
    assert check.checkpoints == [2, 4] and check.newest_checkpoint == 4


def test_damage_is_named_moved_aside_and_the_next_check_is_clean(tmp_path):
    storage = logged_run(tmp_path)
    truncate(storage.rollout_dir(1) / "shard-01.parquet")
    (storage.checkpoint_dir(2) / "weights.bin").write_bytes(b"xx")  # same size, other bytes
    storage.metrics_path(3).write_bytes(b"not parquet")
    check = verify_run(storage)
    found = {(d.kind, d.step): d for d in check.damage}
    assert sorted(found) == [("checkpoint", 2), ("metrics", 3), ("rollouts", 1)]
    assert "rollouts/step-000001/shard-01.parquet" in found["rollouts", 1].problems[0]
    assert "weights.bin does not match its checksum" in found["checkpoint", 2].problems[0]
    assert "not needed to resume (checkpoint 4" in consequence(found["rollouts", 1], check.newest_checkpoint)
    assert storage.quarantined() == ["checkpoints-step-000002", "metrics-step-000003.parquet", "rollouts-step-000001"]
    assert (storage.run_dir / "quarantine" / "rollouts-step-000001" / "shard-00.parquet").exists()  # never deleted
    again = verify_run(storage)
    assert again.clean and again.steps == 5 and again.quarantined == storage.quarantined()


def test_nothing_is_moved_while_another_process_writes_the_run(tmp_path):
    storage = logged_run(tmp_path)
    truncate(storage.rollout_dir(5) / "shard-00.parquet")
    code = "import sys, time\nfrom grpo_flow.workers.state.lock import RunLock\nRunLock(sys.argv[1]).acquire()\nprint('held', flush=True)\ntime.sleep(600)\n"
    writer = subprocess.Popen([sys.executable, "-c", code, str(storage.run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "held"
        check = verify_run(storage)
        assert check.writer["pid"] == writer.pid and [d.moved_to for d in check.damage] == [None]
        assert storage.rollout_dir(5).exists() and storage.quarantined() == []
        assert consequence(check.damage[0], check.newest_checkpoint) == "a resume generates the step again"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()


def test_a_resume_sets_aside_a_damaged_step_before_its_checkpoint_and_regenerates_one_after(tmp_path, caplog):
    storage = logged_run(tmp_path)
    truncate(storage.rollout_dir(2) / "shard-01.parquet")  # before checkpoint 4: not needed
    rotten = storage.rollout_dir(5) / "shard-00.parquet"  # after it: replayed, so checked byte for byte
    data = bytearray(rotten.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rotten.write_bytes(bytes(data))
    point = find_resume_point(storage)
    assert point.checkpoint_step == 4 and point.replay_steps == (6,) and point.set_aside == (2, 5)
    assert storage.quarantined() == ["rollouts-step-000002", "rollouts-step-000005"]
    assert "not needed to resume (checkpoint 4 holds the weights trained on it)" in caplog.text
    assert "does not match its sha256" in caplog.text and "the step is generated again" in caplog.text
    # What the console says of each (issue 30, item 8): the file, why, where it went and what it means.
    assert point.moved[0].startswith("rollouts/step-000002: damaged (rollouts/step-000002/shard-01.parquet: ")
    assert point.moved[0].endswith(
        "moved to quarantine/rollouts-step-000002; not needed to resume (checkpoint 4 holds the weights trained "
        "on it); its rows are no longer part of the run's log"
    )
    assert point.moved[1].endswith("moved to quarantine/rollouts-step-000005; the step is generated again")


def test_a_damaged_config_is_named_by_verify_and_left_in_place(tmp_path):
    """`grpo verify` called a run with a corrupt config.json intact, while resume and eval failed on it
    with a JSONDecodeError traceback (issue 30, item 12)."""
    import pytest

    from grpo_flow.workers.state.storage import DamagedRunFileError
    from grpo_flow.workers.state.verify import report_lines

    storage = logged_run(tmp_path, steps=2, checkpoints=(2,))
    storage.config_path.write_text('{"model": "tiny", "datas')
    check = verify_run(storage)
    assert not check.clean and [d.kind for d in check.damage] == ["record"]
    assert storage.config_path.exists() and storage.quarantined() == []
    lines = report_lines(storage, check)
    assert lines[0].startswith("damaged: config.json: unreadable (Unterminated string")
    assert lines[1] == (
        "config.json: left in place; the run cannot be resumed or evaluated until it is restored from a backup"
    )
    with pytest.raises(DamagedRunFileError, match=r"config.json: unreadable \(Unterminated string"):
        storage.effective_config()
