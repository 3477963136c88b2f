"""One writer per run: a lock on the run folder that names its holder.

`runs/<id>/writer.lock` says who writes the run (host, pid, since when, the command) and
carries a lease that the holder renews every `lease_s / 4` seconds while it lives. Run folders
live on local disks and on Modal Volumes, so two mechanisms back each other:

- Locally the file is also held with flock(2). The kernel drops that lock the moment its
  process dies (SIGKILL included), so a second process on the machine is refused for exactly as
  long as the first lives, and a killed holder's lock is taken over at once.
- An object store (a URL storage root: workers/state/location.py) has no locks, no rename and no
  conditional delete, only an exclusive create (S3 `If-None-Match: *`, GCS `ifGenerationMatch=0`,
  fsspec's `mode="create"`). There the lease is a series of generations, the objects
  `writer.lock/000000000001`, `.../000000000002`, ...; the newest names the holder. The holder
  rewrites its own generation at each renewal and deletes it at release. A writer that finds the
  newest generation's holder gone (its pid, on this host; its lease, elsewhere) creates the next
  generation: of the takers that race for it, the store lets exactly one create it. The winner
  then checks that no newer generation and no live older one exists (a taker whose listing was
  older may have won first), and removes the older ones. A holder that finds a newer generation
  than its own, or its own gone, at a renewal was taken over: it stops renewing and no longer holds
  the lock.
- A Modal Volume has no locks (flock does not reach other containers, and a Volume shows other
  containers' writes only after its background commit). There the lease is what counts: a
  holder on another host is alive until its lease expires.

Whether a recorded holder still writes: on this host, its pid is alive and is the same process
(its start time, where /proc has it, matches; a zombie is dead); on another host, its lease has
not expired. A lock whose holder is gone is taken over, with a warning naming it.

Within one process the lock is re-entrant (`hold_run_lock`): the CLI takes it before Prefect
starts, and the flow's `prepare_run` finds it already held.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from grpo_flow.workers.state.location import is_remote

try:  # POSIX; elsewhere the lease alone guards the run
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = "writer.lock"
# Long enough to outlast a Modal Volume's background commit (seconds) many times over; short
# enough that a run killed on another host is taken over within minutes.
DEFAULT_LEASE_S = float(os.environ.get("GRPO_FLOW_LOCK_LEASE_S", "120"))
logger = logging.getLogger("grpo_flow.lock")


class LockWriteError(RuntimeError):
    """The writer lock could not be written (a full disk, a read-only folder); nothing was left behind."""


class RunLockedError(RuntimeError):
    """Another live process writes this run; the message names it (host, pid, since when)."""

    def __init__(self, message: str, holder: dict[str, Any] | None):
        super().__init__(message)
        self.holder = holder


# -- processes ---------------------------------------------------------------------------------------
def this_host() -> str:
    """This machine's name as lock files and temporary file names record it (letters, digits, '-')."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname().split(".")[0])[:40] or "host"


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), or None where there is no /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a reused pid from the original)."""
    fields = _proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def pid_alive(pid: int, start: str | None = None) -> bool:
    """Whether process `pid` runs on this host (and, given `start`, is the process that started then)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    fields = _proc_stat(pid)
    if fields is None:
        return True
    if fields[0] in ("Z", "X"):  # killed, not yet reaped by its parent: its files (and flock) are released
        return False
    return start is None or len(fields) <= 19 or fields[19] == start


def holder_alive(holder: dict[str, Any], now: float | None = None) -> bool:
    """On this host: its process lives. On another: its lease has not expired."""
    if holder.get("host") == this_host() and isinstance(holder.get("pid"), int):
        return pid_alive(holder["pid"], holder.get("pid_start"))
    return (time.time() if now is None else now) < float(holder.get("expires", 0))


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def describe_holder(holder: dict[str, Any] | None) -> str:
    """`pid 123 on host h since 2026-11-25 10:00:01 UTC (grpo train ...)`."""
    if not holder:
        return "another process (its lock record is being written)"
    text = f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('since', '?')}"
    if holder.get("host") != this_host():
        text += f", lease until {_utc(float(holder.get('expires', 0)))}"
    if holder.get("command"):
        text += f" ({holder['command']})"
    return text


# -- the lock file -----------------------------------------------------------------------------------
def lock_path(run_dir: str | os.PathLike) -> Path:
    return (run_dir if is_remote(run_dir) else Path(run_dir)) / LOCK_FILE  # type: ignore[operator]


