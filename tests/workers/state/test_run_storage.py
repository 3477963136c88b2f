"""The storage root: atomic, append-only, and readable as plain Parquet and JSON."""

import json

import pyarrow as pa
import pytest

from schemas.records import metrics_table
from workers.state.storage import RunStorage, list_runs


def rows(step, groups, values):
    return pa.table(
        {
            "step": pa.array([step] * len(groups), pa.int32()),
            "group_index": groups,
            "sample_index": [0] * len(groups),
            "v": values,
        }
    )


def test_a_step_is_logged_whole_never_overwritten_and_read_back_in_order(tmp_path):
    storage = RunStorage(tmp_path, "r")
    first = rows(2, [1, 0], ["b", "a"])
    storage.write_rollouts(2, 0, first)
    with pytest.raises(FileNotFoundError, match=r"shards \[1\]"):
        storage.commit_rollouts(2, num_shards=2)  # shard 1 is not written yet
    assert (
        storage.rollout_steps() == [] and storage.read_rollouts().num_rows == 0
        if storage.rollout_dir(2).exists()
        else True
    )
    storage.write_rollouts(2, 1, rows(2, [2], ["c"]))
    storage.commit_rollouts(2, num_shards=2)
    assert storage.rollout_steps() == [2]
    with pytest.raises(FileExistsError):
        storage.write_rollouts(2, 0, first.slice(0, 1))
    with pytest.raises(FileExistsError):
        storage.commit_rollouts(2, num_shards=2)
    assert storage.read_rollouts(2).column("v").to_pylist() == ["a", "b", "c"]
    assert not list(storage.rollout_dir(2).glob(".*"))  # no temporary files left behind


def test_readers_never_see_a_staged_step(tmp_path):
    storage = RunStorage(tmp_path, "r")
    storage.write_rollouts(1, 0, rows(1, [0], ["done"]))
    storage.commit_rollouts(1, num_shards=1)
    storage.write_rollouts(2, 0, rows(2, [0], ["staged"]))
    assert storage.read_rollouts().column("v").to_pylist() == ["done"]
    assert storage.discard_staging() and storage.read_rollouts().column("v").to_pylist() == ["done"]


def test_a_truncated_shard_is_detected_and_quarantined_not_deleted(tmp_path):
    storage = RunStorage(tmp_path, "r")
    storage.write_rollouts(1, 0, rows(1, [0, 1], ["a", "b"]))
    storage.commit_rollouts(1, num_shards=1)
    shard = storage.rollout_dir(1) / "shard-00.parquet"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="damaged"):
        storage.check_rollouts(1)
    moved = storage.quarantine(storage.rollout_dir(1), "truncated")
    assert (moved / "shard-00.parquet").read_bytes() == data[: len(data) // 2]
    assert storage.rollout_steps() == []


def test_a_full_disk_leaves_no_partial_file_and_says_so(tmp_path, monkeypatch):
    import errno

    import pyarrow.parquet as pq

    from workers.state.storage import StorageFullError

    def full_disk(table, where, **kwargs):
        with open(where, "wb") as handle:
            handle.write(b"PAR1 partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    storage = RunStorage(tmp_path, "r")
    monkeypatch.setattr(pq, "write_table", full_disk)
    with pytest.raises(StorageFullError, match="no space left on the device while writing .*shard-00.parquet"):
        storage.write_rollouts(1, 0, rows(1, [0], ["a"]))
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_damaged_checkpoints_are_skipped_for_the_one_before(tmp_path, caplog):
    storage = RunStorage(tmp_path, "r")
    for step in (3, 6, 9):
        staging = storage.staging_checkpoint_dir(step)
        (staging / "weights.bin").write_bytes(b"w" * step)
        storage.commit_checkpoint(step, staging, {"policy_version": step})
    (storage.checkpoint_dir(9) / "manifest.json").unlink()  # died between files and manifest
    (storage.checkpoint_dir(6) / "weights.bin").write_bytes(b"x" * 6)  # same size, other bytes
    assert storage.latest_valid_checkpoint() == 3
    assert "no manifest.json" in caplog.text and "does not match its checksum" in caplog.text


def test_retention_keeps_the_last_n_and_every_mth(tmp_path):
    storage = RunStorage(tmp_path, "r")
    for step in range(1, 11):
        staging = storage.staging_checkpoint_dir(step)
        (staging / "w").write_bytes(b"w")
        storage.commit_checkpoint(step, staging, {})
        storage.prune_checkpoints(keep_last=2, keep_every=4)
    assert storage.complete_checkpoints() == [4, 8, 9, 10]


def test_metrics_with_different_columns_per_step(tmp_path):
    storage = RunStorage(tmp_path, "r")
    storage.write_metrics(1, metrics_table({"run_id": "r", "step": 1, "policy_version": 1, "num_completions": 4}))
    storage.write_metrics(
        2, metrics_table({"run_id": "r", "step": 2, "policy_version": 2, "num_completions": 4, "kl": 0.1})
    )
    rows = storage.read_metrics().to_pylist()
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["kl"] is None and rows[1]["kl"] == 0.1
    assert storage.logged_steps() == [1, 2]


def test_checkpoint_is_complete_only_with_its_manifest(tmp_path):
    storage = RunStorage(tmp_path, "r")
    staging = storage.staging_checkpoint_dir(3)
    (staging / "weights.bin").write_bytes(b"abc")
    unfinished = storage.staging_checkpoint_dir(6)  # a writer that died before committing
    (unfinished / "weights.bin").write_bytes(b"partial")
    final = storage.commit_checkpoint(3, staging, {"policy_version": 3})
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["files"]["weights.bin"]["bytes"] == 3
    assert manifest["files"]["weights.bin"]["sha256"].startswith("ba7816bf")  # sha256("abc")
    assert storage.complete_checkpoints() == [3]


def test_list_runs_reports_status_and_last_step(tmp_path):
    done, running = RunStorage(tmp_path, "done"), RunStorage(tmp_path, "running")
    for storage in (done, running):
        storage.write_config({"x": 1})
        storage.write_metrics(
            1, metrics_table({"run_id": storage.run_id, "step": 1, "policy_version": 1, "num_completions": 1})
        )
    done.write_summary({"status": "completed"})
    with pytest.raises(FileExistsError):
        done.write_config({"x": 2})
    assert [(r.run_id, r.status, r.last_step) for r in list_runs(tmp_path)] == [
        ("done", "completed", 1),
        ("running", "incomplete", 1),
    ]
