"""workers/rewards/deadline.py: user code in a long-lived process of its own, which ends with its owner."""

import asyncio
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo_flow.workers.rewards.deadline import close_all, import_paths, user_code


def gone(pid, within_s=30.0):
    """Whether process `pid` has ended within `within_s` (a liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


async def doubled(x):
    await asyncio.sleep(0)
    return 2 * x, os.getpid()


def test_an_async_callable_is_awaited_in_the_process_and_close_all_ends_it():
    value, pid = user_code([doubled], key="doubled").call(0, 30, 21)
    assert value == 42 and pid != os.getpid()
    close_all()
    assert gone(pid)


PARENT = """
import os, sys, threading, time
sys.path[:0] = {paths!r}
from grpo_flow.workers.rewards.deadline import user_code
worker = user_code([os.getpid, time.sleep], key="owned")
print(worker.call(0, 30), flush=True)
threading.Thread(target=worker.call, args=(1, 3600, 3600), daemon=True).start()  # busy in C
time.sleep(1)
os._exit(0)  # gone without closing it: no exit handlers run
"""


@pytest.mark.parametrize("how", ["exits", "is killed"])
def test_a_busy_process_ends_when_its_owner_does(how):
    program = PARENT.format(paths=import_paths())
    if how == "is killed":
        program = program.replace("os._exit(0)", "import signal; os.kill(os.getpid(), signal.SIGKILL)")
    owner = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    child = int(owner.stdout.strip())
    assert gone(child)


MEETING = threading.Barrier(2, timeout=60)  # in the process that holds `meet`: its own copy of this module


def meet():
    MEETING.wait()  # returns only when two calls are in here at once
    return os.getpid()


def test_overlapping_calls_run_at_once_in_one_process():
    worker = user_code([meet], key="meet")
    with ThreadPoolExecutor(2) as pool:
        pids = list(pool.map(lambda _: worker.call(0, 60), range(2)))
    assert pids[0] == pids[1] != os.getpid()