def read_holder(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The lock record (on an object store, its newest generation's), or None (no lock, or a record being
    written)."""
    if is_remote(run_dir):
        newest = _newest_generation(run_dir)
        return newest[1] if newest is not None else None
    path = lock_path(run_dir)
    for _ in range(5):  # the holder rewrites its record in place: a read may fall between truncate and write
        try:
            record = _parse(path.read_bytes())
        except FileNotFoundError:
            return None
        except OSError:
            record = None
        if record is not None:
            return record
        time.sleep(0.02)
    return None


# -- an object store's lease: a series of generations ------------------------------------------------
_GENERATION = re.compile(r"^\d{12}$")


def _fs(run_dir: Any) -> Any:
    return run_dir.fs


def _generation_key(run_dir: Any, number: int) -> str:
    return f"{lock_path(run_dir).path}/{number:012d}"  # type: ignore[attr-defined]


def _generations(run_dir: Any) -> list[tuple[int, str]]:
    """(number, key) of each generation of the lease, oldest first."""
    keys = _fs(run_dir).find(str(lock_path(run_dir).path))  # type: ignore[attr-defined]
    found = [(key.rstrip("/").rpartition("/")[2], key) for key in keys]
    return sorted((int(name), key) for name, key in found if _GENERATION.match(name))


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _read_generation(run_dir: Any, number: int) -> dict[str, Any] | None:
    """A generation's record; None when it is gone or unreadable (a PUT is whole: damage, not a write under way)."""
    try:
        return _parse(_fs(run_dir).cat_file(_generation_key(run_dir, number)))
    except FileNotFoundError:
        return None


def _newest_generation(run_dir: Any) -> tuple[int, dict[str, Any] | None] | None:
    """The newest generation's number and record, or None when the lease has none."""
    for _ in range(5):  # released between the listing and the read: list again
        found = _generations(run_dir)
        if not found:
            return None
        try:
            return found[-1][0], _parse(_fs(run_dir).cat_file(found[-1][1]))
        except FileNotFoundError:
            continue
    return None


def _alive(holder: dict[str, Any] | None) -> bool:
    return holder is not None and holder_alive(holder)


def _remove(run_dir: Any, key: str) -> None:
    try:
        _fs(run_dir).rm_file(key)
    except FileNotFoundError:  # removed by another cleaner meanwhile
        pass


def live_holder(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The process writing the run now, or None (read only: `grpo runs`, `grpo verify`)."""
    holder = read_holder(run_dir)
    return holder if _alive(holder) else None


def locked_error(run_dir: Path, holder: dict[str, Any] | None) -> RunLockedError:
    return RunLockedError(
        f"run {run_dir.name!r} is being written by {describe_holder(holder)}; one writer per run "
        f"(lock {lock_path(run_dir)}). Wait for it to end or stop it: a lock left by a killed process is taken "
        "over at the next start",
        holder,
    )


def refuse_if_written(run_dir: Path) -> None:
    """Raise RunLockedError while a live process writes the run: a read, so a second writer is refused
    before anything slower starts; `RunLock.acquire` still takes the lock exclusively after."""
    holder = live_holder(run_dir)
    if holder is not None:
        raise locked_error(run_dir, holder)


def _try_flock(fd: int) -> bool | None:
    """True: this process holds the kernel lock; False: another does; None: the file system has none."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in (errno.EAGAIN, errno.EACCES):
            return False
        return None  # ENOLCK, EOPNOTSUPP, ...: no locks here; the lease decides


class RunLock:
    """The writer lock of one run folder; `acquire()` raises RunLockedError naming a live holder."""

    def __init__(self, run_dir: str | os.PathLike, lease_s: float = DEFAULT_LEASE_S, command: str | None = None):
        self.run_dir: Path = run_dir if is_remote(run_dir) else Path(run_dir)  # type: ignore[assignment]
        self.path = lock_path(run_dir)
        self.lease_s = lease_s
        self.command = command if command is not None else " ".join(Path(sys.argv[0]).name.split() + sys.argv[1:])
        self.token = uuid.uuid4().hex
        self.taken_over: dict[str, Any] | None = None  # the stale holder this lock replaced, if any
        self._fd: int | None = None
        self._leased = False  # holds a generation of an object store's lease
        self._generation = 0
        self._record: dict[str, Any] = {}
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None or self._leased

    def acquire(self) -> RunLock:
        if is_remote(self.run_dir):
            return self._acquire_object()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise self._cannot_write(error) from None
        for _ in range(10):  # a releaser may unlink the file between our open and our lock: try again
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)  # the umask decides, as for every run file
            except OSError as error:
                raise self._cannot_write(error) from None
            try:
                kernel = _try_flock(fd)
                if kernel is False:
                    self._refuse(read_holder(self.run_dir))
                if not self._same_file(fd):
                    os.close(fd)
                    continue
                holder = self._read_fd(fd)
                if holder is not None and holder.get("token") != self.token:
                    mine = holder.get("host") == this_host() and holder.get("pid") == os.getpid()
                    if not mine and holder_alive(holder):
                        self._refuse(holder)
                    if not mine:
                        self.taken_over = holder
                        logger.warning(
                            "run %s: taking over the writer lock of %s: %s",
                            self.run_dir.name,
                            describe_holder(holder),
                            "its lease expired" if holder.get("host") != this_host() else "that process is gone",
                        )
                elif holder is None and kernel is None and self._recently_touched():
                    # No kernel lock here and a record not yet readable: another process is acquiring.
                    self._refuse(None)
                now = time.time()
                self._record = self._new_record(now)
                try:
                    self._write(fd, now)
                except OSError as error:  # a full disk: no empty writer.lock left behind, one line said
                    if self._same_file(fd) and os.fstat(fd).st_size == 0:
                        self.path.unlink(missing_ok=True)
                    try:
                        self.run_dir.rmdir()
                    except OSError:
                        pass
                    raise self._cannot_write(error) from None
                self._fd = fd
                self._start_renewer()
                return self
            except BaseException:
                if self._fd != fd:
                    os.close(fd)
                raise
        raise RunLockedError(f"run {self.run_dir.name!r}: could not take {self.path} (it keeps changing)", None)

    def release(self) -> None:
        if is_remote(self.run_dir):
            self._release_object()
            return
        if self._fd is None:
            return
        self._stop_renewer()
        fd, self._fd = self._fd, None
        try:
            if self._same_file(fd):
                self.path.unlink()  # before closing: nobody can take the old file once it is unlinked
        finally:
            os.close(fd)  # drops the kernel lock
        try:
            self.run_dir.rmdir()  # a run that never got created leaves no empty folder behind
        except OSError:
            pass

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # -- an object store's lease: generations -------------------------------------------------------
    def _acquire_object(self) -> RunLock:
        for _ in range(10):  # another taker may create or release a generation between our steps: try again
            newest = _newest_generation(self.run_dir)
            if newest is not None and _alive(newest[1]):
                self._refuse(newest[1])
            generation = newest[0] + 1 if newest is not None else 1
            now = time.time()
            self._record = {**self._new_record(now), "generation": generation}
            try:  # the store's conditional create: one taker of each generation wins
                _fs(self.run_dir).pipe_file(
                    _generation_key(self.run_dir, generation), self._payload(now), mode="create"
                )
            except FileExistsError:
                continue
            except OSError as error:
                raise self._cannot_write(error) from None
            if not self._won(generation):
                continue
            self._generation, self._leased = generation, True
            if newest is not None:
                self._take_over(newest[1])
            self._start_renewer()
            return self
        raise RunLockedError(f"run {self.run_dir.name!r}: could not take {self.path} (it keeps changing)", None)

    def _won(self, generation: int) -> bool:
        """After creating `generation`: whether this lock holds the run. It does not if its object is not its
        own (a store whose exclusive create is emulated let another write it too), if a newer generation
        exists (a later taker), or if an older one is alive (a taker whose listing was older won first, or
        its holder renewed late); it then deletes its own, and is refused naming a live older holder."""
        if (_read_generation(self.run_dir, generation) or {}).get("token") != self.token:
            return False
        found = _generations(self.run_dir)
        older = [_read_generation(self.run_dir, number) for number, _ in found if number < generation]
        live = [holder for holder in older if _alive(holder)]
        if live or found[-1][0] > generation:
            _remove(self.run_dir, _generation_key(self.run_dir, generation))
            if live:
                self._refuse(live[-1])
            return False
        return True

    def _take_over(self, holder: dict[str, Any] | None) -> None:
        self.taken_over = holder
        logger.warning(
            "run %s: taking over the writer lock of %s: %s",
            self.run_dir.name,
            describe_holder(holder),
            "its record is unreadable" if holder is None else "its holder is gone",
        )
        self._remove_older()

    def _remove_older(self, found: list[tuple[int, str]] | None = None) -> None:
        for number, key in _generations(self.run_dir) if found is None else found:
            if number < self._generation:
                _remove(self.run_dir, key)

    def _renew_object(self, now: float) -> None:
        found = _generations(self.run_dir)
        own = _read_generation(self.run_dir, self._generation) if found and found[-1][0] == self._generation else None
        if (own or {}).get("token") != self.token:
            logger.error(
                "run %s: the writer lock was taken over by %s",
                self.run_dir.name,
                describe_holder(read_holder(self.run_dir)),
            )
            self._leased = False
            self._stop.set()
            return
        _fs(self.run_dir).pipe_file(_generation_key(self.run_dir, self._generation), self._payload(now))
        self._remove_older(found)

    def _release_object(self) -> None:
        self._stop_renewer()
        if self._leased and (_read_generation(self.run_dir, self._generation) or {}).get("token") == self.token:
            _remove(self.run_dir, _generation_key(self.run_dir, self._generation))
        self._leased = False

    # -- internals ---------------------------------------------------------------------------------
    def _new_record(self, now: float) -> dict[str, Any]:
        return {
            "run_id": self.run_dir.name,
            "host": this_host(),
            "pid": os.getpid(),
            "pid_start": process_start(os.getpid()),
            "since": _utc(now),
            "command": self.command[:300],
            "token": self.token,
            "lease_s": self.lease_s,
        }

    def _payload(self, now: float) -> bytes:
        record = {
            **self._record,
            "renewed": _utc(now),
            "expires": now + self.lease_s,
            "expires_at": _utc(now + self.lease_s),
        }
        return (json.dumps(record, indent=2) + "\n").encode()

    def _start_renewer(self) -> None:
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew, name="grpo-flow-run-lock", daemon=True)
        self._renewer.start()

    def _stop_renewer(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)

    def _refuse(self, holder: dict[str, Any] | None) -> None:
        raise locked_error(self.run_dir, holder)

    def _cannot_write(self, error: OSError) -> LockWriteError:
        return LockWriteError(
            f"run {self.run_dir.name!r}: cannot write its writer lock {self.path}: {error.strerror or error}"
        )

    def _same_file(self, fd: int) -> bool:
        try:
            return os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            return False

    def _recently_touched(self) -> bool:
        try:
            return time.time() - self.path.stat().st_mtime < self.lease_s
        except FileNotFoundError:
            return False

    @staticmethod
    def _read_fd(fd: int) -> dict[str, Any] | None:
        return _parse(os.pread(fd, 1 << 16, 0))

    def _write(self, fd: int, now: float) -> None:
        data = self._payload(now)
        # In place, not by rename: the kernel lock belongs to this file, and a renamed-in file would be a new one.
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                fd = self._fd
                if fd is not None:
                    self._write(fd, time.time())
                elif self._leased:
                    self._renew_object(time.time())
            except OSError as error:  # a full disk must not kill the run; the lease just ages
                logger.warning("run %s: could not renew the writer lock: %s", self.run_dir.name, error)


