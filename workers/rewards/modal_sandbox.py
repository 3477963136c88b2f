"""Reward code in a `modal.Sandbox` with the network blocked: `LocalSandbox`'s interface
(workers/rewards/sandbox.py), so a `CodeTestsEnvironment` runs its tests in either.

UNTESTED HERE against real Modal (no network to it): the tests drive it with a fake `Sandbox.create`.
Imports `modal`; from grpo-flow, the local sandbox's records.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import modal

from grpo_flow.workers.rewards.sandbox import SCRIPT_NAME, SandboxLimits, SandboxResult, run_each

SANDBOX_APP_NAME = "grpo-flow-sandbox"  # the app sandboxes belong to outside a running grpo-flow app
SANDBOX_PYTHON = "3.11"
SANDBOX_TIMEOUT_S = 10 * 60


def sandbox_image() -> modal.Image:
    """A bare Python for reward code (no project code, no network)."""
    return modal.Image.debian_slim(python_version=SANDBOX_PYTHON)


# Run inside the sandbox as `python -I -B -c BOOTSTRAP`. The first line of stdin is a JSON payload
# (the code and its files: an argv string is capped at 128 KiB by Linux, stdin is not); the rest
# of stdin is the program's. The code runs as main.py in a fresh directory, as in LocalSandbox.
BOOTSTRAP = """\
import json, os, runpy, sys, tempfile
payload = json.loads(sys.stdin.readline())
work = tempfile.mkdtemp(prefix="run-")
for name, text in {**payload["files"], payload["script"]: payload["code"]}.items():
    path = os.path.join(work, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(text)
os.chdir(work)
sys.path.insert(0, work)
sys.argv = [payload["script"]]
runpy.run_path(payload["script"], run_name="__main__")
"""


def _capped(text: str, limit: int) -> tuple[str, bool]:
    data = text.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return text, False
    return data[:limit].decode("utf-8", errors="ignore"), True


def _exit_status(returncode: int) -> tuple[int | None, str | None, bool]:
    """(exit_code, signal, timed_out) from Modal's return code.

    Modal reports an exec that passed its timeout as -1, and a process ended by signal N as
    128 + N (modal/container_process.py), the shell's convention; a program that exits with
    such a status itself reads the same.
    """
    import signal

    if returncode == -1:
        return None, "SIGKILL", True
    if returncode > 128:
        try:
            return None, signal.Signals(returncode - 128).name, False
        except ValueError:
            pass
    return returncode, None, False


class ModalSandboxExecutor:
    """LocalSandbox's `run` / `run_batch` in a `modal.Sandbox` with the network blocked (UNTESTED against real Modal).

    One sandbox is created on first use and reused for every run (each run is a new process
    in a fresh directory of it: `sb.exec("python", "-I", "-B", "-c", BOOTSTRAP, timeout=...)`),
    since creating one costs seconds; `reuse=False` gives each run a sandbox of its own. The
    limits are the sandbox's (its `cpu`, `memory_mib`, lifetime) plus the wall clock per run
    and the output cap of `SandboxLimits`.
    """

    def __init__(
        self,
        app: modal.App | None = None,
        image: modal.Image | None = None,
        *,
        limits: SandboxLimits | None = None,
        sandbox_timeout_s: int = SANDBOX_TIMEOUT_S,
        cpu: float = 1.0,
        memory_mib: int = 1024,
        reuse: bool = True,
        max_workers: int = 4,
        create: Callable[..., Any] | None = None,
    ) -> None:
        self.app = app
        self.image = image
        self.limits = limits or SandboxLimits()
        self.sandbox_timeout_s = sandbox_timeout_s
        self.cpu = cpu
        self.memory_mib = memory_mib
        self.reuse = reuse
        self.max_workers = max_workers
        self._create = create or modal.Sandbox.create
        self._sandbox: Any = None
        self._lock = threading.Lock()

    def _new_sandbox(self) -> Any:
        if self.app is None:  # a sandbox belongs to an app; outside a running one, look it up (network)
            self.app = modal.App.lookup(SANDBOX_APP_NAME, create_if_missing=True)
        if self.image is None:
            self.image = sandbox_image()
        return self._create(
            app=self.app,
            image=self.image,
            timeout=self.sandbox_timeout_s,
            block_network=True,
            cpu=self.cpu,
            memory=self.memory_mib,
        )

    def _acquire(self) -> Any:
        if not self.reuse:
            return self._new_sandbox()
        with self._lock:
            if self._sandbox is None:
                self._sandbox = self._new_sandbox()
            return self._sandbox

    def run(
        self, code: str, *, stdin: str = "", timeout_s: float | None = None, files: Mapping[str, str] | None = None
    ) -> SandboxResult:
        """Run `code` as main.py in a fresh directory holding `files`; `timeout_s` overrides the limit."""
        timeout = self.limits.timeout_s if timeout_s is None else timeout_s
        payload = json.dumps({"code": code, "files": dict(files or {}), "script": SCRIPT_NAME})
        sandbox = self._acquire()
        started = time.perf_counter()
        try:
            process = sandbox.exec("python", "-I", "-B", "-c", BOOTSTRAP, timeout=max(1, math.ceil(timeout)))
            process.stdin.write(payload + "\n" + stdin)
            process.stdin.write_eof()
            process.stdin.drain()
            stdout, stdout_truncated = _capped(process.stdout.read(), self.limits.output_bytes)
            stderr, stderr_truncated = _capped(process.stderr.read(), self.limits.output_bytes)
            exit_code, signal_name, timed_out = _exit_status(process.wait())
        finally:
            if not self.reuse:
                sandbox.terminate()
        return SandboxResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=exit_code,
            signal=signal_name,
            wall_s=time.perf_counter() - started,
            timed_out=timed_out,
            stdout_truncated=stdout_truncated,
            stderr_truncated=stderr_truncated,
        )

    def run_batch(
        self,
        codes: Sequence[str],
        *,
        stdins: Sequence[str] | None = None,
        timeout_s: float | None = None,
        files: Mapping[str, str] | None = None,
    ) -> list[SandboxResult]:
        """Each program (at most `max_workers` at a time, as processes of the one sandbox); results in order."""
        return run_each(self.run, codes, stdins, timeout_s, files, self.max_workers)

    def close(self) -> None:
        with self._lock:
            if self._sandbox is not None:
                self._sandbox.terminate()
                self._sandbox = None
