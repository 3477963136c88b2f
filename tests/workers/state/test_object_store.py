"""RunStorage, the writer lock and `verify_run` on an object store, through fsspec's `memory://` file system:
a commit is a manifest written last, what has none is skipped and removed, the lock is an object taken by
exclusive create, and nothing lands in a local folder named after the URL."""

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid

import fsspec
from fsspec.implementations.memory import MemoryFileSystem
import pyarrow as pa
import pytest

from grpo_flow.flows.checks import StartCheckError, check_storage_root
from grpo_flow.workers.state.location import StorageURLError, root_path
from grpo_flow.workers.state import lock as lock_module
from grpo_flow.workers.state.lock import RunLock, RunLockedError, read_holder, this_host
from grpo_flow.workers.state.storage import MANIFEST, RunStorage, list_runs, remote_key
from grpo_flow.workers.state.verify import verify_run


@pytest.fixture
def storage(tmp_path, monkeypatch):
    """A run on a fresh `memory://` root; the local cache and the working folder are empty temp folders."""
    monkeypatch.setenv("GRPO_FLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    root = f"memory://grpo-{uuid.uuid4().hex[:8]}/root"
    run = RunStorage(root, "run")
    run.write_config({"model": "tiny"})
    yield run
    fsspec.filesystem("memory").rm(remote_key(root_path(root)), recursive=True)


def rollouts(step: int, rows: int = 4) -> pa.Table:
    return pa.table(
        {"step": [step] * rows, "group_index": [0] * rows, "sample_index": list(range(rows)), "reward": [1.0] * rows}
    )


def checkpoint(storage: RunStorage, step: int) -> None:
    staging = storage.staging_checkpoint_dir(step)
    (staging / "model").mkdir()
    (staging / "model" / "model.safetensors").write_bytes(b"weights" * 100)
    (staging / "optimizer.pt").write_bytes(b"moments")
    storage.commit_checkpoint(step, staging, {"policy_version": step})


def test_a_step_is_logged_once_its_manifest_is_written_last(storage):
    storage.write_rollouts(1, 0, rollouts(1))
    storage.write_rollouts(1, 1, rollouts(1))
    assert storage.rollout_dir(1).is_dir()  # the shards are at their final keys...
    assert storage.rollout_steps() == [] and not storage.rollouts_committed(1)  # ...but the step is not logged
    storage.commit_rollouts(1, num_shards=2)
    assert storage.rollout_steps() == [1] and storage.step_problems(1) == []
    assert storage.read_rollouts().num_rows == 8
    with pytest.raises(FileExistsError):
        storage.write_rollouts(1, 0, rollouts(1))


def test_a_checkpoint_is_uploaded_then_committed_by_its_manifest_and_read_back_locally(storage):
    checkpoint(storage, 2)
    assert storage.complete_checkpoints() == [2] and storage.checkpoint_committed(2)
    assert set(storage.verify_checkpoint(2)["files"]) == {"model/model.safetensors", "optimizer.pt"}
    local = storage.local_checkpoint(2)
    assert (local / "model" / "model.safetensors").read_bytes() == b"weights" * 100
    assert storage.local_checkpoint(2) == local  # downloaded once per manifest
    assert not list((storage.local_run_dir / "checkpoints").glob(".*"))  # the upload's staging folder is gone


def test_pruning_removes_a_checkpoints_objects(storage):
    for step in (2, 4, 6):
        checkpoint(storage, step)
    assert storage.prune_checkpoints(keep_last=1, keep_every=4) == [2]
    assert storage.complete_checkpoints() == [4, 6]
    assert not storage.checkpoint_dir(2).exists()


def test_what_a_killed_writer_left_uncommitted_is_skipped_then_removed_by_the_next_writer(storage):
    storage.write_rollouts(1, 0, rollouts(1))
    storage.commit_rollouts(1, num_shards=1)
    storage.write_rollouts(2, 0, rollouts(2))  # killed before the step's manifest
    checkpoint(storage, 2)
    (storage.checkpoint_dir(2) / MANIFEST).unlink()  # a checkpoint killed before its manifest: not one
    assert storage.rollout_steps() == [1] and storage.checkpoint_steps() == []
    assert storage.read_rollouts().num_rows == 4 and storage.latest_valid_checkpoint() is None
    assert sorted(p.name for p in storage.uncommitted()) == ["step-000002", "step-000002"]
    storage.discard_staging()
    assert (
        storage.uncommitted() == [] and not storage.rollout_dir(2).exists() and not storage.checkpoint_dir(2).exists()
    )
    assert storage.rollout_steps() == [1]


def test_verify_names_a_damaged_object_and_moves_it_aside(storage):
    storage.write_rollouts(1, 0, rollouts(1))
    storage.commit_rollouts(1, num_shards=1)
    shard = storage.rollout_path(1, 0)
    shard.write_bytes(shard.read_bytes()[:-20])
    check = verify_run(storage)
    [problem] = [problem for damage in check.damage for problem in damage.problems]
    assert problem.startswith("rollouts/step-000001/shard-00.parquet: ") and "its manifest says" in problem
    assert storage.quarantined() == ["rollouts-step-000001"] and storage.rollout_steps() == []


def test_the_lock_object_refuses_a_live_writer_and_is_taken_over_from_a_gone_one(storage):
    first = RunLock(storage.run_dir, command="first").acquire()
    with pytest.raises(RunLockedError, match=f"pid {os.getpid()} on host {this_host()}"):
        RunLock(storage.run_dir).acquire()
    first.release()
    assert read_holder(storage.run_dir) is None

    def planted(**fields):
        record = {"host": "elsewhere", "pid": 1, "token": "t", "expires": time.time() + 60, **fields}
        (storage.run_dir / "writer.lock" / "000000000007").write_text(json.dumps(record))  # a generation

    planted()  # another host, its lease running
    with pytest.raises(RunLockedError, match="host elsewhere"):
        RunLock(storage.run_dir).acquire()
    planted(expires=time.time() - 1)  # its lease expired: taken over
    lock = RunLock(storage.run_dir).acquire()
    assert lock.taken_over["host"] == "elsewhere" and read_holder(storage.run_dir)["token"] == lock.token
    assert [p.name for p in (storage.run_dir / "writer.lock").iterdir()] == ["000000000008"]  # the old one removed
    lock.release()
    planted(host=this_host(), pid=2**22 + 1)  # this host, a process that is gone: taken over at once
    with RunLock(storage.run_dir) as lock:
        assert lock.taken_over["pid"] == 2**22 + 1


@pytest.fixture
def atomic_create(monkeypatch):
    """memory://'s exclusive create checks that a key is free, then creates it, in two Python steps that
    threads can interleave; S3 (`If-None-Match: *`) and GCS (`ifGenerationMatch=0`) do both at once on the
    server. This gives the memory store the servers' guarantee, so many threads can race on it."""
    guard = threading.Lock()
    create = MemoryFileSystem._open

    def _open(self, path, mode="rb", *args, **kwargs):
        if "x" not in mode:
            return create(self, path, mode, *args, **kwargs)
        with guard:
            return create(self, path, mode, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "_open", _open)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between every few bytecodes: the races happen
    yield
    sys.setswitchinterval(switch)


def expired_holder(storage: RunStorage, monkeypatch, lease_s: float = 0.2) -> RunLock:
    """A holder on another host whose lease has run out (its renewer stopped, as a stalled process's)."""
    with monkeypatch.context() as patch:
        patch.setattr(lock_module, "this_host", lambda: "elsewhere")
        holder = RunLock(storage.run_dir, lease_s=lease_s, command="stalled").acquire()
    holder._stop_renewer()
    time.sleep(lease_s * 1.5)
    return holder


def take_together(storage: RunStorage, takers: int) -> list[RunLock | RunLockedError]:
    """What each of `takers` threads, started together, got from `RunLock.acquire()`."""
    start, outcomes = threading.Barrier(takers), []

    def take(taker: int) -> None:
        start.wait()
        try:
            outcomes.append(RunLock(storage.run_dir, command=f"taker-{taker}").acquire())
        except RunLockedError as refused:
            outcomes.append(refused)

    threads = [threading.Thread(target=take, args=(taker,)) for taker in range(takers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def race_to_take_over(storage: RunStorage, monkeypatch, takers: int = 12) -> None:
    """Takers started together on an expired lease: exactly one wins, the others are refused naming it
    (three rounds: the losing interleavings are many)."""
    for _ in range(3):
        expired_holder(storage, monkeypatch)
        outcomes = take_together(storage, takers)
        [winner] = [outcome for outcome in outcomes if isinstance(outcome, RunLock)]
        assert winner.taken_over["command"] == "stalled"
        assert read_holder(storage.run_dir)["token"] == winner.token
        refused = [str(outcome) for outcome in outcomes if isinstance(outcome, RunLockedError)]
        assert len(refused) == takers - 1 and all(f"({winner.command})" in message for message in refused)
        winner.release()
        assert read_holder(storage.run_dir) is None


def test_many_takers_of_one_expired_lease_one_wins_and_the_others_are_refused_naming_it(
    storage, atomic_create, monkeypatch
):
    race_to_take_over(storage, monkeypatch)


def test_many_takers_of_one_expired_lease_on_s3_one_wins(s3_root, monkeypatch):
    storage = RunStorage(s3_root, "race")
    storage.write_config({"model": "tiny"})
    race_to_take_over(storage, monkeypatch, takers=8)


def test_a_holder_whose_lease_was_taken_over_stops_renewing(storage, monkeypatch, caplog):
    stalled = expired_holder(storage, monkeypatch, lease_s=0.4)
    taker = RunLock(storage.run_dir, command="taker").acquire()
    assert taker.taken_over["command"] == "stalled"
    with caplog.at_level(logging.ERROR, logger="grpo_flow.lock"):
        stalled._start_renewer()  # the stalled process wakes up and renews
        stalled._renewer.join(timeout=5)
    assert not stalled._renewer.is_alive() and not stalled.held
    assert "the writer lock was taken over by " in caplog.text and "(taker)" in caplog.text
    time.sleep(0.2)
    assert read_holder(storage.run_dir)["token"] == taker.token
    stalled.release()  # deletes nothing of the new holder's
    assert read_holder(storage.run_dir)["token"] == taker.token
    taker.release()


def test_list_runs_and_nothing_in_a_local_folder_named_after_the_url(storage, tmp_path):
    storage.write_rollouts(1, 0, rollouts(1))
    storage.commit_rollouts(1, num_shards=1)
    storage.write_metrics(1, pa.table({"step": [1], "loss": [0.5]}))
    storage.write_summary({"status": "completed"})
    [info] = list_runs(str(storage.root))
    assert (info.run_id, info.status, info.last_step, info.damaged) == ("run", "completed", 1, ())
    assert sorted(os.listdir(tmp_path)) == []  # no `memory:` folder in the working folder, no cache used


def test_a_scheme_whose_client_is_missing_names_the_extra():
    with pytest.raises(StartCheckError, match=r"gs://.*pip install 'grpo-flow\[gcs\]'"):
        check_storage_root("gs://bucket/grpo")
    with pytest.raises(StorageURLError, match="no file system for nosuch://"):
        RunStorage("nosuch://bucket/grpo", "run")


def test_a_missing_bucket_and_an_unreachable_endpoint_are_named_in_one_line(s3_server, monkeypatch):
    import s3fs

    with pytest.raises(StartCheckError, match=r"^storage_root: 's3://no-such-bucket/grpo' cannot be written: "):
        check_storage_root("s3://no-such-bucket/grpo")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()  # s3fs keeps one client per set of arguments, not per environment
    try:
        with pytest.raises(StartCheckError, match=r"'s3://any-bucket/grpo' cannot be written: Could not connect"):
            check_storage_root("s3://any-bucket/grpo")
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_missing_credentials_are_named_with_the_url(s3_server, monkeypatch, tmp_path):
    import s3fs

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(StartCheckError, match=r"'s3://any-bucket/grpo' cannot be written: .*credentials"):
            check_storage_root("s3://any-bucket/grpo")
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_storage_options_carry_the_endpoint_when_the_environment_has_none(s3_server, monkeypatch):
    """`--storage-options '{"endpoint_url": ...}'` (a run's `storage_options`) reaches every reader and writer of
    the run in the process, as pandas' `storage_options` would, with no AWS_ENDPOINT_URL to fall back on."""
    import fsspec.config
    import s3fs

    from grpo_flow.flows.cli import use_cli_storage_options

    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setattr(fsspec.config, "conf", {})  # this test's defaults only
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        use_cli_storage_options("s3://options-bucket/grpo", json.dumps({"endpoint_url": s3_server}))
        s3fs.S3FileSystem(endpoint_url=s3_server).mkdir("options-bucket")
        run = RunStorage("s3://options-bucket/grpo", "run")
        run.write_config({"model": "tiny"})
        with RunLock(run.run_dir):
            assert read_holder(run.run_dir)["pid"] == os.getpid()
        stored = s3fs.S3FileSystem(endpoint_url=s3_server).cat_file("options-bucket/grpo/runs/run/config.json")
        assert json.loads(stored)["model"] == "tiny"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_a_url_root_the_modal_containers_cannot_reach_is_refused_naming_what_works():
    from grpo_flow.flows.checks import check_before_start
    from grpo_flow.schemas.presets import preset_config

    config = preset_config("tiny", storage_root="memory://bucket/grpo", backend="modal")
    with pytest.raises(
        StartCheckError, match=r"storage_root: .* through s3fs or gcsfs \(s3://, gs://\), not memory://"
    ):
        check_before_start(config)  # each container would have a memory of its own
    check_before_start(config.model_copy(update={"backend": "ray"}))  # Ray asks each node at start


def test_clear_cache_on_a_url_root_clears_the_local_model_cache(tmp_path, monkeypatch, capsys):
    from grpo_flow.flows.cli import main

    monkeypatch.setenv("GRPO_FLOW_CACHE", str(tmp_path))
    (tmp_path / "models" / "tiny-qwen2").mkdir(parents=True)
    (tmp_path / "models" / "tiny-qwen2" / "model.safetensors").write_bytes(b"x" * 1000)
    assert main(["clear-cache", "--storage-root", "memory://bucket/grpo"]) == 0
    assert f"deleted {tmp_path / 'models' / 'tiny-qwen2'}" in capsys.readouterr().out
    assert not (tmp_path / "models" / "tiny-qwen2").exists()


def test_a_process_that_read_rollouts_from_a_bucket_exits_cleanly(s3_root):
    """pyarrow reading through an fsspec file system calls Python from its I/O threads; one still at it
    as the interpreter exits aborts the process (apache/arrow#39162): most exits of such a read did."""

    storage, rows = RunStorage(s3_root, "read"), 100_000
    completions = [str(i) * 5 for i in range(rows)]
    table = pa.table({"completion": completions, "completion_ids": [list(range(20))] * rows})
    for shard in range(4):
        storage.write_rollouts(1, shard, table)
    storage.commit_rollouts(1, num_shards=4)
    program = (
        "from grpo_flow.workers.state.storage import RunStorage\n"
        f"print(RunStorage({s3_root!r}, 'read').read_rollouts(1, columns=['completion']).num_rows)\n"
    )
    for _ in range(5):
        read = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
        assert (read.returncode, read.stdout.strip()) == (0, str(4 * rows)), read.stderr[-2000:]
