"""The storage root: atomic, append-only, and readable as plain Parquet and JSON."""

import json

import pyarrow as pa
import pytest

from schemas.records import metrics_table
from workers.storage import RunStorage, list_runs


def test_rollouts_are_never_overwritten_and_read_back_in_order(tmp_path):
    storage = RunStorage(tmp_path, "r")
    first = pa.table({"step": pa.array([2, 2], pa.int32()), "group_index": [1, 0], "sample_index": [0, 0], "v": ["b", "a"]})
    storage.write_rollouts(2, 0, first)
    storage.write_rollouts(2, 1, pa.table({"step": pa.array([2], pa.int32()), "group_index": [2], "sample_index": [0], "v": ["c"]}))
    with pytest.raises(FileExistsError):
        storage.write_rollouts(2, 0, first.slice(0, 1))
    assert storage.read_rollouts(2).column("v").to_pylist() == ["a", "b", "c"]
    assert not list(storage.rollout_dir(2).glob(".*"))  # no temporary files left behind


def test_metrics_with_different_columns_per_step(tmp_path):
    storage = RunStorage(tmp_path, "r")
    storage.write_metrics(1, metrics_table({"run_id": "r", "step": 1, "policy_version": 1, "num_completions": 4}))
    storage.write_metrics(2, metrics_table({"run_id": "r", "step": 2, "policy_version": 2, "num_completions": 4, "kl": 0.1}))
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
        storage.write_metrics(1, metrics_table({"run_id": storage.run_id, "step": 1, "policy_version": 1, "num_completions": 1}))
    done.write_summary({"status": "completed"})
    with pytest.raises(FileExistsError):
        done.write_config({"x": 2})
    assert [(r.run_id, r.status, r.last_step) for r in list_runs(tmp_path)] == [("done", "completed", 1), ("running", "incomplete", 1)]