# -- one lock per run and process ----------------------------------------------------------------------
_HELD: dict[str, tuple[RunLock, set[str]]] = {}
_HELD_GUARD = threading.Lock()


def hold_run_lock(run_dir: str | os.PathLike, lease_s: float = DEFAULT_LEASE_S, owner: str | None = None) -> RunLock:
    """This process's writer lock of the run, taken now or earlier (re-entrant within the process).

    `owner` (a flow run id) lets `release_run_locks_of` give back what a failed flow run took.
    """
    key = _held_key(run_dir)
    with _HELD_GUARD:
        lock, owners = _HELD.get(key, (None, set()))
        if lock is None or not lock.held:
            lock, owners = RunLock(run_dir, lease_s).acquire(), set()
            _HELD[key] = (lock, owners)
        if owner:
            owners.add(owner)
        return lock


def release_run_lock(run_dir: str | os.PathLike) -> None:
    """Release this process's writer lock of the run, if it holds it."""
    with _HELD_GUARD:
        lock, _ = _HELD.pop(_held_key(run_dir), (None, set()))
    if lock is not None:
        lock.release()


def release_run_locks_of(owner: str) -> None:
    """Release the writer locks taken for `owner` that are still held."""
    with _HELD_GUARD:
        keys = [key for key, (_, owners) in _HELD.items() if owner in owners]
        locks = [_HELD.pop(key)[0] for key in keys]
    for lock in locks:
        lock.release()


def _held_key(run_dir: str | os.PathLike) -> str:
    return str(run_dir) if is_remote(run_dir) else str(Path(run_dir).resolve())
