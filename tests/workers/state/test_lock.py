"""One writer per run: the lock names its holder, refuses a second writer, and is taken over from a
holder that is gone (its pid, on this host; its lease, on another)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from grpo_flow.workers.state.lock import (
    LOCK_FILE,
    RunLock,
    RunLockedError,
    hold_run_lock,
    live_holder,
    read_holder,
    refuse_if_written,
    release_run_lock,
    release_run_locks_of,
    this_host,
)

HOLD = (
    "import sys, time\n"
    "from grpo_flow.workers.state.lock import RunLock\n"
    "RunLock(sys.argv[1], command='holder').acquire()\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


def holder_process(run_dir):
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_second_process_is_refused_naming_the_holder_and_takes_over_once_it_is_killed(tmp_path):
    """Real processes: a holder, then SIGKILL (the kernel drops its flock; its record stays behind)."""
    run_dir = tmp_path / "runs" / "r"
    holder = holder_process(run_dir)
    try:
        with pytest.raises(RunLockedError) as refused:
            RunLock(run_dir).acquire()
        message = str(refused.value)
        assert f"pid {holder.pid} on host {this_host()} since 20" in message and "(holder)" in message
        with pytest.raises(RunLockedError) as read_first:  # the start's early check, a read: the same words
            refuse_if_written(run_dir)
        assert str(read_first.value) == message
        assert live_holder(run_dir)["pid"] == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert read_holder(run_dir)["pid"] == holder.pid and live_holder(run_dir) is None  # left behind, and dead
    refuse_if_written(run_dir)  # a dead holder's record does not refuse
    lock = RunLock(run_dir).acquire()
    assert lock.taken_over["pid"] == holder.pid
    assert read_holder(run_dir)["pid"] == os.getpid()
    lock.release()
    assert not run_dir.exists()  # released: no lock file, and the folder it made for a new run is gone


def write_record(run_dir, **fields):
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"host": this_host(), "pid": os.getpid(), "since": "then", "expires": time.time() + 60, **fields}
    (run_dir / LOCK_FILE).write_text(json.dumps(record))


def test_on_a_volume_a_holder_on_another_host_counts_until_its_lease_expires(tmp_path):
    """No kernel lock reaches another container: the record's lease decides."""
    run_dir = tmp_path / "r"
    write_record(run_dir, host="modal-container-7", pid=12, expires=time.time() + 60)
    with pytest.raises(RunLockedError, match=r"pid 12 on host modal-container-7 since then, lease until 20"):
        RunLock(run_dir).acquire()
    write_record(run_dir, host="modal-container-7", pid=12, expires=time.time() - 1)
    lock = RunLock(run_dir).acquire()
    assert lock.taken_over["host"] == "modal-container-7"
    lock.release()


def test_a_record_naming_a_live_process_refuses_even_without_a_kernel_lock(tmp_path):
    """A file system without flock: the pid on this host decides (and a reused pid is told apart)."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        run_dir = tmp_path / "r"
        write_record(run_dir, pid=sleeper.pid)
        with pytest.raises(RunLockedError, match=f"pid {sleeper.pid} on host"):
            RunLock(run_dir).acquire()
        write_record(run_dir, pid=sleeper.pid, pid_start="1")  # the same pid, another process's start time
        RunLock(run_dir).acquire().release()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_holder_renews_its_lease(tmp_path):
    lock = RunLock(tmp_path / "r", lease_s=0.4).acquire()
    try:
        first = read_holder(tmp_path / "r")["expires"]
        time.sleep(0.35)
        assert read_holder(tmp_path / "r")["expires"] > first
    finally:
        lock.release()


def test_the_lock_is_reentrant_in_a_process_and_released_by_owner(tmp_path):
    run_dir = tmp_path / "r"
    first = hold_run_lock(run_dir)
    assert hold_run_lock(run_dir, owner="flow-run-1") is first  # the CLI took it; the flow finds it held
    with pytest.raises(RunLockedError):
        RunLock(run_dir).acquire()  # another holder in the same process is still refused
    release_run_locks_of("flow-run-2")
    assert first.held
    release_run_locks_of("flow-run-1")
    assert not first.held and read_holder(run_dir) is None
    release_run_lock(run_dir)  # nothing held: nothing happens
