"""The storage root: atomic, append-only, and readable as plain Parquet and JSON."""

import json

import pyarrow as pa
import pytest

from grpo_flow.schemas.records import metrics_table
from grpo_flow.workers.state.storage import RunStorage, list_runs


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

    from grpo_flow.workers.state.storage import StorageFullError

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
    # The README's way with pandas alone, file by file, keeps the column the first file lacks.
    import glob

    import pandas as pd

    metrics = pd.concat(map(pd.read_parquet, sorted(glob.glob(f"{storage.run_dir}/metrics/*.parquet"))))
    assert list(metrics["step"]) == [1, 2] and metrics["kl"].isna().tolist() == [True, False]


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
    # One unreadable summary.json costs its run its status, never the listing of every run.
    running.summary_path.write_text("{bad")
    listed = {r.run_id: r for r in list_runs(tmp_path)}
    assert listed["done"].status == "completed" and listed["running"].status == "incomplete"
    assert listed["running"].damaged == ("summary.json: unreadable (not a JSON object)",)
    assert running.read_summary() is None


def test_a_summary_is_strict_json_with_null_for_what_was_not_measured(tmp_path):
    storage = RunStorage(tmp_path, "r")
    storage.write_summary({"status": "completed", "initial_eval_accuracy": float("nan"), "final_reward": 0.5})
    text = storage.summary_path.read_text()
    assert "NaN" not in text and '"initial_eval_accuracy": null' in text
    assert storage.read_summary() == {"status": "completed", "initial_eval_accuracy": None, "final_reward": 0.5}


# -- step manifests: integrity of committed steps ----------------------------------------------------------
def committed(tmp_path, steps=(1, 2, 3), shards=2):
    storage = RunStorage(tmp_path, "r")
    for step in steps:
        for shard in range(shards):
            storage.write_rollouts(step, shard, rows(step, [shard * 2, shard * 2 + 1], [f"{step}{shard}a", "b"]))
        storage.commit_rollouts(step, num_shards=shards)
    return storage


def test_a_committed_step_has_a_manifest_with_each_shards_size_and_sha256(tmp_path):
    import hashlib

    storage = committed(tmp_path, steps=(1,))
    manifest = json.loads((storage.rollout_dir(1) / "_manifest.json").read_text())
    assert manifest["step"] == 1 and sorted(manifest["files"]) == ["shard-00.parquet", "shard-01.parquet"]
    shard = storage.rollout_dir(1) / "shard-01.parquet"
    assert manifest["files"]["shard-01.parquet"] == {
        "bytes": shard.stat().st_size,
        "sha256": hashlib.sha256(shard.read_bytes()).hexdigest(),
    }
    assert storage.step_problems(1) == [] and storage.read_rollouts(1).num_rows == 4


