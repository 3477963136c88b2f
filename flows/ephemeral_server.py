"""Prefect's ephemeral API server for `grpo train` and `GRPOFlowTrainer.train()`: in a session of
its own, its output in a log file, and gone once the process that started it is gone.

    start_ephemeral_server(log_path)    # before the first flow; a probe of PREFECT_API_URL when it is set
    check_api_reachable(url)            # `grpo serve`: the server named answers at all
    stop_ephemeral_server_now()         # a second Ctrl-C: signal it and do not wait

Prefect starts its ephemeral server (uvicorn, a child process) in the caller's process group,
writing to the caller's terminal. So a Ctrl-C reached the server too: it shut down first, and the
run under way failed minutes later with ConnectError and 210 lines. And the server's own logs (a
telemetry error offline, SQLite "database is locked" tracebacks, a CancelledError at shutdown)
landed in the user's terminal.

This starts the same server: Prefect's `SubprocessASGIServer`, registered as the process's default
server the way `prefect_test_harness` registers its own, so every Prefect client in the process
uses it and Prefect's exit handler stops it. Only the command differs from Prefect 3.8's
`_run_uvicorn_command`: the same uvicorn arguments and environment, run through this module's
`__main__` in a new session, writing to the log file. In its own session the server no longer ends
with the terminal's process group, so it watches its parent and ends itself when the parent is gone
(even one killed with SIGKILL).

`python -m grpo_flow.flows.ephemeral_server PARENT_PID UVICORN_ARGS...` is that server process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# How long the probe of a server named by PREFECT_API_URL waits: Prefect's client retries a refused
# connection for about 20 s before it gives up, naming neither the variable nor what to do.
API_PROBE_TIMEOUT_S = 3.0

# How often the server process checks that its parent is alive, and how long it then gives
# uvicorn to shut down cleanly before it exits regardless.
PARENT_POLL_S = 1.0
SHUTDOWN_GRACE_S = 15.0


class ServerStartError(RuntimeError):
    """Prefect's ephemeral server did not answer in time; the message says what to do, in one line."""


def start_ephemeral_server(log_path: str | os.PathLike) -> str | None:
    """Start the ephemeral server (see the module docstring); returns its API URL, or None when
    PREFECT_API_URL names a server (which must answer) or an ephemeral server already runs in this process."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    if PREFECT_API_URL.value():
        check_api_reachable(PREFECT_API_URL.value())
        return None
    current = SubprocessASGIServer._instances.get(None)
    if current is not None and current.running:
        return None
    SubprocessASGIServer._instances.pop(None, None)
    server = _server_class()(log_path=Path(log_path))
    try:
        server.start()
    except RuntimeError as error:
        server.stop()
        if "Timed out while attempting to connect" not in str(error):
            raise
        raise ServerStartError(
            f"Prefect's ephemeral server did not answer within "
            f"{PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()} s (a busy machine?): set "
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS higher (e.g. 300), or start a server with "
            f"`prefect server start` and set PREFECT_API_URL; server log: {log_path}"
        ) from None
    return server.api_url


def check_api_reachable(url: str) -> None:
    """ServerStartError naming PREFECT_API_URL when nothing answers at `url` within a few seconds. Any
    HTTP answer counts (Prefect Cloud may want a key for /health): only a connection that fails is refused."""
    import httpx

    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=API_PROBE_TIMEOUT_S)
    except httpx.HTTPError as error:
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ServerStartError(
            f"PREFECT_API_URL={url}: no Prefect server answers there ({reason}); start one with "
            "`prefect server start`, or unset PREFECT_API_URL to run on an ephemeral server"
        ) from None


def stop_ephemeral_server_now() -> None:
    """Ask the server to shut down (SIGTERM) without waiting: the process is about to exit at once."""
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer._instances.get(None)
    process = getattr(server, "server_process", None)
    if process is not None and process.poll() is None:
        process.terminate()


_SERVER_CLASS: Any = None


def _server_class() -> Any:
    """Prefect's SubprocessASGIServer with this module's command (the class is made on first use:
    importing Prefect's server module costs about a second, which `grpo train`'s checks must not pay)."""
    global _SERVER_CLASS
    if _SERVER_CLASS is not None:
        return _SERVER_CLASS
    import prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    class QuietEphemeralServer(SubprocessASGIServer):
        def __init__(self, port: int | None = None, log_path: Path | None = None):
            super().__init__(port)
            if log_path is not None:
                self.log_path = log_path

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            # Prefect 3.8.8's uvicorn arguments and environment (SubprocessASGIServer._run_uvicorn_command).
            uvicorn_args = [
                "--app-dir",
                str(prefect.__module_path__.parent),
                "--factory",
                "prefect.server.api.server:create_app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "error",
                "--lifespan",
                "on",
            ]
            env = {
                **os.environ,
                "PREFECT_UI_ENABLED": "0",
                "PREFECT__SERVER_EPHEMERAL": "1",
                "PREFECT__SERVER_FINAL": "1",
                **get_current_settings().to_environment_variables(exclude_unset=True),
            }
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as log:
                return subprocess.Popen(
                    [sys.executable, "-m", "grpo_flow.flows.ephemeral_server", str(os.getpid()), *uvicorn_args],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # a Ctrl-C in the terminal is the run's to handle, not the server's
                )

    _SERVER_CLASS = QuietEphemeralServer
    return _SERVER_CLASS


def _end_when_orphaned(parent_pid: int) -> None:
    """In the server process: once the parent is gone (this process was re-parented), shut uvicorn
    down as Prefect's own stop does (SIGTERM), and exit regardless if it has not ended soon after."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(SHUTDOWN_GRACE_S)
    os._exit(1)


if __name__ == "__main__":
    threading.Thread(target=_end_when_orphaned, args=(int(sys.argv[1]),), daemon=True).start()
    from uvicorn.main import main as uvicorn_main

    uvicorn_main(args=sys.argv[2:], prog_name="uvicorn")
