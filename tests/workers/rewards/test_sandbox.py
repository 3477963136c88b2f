"""The local sandbox: every limit holds against a program written to break it, and nothing outlives a call."""

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from grpo_flow.workers.rewards.sandbox import LocalSandbox, SandboxLimits

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

LIMITS = SandboxLimits(
    timeout_s=5.0, cpu_s=4.0, memory_bytes=512 << 20, file_size_bytes=1 << 20, max_processes=16, output_bytes=4096
)


@pytest.fixture(scope="module")
def sandbox():
    """The strongest isolation this machine offers."""
    return LocalSandbox(LIMITS)


@pytest.fixture(scope="module")
def guard_sandbox():
    """The Python-level fallback, forced, so that it is tested even where namespaces work."""
    return LocalSandbox(LIMITS, mode="python-guard")


@pytest.fixture(params=["auto", "python-guard"])
def any_sandbox(request, sandbox, guard_sandbox):
    return sandbox if request.param == "auto" else guard_sandbox


def live_processes_with(marker: str, descendants_only: bool = False) -> list[int]:
    """Live (not zombie) processes whose command line holds `marker`; with `descendants_only`, those this
    test started (not another pytest-xdist worker's sandboxes)."""
    import psutil

    mine = {child.pid for child in psutil.Process().children(recursive=True)} if descendants_only else None
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        if mine is not None and int(entry.name) not in mine:
            continue
        try:
            cmdline = Path(entry.path, "cmdline").read_bytes()
            state = Path(entry.path, "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def test_isolation_is_described(sandbox, guard_sandbox):
    assert LocalSandbox.isolation == sandbox.isolation
    assert sandbox.isolation.startswith(("kernel:", "python-guard:"))
    assert guard_sandbox.isolation.startswith("python-guard:")


def test_a_normal_program_gets_stdin_and_files_and_returns_its_output(any_sandbox):
    code = "import helper\nname = input()\nprint(f'hello {name}', helper.ANSWER)\n"
    result = any_sandbox.run(code, stdin="sandbox\n", files={"helper.py": "ANSWER = 42\n"})
    assert result.ok, result.stderr
    assert (result.exit_code, result.signal, result.timed_out) == (0, None, False)
    assert result.stdout == "hello sandbox 42\n"
    assert result.stderr == ""
    assert 0 < result.wall_s < 3


def test_exit_status_and_traceback_are_the_programs(sandbox):
    assert sandbox.run("import sys; sys.exit(3)").exit_code == 3
    failed = sandbox.run("def f():\n    raise ValueError('boom')\nf()\n")
    assert failed.exit_code == 1 and not failed.ok
    assert "main.py" in failed.stderr and failed.stderr.rstrip().endswith("ValueError: boom")


def test_file_names_must_stay_in_the_working_dir(sandbox):
    for bad in ("/etc/passwd", "../escape.py", "main.py"):
        with pytest.raises(ValueError):
            sandbox.run("pass", files={bad: "x"})


def test_an_infinite_loop_is_killed_at_the_wall_clock_timeout(any_sandbox):
    started = time.monotonic()
    result = any_sandbox.run("while True:\n    pass\n", timeout_s=1.5)
    elapsed = time.monotonic() - started
    assert result.timed_out and not result.ok
    assert (result.exit_code, result.signal) == (None, "SIGKILL")
    assert 1.5 <= result.wall_s < 3.0
    assert elapsed < 5.0


def test_the_cpu_limit_kills_a_busy_program_before_the_timeout():
    busy = LocalSandbox(SandboxLimits(timeout_s=10.0, cpu_s=1.0))
    result = busy.run("while True:\n    pass\n")
    assert not result.timed_out
    assert result.signal in ("SIGXCPU", "SIGKILL")
    assert result.wall_s < 4


def test_a_fork_bomb_is_contained_and_leaves_nothing_behind(sandbox):
    plan = sandbox.plan
    if os.geteuid() == 0 and not plan.uses_uid:
        pytest.skip("running as root without a uid of its own: RLIMIT_NPROC cannot hold here")
    bomb = (
        "import os\nprint(os.getcwd(), flush=True)\n"
        "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    peak = 0
    done = threading.Event()
    outcome = {}

    def run_bomb():
        outcome["result"] = sandbox.run(bomb, timeout_s=3.0)
        done.set()

    worker = threading.Thread(target=run_bomb)
    started = time.monotonic()
    worker.start()
    while not done.is_set():  # the number of sandbox processes while the bomb runs
        peak = max(peak, len(live_processes_with("grpo-sandbox-", descendants_only=True)))
        time.sleep(0.02)
    worker.join()
    elapsed = time.monotonic() - started
    result = outcome["result"]
    workdir = result.stdout.splitlines()[0]
    assert "grpo-sandbox-" in workdir
    assert result.timed_out and elapsed < 6
    # max_processes, plus `unshare` and the PID namespace's first process.
    assert 0 < peak <= LIMITS.max_processes + 2
    assert live_processes_with(workdir) == [] and live_processes_with("grpo-sandbox-", descendants_only=True) == []
    assert not os.path.exists(workdir)
    # The machine is still usable: the next program runs normally.
    assert sandbox.run("print('still fine')").stdout == "still fine\n"


def test_background_processes_do_not_outlive_the_program(sandbox):
    if sandbox.plan.fs != "kernel":
        pytest.skip("the Python guard refuses to start other programs")
    marker = str(3000 + secrets.randbelow(5000))
    code = f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\nprint('started')\n"
    result = sandbox.run(code)
    assert result.ok and result.stdout == "started\n"
    assert live_processes_with(f"sleep\0{marker}") == []


def test_a_10_gb_allocation_fails_with_memory_error(any_sandbox):
    started = time.monotonic()
    result = any_sandbox.run("data = bytearray(10 * 1024 ** 3)\nprint('allocated')\n")
    assert result.exit_code == 1 and "MemoryError" in result.stderr
    assert "allocated" not in result.stdout
    assert time.monotonic() - started < 5


def test_the_file_size_limit_holds(any_sandbox):
    code = (
        "import os\n"
        "try:\n"
        "    with open('big.bin', 'wb') as f:\n"
        "        f.write(b'x' * (3 << 20))\n"
        "except OSError as error:\n"
        "    print('refused', error.errno)\n"
        "print(os.path.getsize('big.bin'))\n"
    )
    result = any_sandbox.run(code)
    assert result.ok, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "refused 27"  # EFBIG
    assert int(lines[1]) <= LIMITS.file_size_bytes


@pytest.fixture
def outside_dir():
    """A world-writable directory outside the sandbox, so that only the isolation can refuse a write."""
    path = Path(tempfile.mkdtemp(prefix="outside-sandbox-"))
    path.chmod(0o777)
    victim = path / "victim.txt"
    victim.write_text("original")
    victim.chmod(0o666)
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def test_writes_outside_the_working_dir_are_refused(any_sandbox, outside_dir):
    victim, created = outside_dir / "victim.txt", outside_dir / "created.txt"
    code = f"""
import os, subprocess
attempts = [
    lambda: open({str(victim)!r}, "w").write("pwned"),
    lambda: open({str(victim)!r}, "a").write("pwned"),
    lambda: os.close(os.open({str(created)!r}, os.O_CREAT | os.O_WRONLY)),
    lambda: os.remove({str(victim)!r}),
    lambda: os.rename({str(victim)!r}, "stolen.txt"),
    lambda: subprocess.run(["sh", "-c", "echo pwned > {victim}; touch {created}"]),
]
for attempt in attempts:
    try:
        attempt()
    except OSError:
        pass
open("inside.txt", "w").write("mine")
print(open("inside.txt").read())
"""
    result = any_sandbox.run(code)
    assert result.ok, result.stderr
    assert result.stdout == "mine\n"  # writing in its own directory works
    assert victim.read_text() == "original"
    assert not created.exists()
    assert sorted(p.name for p in outside_dir.iterdir()) == ["victim.txt"]


def test_no_connection_reaches_a_server_on_the_host(any_sandbox):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"""
import socket
for attempt in (lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2),
                lambda: socket.socket().connect(("127.0.0.1", {port})),
                lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", {port}))):
    try:
        attempt()
        print("connected")
    except OSError as error:
        print("refused", type(error).__name__)
"""
        result = any_sandbox.run(code)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing is waiting to be accepted
    assert result.ok, result.stderr
    assert "connected" not in result.stdout
    assert result.stdout.count("refused") >= 2


def test_the_parents_environment_does_not_reach_the_program(any_sandbox, monkeypatch):
    secret = "grpo-secret-" + secrets.token_hex(8)
    monkeypatch.setenv("GRPO_SANDBOX_TEST_SECRET", secret)
    # A host process with the secret in its initial environment, which /proc/<pid>/environ shows.
    holder = subprocess.Popen(["sleep", "60"], env={**os.environ, "GRPO_SANDBOX_TEST_SECRET": secret})
    code = f"""
import os
print(dict(os.environ))
pids = ["{holder.pid}", str(os.getppid())] + [p for p in os.listdir("/proc") if p.isdigit()]
for pid in pids:
    for reader in (lambda: open(f"/proc/{{pid}}/environ", "rb").read(),
                   lambda: os.read(os.open(f"/proc/{{pid}}/environ", os.O_RDONLY), 1 << 16)):
        try:
            found = reader()
        except OSError:
            continue
        if b"GRPO_SANDBOX" in found:  # print only what matters: the output is capped
            print(found)
"""
    try:
        result = any_sandbox.run(code)
    finally:
        holder.kill()
        holder.wait()
    assert result.ok, result.stderr
    assert "'PATH': '/usr/bin:/bin'" in result.stdout and not result.stdout_truncated
    assert secret not in result.stdout + result.stderr
    assert "GRPO_SANDBOX_TEST_SECRET" not in result.stdout + result.stderr


def test_huge_output_is_capped(any_sandbox):
    code = "import sys\nsys.stdout.write('x' * 10_000_000)\nsys.stderr.write('done')\n"
    result = any_sandbox.run(code)
    assert result.ok
    assert result.stdout == "x" * LIMITS.output_bytes and result.stdout_truncated
    assert result.stderr == "done" and not result.stderr_truncated


def test_run_batch_runs_in_parallel_and_keeps_order():
    batch = LocalSandbox(LIMITS, max_workers=3)
    codes = [f"import time\ntime.sleep(1)\nprint({i})\n" for i in range(3)] + ["print(input())"]
    started = time.monotonic()
    results = batch.run_batch(codes, stdins=["", "", "", "echo"])
    elapsed = time.monotonic() - started
    assert [r.stdout for r in results] == ["0\n", "1\n", "2\n", "echo\n"]
    assert elapsed < 2.8  # three one-second programs at once: one after another takes over 3 s
    assert batch.run_batch([]) == []


def test_visible_paths_stay_readable_and_read_only_inside_a_hidden_folder(tmp_path):
    if LocalSandbox(LIMITS).plan.fs != "kernel":
        pytest.skip("only the kernel namespaces hide folders; the Python guard hides none")
    shown, other = tmp_path / "shown", tmp_path / "other"  # under the temp dir, which the sandbox hides
    for folder in (shown, other):
        folder.mkdir()
        folder.chmod(0o755)
        (folder / "data.txt").write_text(folder.name)
        (folder / "data.txt").chmod(0o644)
    tmp_path.chmod(0o755)
    code = (
        "for path in ({shown!r}, {other!r}):\n"
        "    try:\n"
        "        print(open(path).read())\n"
        "    except OSError as error:\n"
        "        print('unreadable', error.errno)\n"
        "try:\n"
        "    open({shown!r}, 'w').write('changed')\n"
        "except OSError as error:\n"
        "    print('write refused', error.errno)\n"
    ).format(shown=str(shown / "data.txt"), other=str(other / "data.txt"))
    result = LocalSandbox(LIMITS, visible_paths=[shown]).run(code)
    assert result.ok, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "shown" and lines[1].startswith("unreadable") and lines[2].startswith("write refused")
    assert (shown / "data.txt").read_text() == "shown"
