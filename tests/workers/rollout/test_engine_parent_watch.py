"""A vLLM engine process lives as long as the process that started it, whichever thread started it."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CHILD = (
    "import os, sys, time; from grpo_flow.workers.rollout.vllm_server import die_with_parent; "
    "die_with_parent(int(sys.argv[1])); print('ready', flush=True); time.sleep(3); print('alive', flush=True)"
)


def start_child(parent_pid: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(parent_pid)], cwd=ROOT, stdout=subprocess.PIPE, text=True)


def test_an_engine_started_from_a_thread_outlives_the_thread():
    # PR_SET_PDEATHSIG killed it when its starting thread ended: the local backend starts engines
    # from pool threads, and the engines died at their first generate.
    started: list[subprocess.Popen] = []

    def start_and_end() -> None:  # the thread ends only once the child watches its parent
        child = start_child(os.getpid())
        started.append(child)
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"

    thread = threading.Thread(target=start_and_end)
    thread.start()
    thread.join()
    out, _ = started[0].communicate(timeout=60)
    assert started[0].returncode == 0 and out.strip() == "alive"


def test_an_engine_ends_when_its_parent_process_dies():
    # The parent starts the child, reports its pid, then exits at once: the child must not print.
    code = (
        "import subprocess, sys; "
        f"p = subprocess.Popen([sys.executable, '-c', {CHILD!r}, str(__import__('os').getpid())]); "
        "print(p.pid, flush=True)"
    )
    parent = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    child_pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"engine process {child_pid} outlived its parent")
    assert "alive" not in parent.stdout
