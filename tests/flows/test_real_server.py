"""With PREFECT_API_URL set, a run is recorded by that server (a local `prefect server start`)."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prefect_server_process(tmp_path):
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "server-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail("prefect server did not start within 90 s")
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


def test_a_run_is_recorded_by_the_server_in_prefect_api_url(prefect_server_process, tmp_path):
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_server_process,
        "PREFECT_HOME": str(tmp_path / "client-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", "--max-steps", "2", "--run-id", "on-server",
         "--eval-prompts", "8", "--storage-root", str(tmp_path / "store"), "--no-progress"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = httpx.post(f"{prefect_server_process}/flow_runs/filter", json={"limit": 20}, timeout=10).json()
    by_name = {run["name"]: run for run in runs}
    assert {"on-server", "on-server-step-1", "on-server-step-2"} <= set(by_name)
    assert all(by_name[name]["state_type"] == "COMPLETED" for name in ("on-server", "on-server-step-1", "on-server-step-2"))
    assert by_name["on-server-step-1"]["parent_task_run_id"] is not None  # a subflow of the run