def test_damage_to_a_logged_step_is_named_file_by_file(tmp_path):
    storage = committed(tmp_path)
    folder = storage.rollout_dir(2)
    truncated = folder / "shard-01.parquet"
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    half = f"rollouts/step-000002/shard-01.parquet: {len(data) // 2} bytes, its manifest says {len(data)}"
    assert storage.step_problems(2, checksums=False) == [half]  # the size check alone finds truncation
    rotten = storage.rollout_dir(3) / "shard-00.parquet"
    data = bytearray(rotten.read_bytes())
    data[len(data) // 2] ^= 0xFF  # bit rot: same size
    rotten.write_bytes(bytes(data))
    assert storage.step_problems(3, checksums=False) == []  # sizes cannot see it ...
    assert storage.step_problems(3) == [  # ... the checksum does
        "rollouts/step-000003/shard-00.parquet: does not match its sha256 in _manifest.json"
    ]
    (storage.rollout_dir(1) / "shard-00.parquet").unlink()
    (storage.rollout_dir(1) / "shard-07.parquet").write_bytes(b"stray")
    assert storage.step_problems(1) == [
        "rollouts/step-000001/shard-00.parquet: missing",
        "rollouts/step-000001/shard-07.parquet: not in the step's _manifest.json",
    ]


def test_reading_a_damaged_step_fails_naming_the_file_and_reading_the_run_skips_it(tmp_path, caplog):
    """pyarrow alone returned the intact shard's rows of a truncated step without a word."""
    from grpo_flow.workers.state.storage import DamagedStepError

    storage = committed(tmp_path)
    shard = storage.rollout_dir(2) / "shard-01.parquet"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(DamagedStepError, match=r"step-000002/shard-01.parquet: 100 bytes, its manifest says"):
        storage.read_rollouts(2)
    table = storage.read_rollouts()
    assert sorted(set(table.column("step").to_pylist())) == [1, 3] and table.num_rows == 8
    assert "skipping step 2, its rollouts are damaged" in caplog.text


def test_the_manifest_stays_out_of_pandas_and_pyarrow_reading_the_run(tmp_path):
    import pandas as pd
    import pyarrow.parquet as pq

    storage = committed(tmp_path)
    assert len(pd.read_parquet(storage.run_dir / "rollouts")) == 12
    assert pq.read_table(storage.run_dir / "rollouts").num_rows == 12


def test_a_step_logged_before_manifests_is_read_in_full_instead(tmp_path):
    storage = committed(tmp_path, steps=(1,))
    (storage.rollout_dir(1) / "_manifest.json").unlink()  # as an older grpo-flow committed it
    assert storage.step_problems(1) == [] and storage.step_problems(1, checksums=False) == []
    shard = storage.rollout_dir(1) / "shard-00.parquet"
    shard.write_bytes(shard.read_bytes()[:50])
    assert storage.step_problems(1, checksums=False) == []  # nothing to compare sizes with
    (problem,) = storage.step_problems(1)
    assert problem.startswith("rollouts/step-000001/shard-00.parquet: unreadable Parquet")


def test_an_unreadable_metrics_file_is_skipped_with_a_warning(tmp_path, caplog):
    storage = RunStorage(tmp_path, "r")
    for step in (1, 2):
        storage.write_metrics(
            step, metrics_table({"run_id": "r", "step": step, "policy_version": step, "num_completions": 4})
        )
    storage.metrics_path(1).write_bytes(b"PAR1 nothing")
    assert storage.read_metrics().column("step").to_pylist() == [2]
    assert "skipping metrics/step-000001.parquet" in caplog.text


# -- temporary files of killed writers ----------------------------------------------------------------------
def test_a_killed_writers_temporary_file_is_cleaned_and_a_live_ones_kept(tmp_path):
    """A real process creates its temporary file as atomic writes name them, then is killed."""
    import os
    import signal
    import subprocess
    import sys

    from grpo_flow.workers.state.storage import STALE_TEMP_AGE_S, temp_prefix

    storage = RunStorage(tmp_path, "r")
    storage.write_config({"x": 1})
    metrics = storage.run_dir / "metrics"
    metrics.mkdir()
    code = (
        "import os, signal, tempfile, sys\n"
        "from grpo_flow.workers.state.storage import temp_prefix\n"
        "tempfile.mkstemp(dir=sys.argv[1], prefix=temp_prefix('step-000001.parquet'), suffix='.tmp')\n"
        "os.kill(os.getpid(), signal.SIGKILL)  # killed mid-write\n"
    )
    killed = subprocess.Popen([sys.executable, "-c", code, str(metrics)])
    assert killed.wait() == -signal.SIGKILL
    (leftover,) = metrics.glob(".*.tmp")
    assert leftover.name.startswith(f".step-000001.parquet.w{killed.pid}@")
    live = metrics / f"{temp_prefix('step-000002.parquet')}abc.tmp"  # this process: alive
    live.write_bytes(b"being written")
    old = storage.run_dir / ".config.json.legacyname.tmp"  # no writer in its name: judged by age
    old.write_bytes(b"")
    os.utime(old, (0, 0))
    recent = storage.run_dir / ".summary.json.legacyname.tmp"
    recent.write_bytes(b"")
    removed = storage.clean_temps()
    assert sorted(p.name for p in removed) == sorted([leftover.name, old.name])
    assert live.exists() and recent.exists() and not leftover.exists()
    assert STALE_TEMP_AGE_S >= 3600


def test_a_killed_tiny_model_build_is_cleaned_at_the_next_start(tmp_path):
    """`models/.tiny-qwen2.*.tmp` of a build killed midway (a real process, SIGKILLed while building)."""
    import signal
    import subprocess
    import sys
    import time

    from grpo_flow.workers.data.tiny_model import TINY_DIR, ensure_tiny_model, tiny_model_path

    models = tmp_path / "models"
    builder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from grpo_flow.workers.data.tiny_model import ensure_tiny_model as e; e(sys.argv[1])",
        ]
        + [str(tmp_path)]
    )
    deadline = time.monotonic() + 120
    while not list(models.glob(f".{TINY_DIR}.*.tmp")) and builder.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    (leftover,) = models.glob(f".{TINY_DIR}.*.tmp")
    assert f".w{builder.pid}@" in leftover.name
    # The next start (a finished build already in place, so nothing is built again here).
    tiny_model_path(tmp_path).mkdir()
    (tiny_model_path(tmp_path) / "build_info.json").write_text("{}")
    assert ensure_tiny_model(tmp_path) == tiny_model_path(tmp_path)
    assert not leftover.exists()


