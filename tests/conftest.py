"""Test-wide settings: offline, quiet, one temporary Prefect server for the session."""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402

import flows  # noqa: E402,F401  as every use of grpo-flow: Prefect's recorder batched (flows/__init__.py)


@pytest.fixture(scope="session")
def prefect_server():
    """A temporary Prefect server and database for the whole session (Prefect's own test harness)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def storage_root(tmp_path_factory):
    """One storage root per session, so the tiny model is built once."""
    return tmp_path_factory.mktemp("grpo-storage")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RayCluster:
    """A one-node Ray cluster of 2 CPUs started with `ray start --head --block` on the loopback address.

    Its processes (GCS, raylet, dashboard, workers) all live in the process group of that
    `ray start`, which the fixture ends: `ray stop` would end every Ray process on the machine.
    """

    def __init__(self, cpus: int = 2, startup_timeout_s: float = 90.0) -> None:
        import subprocess
        import sys
        import tempfile
        import time
        from pathlib import Path

        self.port, self.dashboard_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        ray_cli = str(Path(sys.executable).with_name("ray"))
        argv = [
            ray_cli,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={self.port}",
            f"--num-cpus={cpus}",
            "--num-gpus=0",
            f"--object-store-memory={200 * 2**20}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
        ]
        self.log = Path(self.temp_dir) / "ray-start.log"
        self.process = subprocess.Popen(
            argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + startup_timeout_s
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the test Ray cluster did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def answers(self) -> bool:
        """The dashboard answers (it starts last; the state API the tests use lives there)."""
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def actor_pid(self, actor_id: str) -> int:
        """The pid of a live Ray actor, as Ray's state API reports it."""
        import time

        from ray.util.state import list_actors

        deadline = time.monotonic() + 30
        while True:
            actors = list_actors(address=self.dashboard, filters=[("actor_id", "=", actor_id)], detail=True)
            if actors and actors[0].state == "ALIVE" and actors[0].pid:
                return int(actors[0].pid)
            if time.monotonic() > deadline:
                raise RuntimeError(f"actor {actor_id} is not alive: {actors}")
            time.sleep(0.2)

    def alive_actors(self, name_prefix: str) -> list:
        from ray.util.state import list_actors

        actors = list_actors(address=self.dashboard, filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
        return [a for a in actors if (a.name or "").startswith(name_prefix)]

    def stop(self) -> None:
        """This cluster's processes only: its process group, TERM then KILL."""
        import os
        import shutil
        import signal
        import time

        try:
            import ray

            ray.shutdown()  # this process's driver connection
        except ImportError:
            pass
        group = self.process.pid  # start_new_session: the group's id is the leader's pid
        for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):  # `ray start --block` itself outlives TERM
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and group_alive(group):
                self.process.poll()  # reap the leader
                time.sleep(0.2)
            if not group_alive(group):
                break
        self.process.wait(timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def group_alive(group: int) -> bool:
    """Whether a live (not zombie) process is left in the process group (read from /proc: Linux)."""
    from pathlib import Path

    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            return True
    return False


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster for the session's Ray tests, stopped (every process of it) at the end."""
    cluster = RayCluster()
    try:
        yield cluster
    finally:
        cluster.stop()
        assert not group_alive(cluster.process.pid), "processes of the test Ray cluster outlived it"