UMASK_SCRIPT = """
import json, os, sys
os.umask(int(sys.argv[2], 8))
from pathlib import Path
import pyarrow as pa, torch
from safetensors.torch import save_file
from grpo_flow.schemas.records import metrics_table
from grpo_flow.workers.state.storage import build_once
from grpo_flow.workers.state.lock import hold_run_lock
from grpo_flow.workers.state.storage import RunStorage

root = Path(sys.argv[1])
storage = RunStorage(root, "r")
storage.write_config({"x": 1})
hold_run_lock(storage.run_dir)
storage.write_rollouts(1, 0, pa.table({"step": [1]}))
storage.commit_rollouts(1, num_shards=1)
storage.write_metrics(1, metrics_table({"run_id": "r", "step": 1, "policy_version": 1, "num_completions": 1}))
staging = storage.staging_checkpoint_dir(1)
(staging / "model").mkdir()
save_file({"w": torch.zeros(2)}, staging / "model" / "model.safetensors")  # safetensors writes 0600 itself
storage.commit_checkpoint(1, staging, {})

def build(folder):
    save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
    return {}

build_once(root / "models" / "built", build)
modes = {str(p.relative_to(root)): oct(p.stat().st_mode & 0o777) for p in sorted(root.rglob("*"))}
print(json.dumps(modes))
"""


@pytest.mark.parametrize("umask", ["002", "022"])
def test_run_files_and_folders_get_the_modes_the_umask_gives(tmp_path, umask):
    """Every run file was 0600 and every checkpoint folder 0700 whatever the umask (mkstemp, mkdtemp, and
    safetensors' own 0600), so teammates and Ray workers of another user could not read a run on shared
    storage (issue 30, item 10). In a process of its own: the umask is read once per process."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", UMASK_SCRIPT, str(tmp_path), umask], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    modes = json.loads(done.stdout.splitlines()[-1])
    file_mode, folder_mode = oct(0o666 & ~int(umask, 8)), oct(0o777 & ~int(umask, 8))
    for path in (
        "runs/r",
        "runs/r/rollouts/step-000001",
        "runs/r/checkpoints/step-000001",
        "runs/r/checkpoints/step-000001/model",
        "models/built",
    ):
        assert modes[path] == folder_mode, (path, modes[path])
    for path in (
        "runs/r/config.json",
        "runs/r/run.json",
        "runs/r/writer.lock",
        "runs/r/rollouts/step-000001/shard-00.parquet",
        "runs/r/rollouts/step-000001/_manifest.json",
        "runs/r/metrics/step-000001.parquet",
        "runs/r/checkpoints/step-000001/manifest.json",
        "runs/r/checkpoints/step-000001/model/model.safetensors",
        "models/built/model.safetensors",
    ):
        assert modes[path] == file_mode, (path, modes[path])
