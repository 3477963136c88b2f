"""A local sandbox for untrusted Python code (Linux): each program in a fresh directory, with limits.

`LocalSandbox().run(code)` writes `code` to `main.py` in a new temporary directory and runs it
with the sandbox's interpreter (`python -I -B`: isolated mode, no user site, no bytecode
files), a minimal environment (PATH, HOME and TMPDIR = the working dir, LANG; nothing of the
parent's environment), its own session and process group, and these limits:

- wall clock: the whole process tree is killed (SIGKILL) at the timeout;
- resource limits set before the user's code runs: RLIMIT_CPU (SIGXCPU at the limit, SIGKILL
  a second later), RLIMIT_AS (address space: a huge allocation raises MemoryError),
  RLIMIT_FSIZE (a bigger file fails with EFBIG; Python ignores SIGXFSZ), RLIMIT_NPROC and
  RLIMIT_CORE = 0;
- stdout and stderr are read as they come and kept up to `output_bytes` each; the rest is
  drained and dropped (`stdout_truncated` / `stderr_truncated`).

Isolation is chosen once per interpreter by a probe (`LocalSandbox.isolation` says which one
is in force), the strongest that works on the machine, from this ladder:

1. **Kernel namespaces** (`unshare` from util-linux): a network namespace (only a loopback
   that is down: no connection can leave, not even to the host's 127.0.0.1), a mount
   namespace in which the whole tree is remounted read-only except the working dir and a
   private `/dev/shm`, and the parent's home, the temp dir and `/run` are covered by empty
   tmpfs mounts (re-exposing only the interpreter's own paths, the working dir and the caller's
   `visible_paths`, read-only), and a PID
   namespace with its own `/proc` (the host's processes, and so their environments, are not
   visible; killing its first process kills every process in it). Privileges are then
   dropped before the user's code runs:
   - as root: the program switches to an unused uid of its own (`_UidPool`), so RLIMIT_NPROC
     (which the kernel never applies to uid 0) counts exactly this sandbox's processes, and
     file permissions (device nodes, sockets, root-only files) apply as to any other user;
   - as another user: a user namespace (`unshare --user --map-root-user`) is created first;
     every capability is dropped (bounding set, securebits, no_new_privs), so the mounts
     cannot be undone; RLIMIT_NPROC is counted per user namespace (kernel >= 5.14).
   A variant without the PID namespace is tried next where that is refused.
2. **Python-level guard** (when no namespace can be created): a prelude run before the
   user's code replaces `open`/`io.open`/`os.open` and the `os` functions that create,
   remove, rename or change files so that they refuse paths outside the working dir, refuses
   reading other processes' `/proc/<pid>/environ`, replaces `socket.socket`'s
   connect/bind/listen/send*, name resolution and `os.system`/`exec*`/`spawn*`/`subprocess`.
   This is a guard against mistakes, **not a security boundary**: code can reach `_io`,
   `_socket` or `ctypes` directly. As root, the program is still run under its own uid when
   the interpreter is readable by it (otherwise RLIMIT_NPROC cannot hold and only the
   wall-clock kill bounds a fork bomb). As another user, RLIMIT_NPROC is set to the user's
   current number of tasks plus the limit, since the kernel counts per user.

Whatever the isolation, when a program ends (or times out) its process group, the PID
namespace's first process, and any process still running under the sandbox's uid or in its
working dir are killed, so nothing outlives a call.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import platform
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger("grpo_flow.sandbox")

SCRIPT_NAME = "main.py"
_MIN_NPROC_KERNEL = (5, 14)  # RLIMIT_NPROC counted per user namespace from this kernel on


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one program: wall clock, CPU, memory, file size, processes, captured output.

    `memory_bytes` is per process (RLIMIT_AS); `max_processes` counts every process and thread
    of the program, the sandbox's own supervisor included; `output_bytes` applies to stdout and
    to stderr each.
    """

    timeout_s: float = 10.0
    cpu_s: float = 10.0
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    max_processes: int = 32
    output_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_bytes", "file_size_bytes", "max_processes", "output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What a program did: its (capped) output, how it ended, and how long it took."""

    stdout: str
    stderr: str
    exit_code: int | None  # None when a signal ended it
    signal: str | None  # e.g. "SIGKILL" (timeout, CPU limit) or "SIGSEGV"
    wall_s: float
    timed_out: bool
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        """The program ran to the end and exited with status 0."""
        return self.exit_code == 0 and not self.timed_out


# --------------------------------------------------------------------------- isolation plans


@dataclass(frozen=True)
class _Plan:
    """One way of isolating a program; the probe picks the first plan of the ladder that works."""

    namespaces: tuple[str, ...]  # of "user", "net", "mount", "pid"
    fs: Literal["kernel", "guard"]
    net: Literal["kernel", "guard"]
    drop: Literal["uid", "caps", "none"]  # what the prelude drops before the user's code
    popen_uid: bool = False  # no namespaces, root: Popen switches to the sandbox uid

    @property
    def uses_uid(self) -> bool:
        return self.drop == "uid" or self.popen_uid

    @property
    def description(self) -> str:
        if self.fs == "kernel":
            parts = [
                f"kernel: {'+'.join(self.namespaces)} namespaces",
                "no network (empty network namespace)",
                "read-only filesystem except the working dir, home/tmp/run hidden (mount namespace)",
            ]
            if "pid" in self.namespaces:
                parts.append("own PID namespace and /proc")
            parts.append("own unprivileged uid" if self.drop == "uid" else "all capabilities dropped")
        else:
            parts = [
                "python-guard: no namespaces; file writes outside the working dir and network "
                "refused by a Python prelude (not a security boundary)"
            ]
            if self.popen_uid:
                parts.append("own unprivileged uid")
            elif os.geteuid() == 0:
                parts.append("runs as root: RLIMIT_NPROC does not apply, processes bounded by the timeout only")
        parts.append("rlimits cpu/as/fsize/nproc/core")
        return "; ".join(parts)


def _ladder(mode: str, euid: int) -> list[_Plan]:
    """Plans from strongest to weakest for this user; `mode="python-guard"` keeps only the guards."""
    as_root = euid == 0
    drop: Literal["uid", "caps"] = "uid" if as_root else "caps"
    user = () if as_root else ("user",)  # root needs no user namespace to unshare the others
    kernel = [
        _Plan((*user, "net", "mount", "pid"), "kernel", "kernel", drop),
        _Plan((*user, "net", "mount"), "kernel", "kernel", drop),
    ]
    guard = [_Plan((), "guard", "guard", "none", popen_uid=True)] if as_root else []
    guard.append(_Plan((), "guard", "guard", "none"))
    return guard if mode == "python-guard" else kernel + guard


_UNSHARE_FLAGS = {
    "user": ("--user", "--map-root-user"),
    "net": ("--net",),
    "mount": ("--mount", "--propagation", "private"),
    "pid": ("--pid", "--fork", "--kill-child", "--mount-proc"),
}


def default_hidden_paths() -> tuple[str, ...]:
    """Directories covered by an empty tmpfs in the sandbox: the home dir, the temp dir, /run."""
    candidates = [str(Path.home()), tempfile.gettempdir(), "/run"]
    hidden = []
    for path in candidates:
        real = os.path.realpath(path)
        if real != "/" and os.path.isdir(real) and real not in hidden:
            hidden.append(real)
    return tuple(hidden)


# --------------------------------------------------------------------------- the prelude

# Run by the sandbox's interpreter (`python -I -B -c _PRELUDE CONFIG`) before the user's code:
# it puts the mounts in place, drops privileges, sets the rlimits, installs the Python guards
# where the plan says so, then runs main.py as `__main__`. It must only use the standard
# library and fail loudly (exit 121) rather than run the user's code less isolated than planned.
_PRELUDE = r'''
import json, os, sys

CFG = json.loads(sys.argv[1])
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442  # same number on every arch
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 24, 28, 38, 47


def fail(message):
    sys.stderr.write("sandbox setup failed: %s\n" % message)
    sys.stderr.flush()
    os._exit(121)


def libc():
    import ctypes
    lib = ctypes.CDLL(None, use_errno=True)

    def call(result, what):
        if result < 0:
            err = ctypes.get_errno()
            raise OSError(err, "%s: %s" % (what, os.strerror(err)))
        return result
    return ctypes, lib, call


def needed_paths(workdir, visible):
    """The interpreter's own directories, the working dir and the caller's `visible` paths: they stay
    visible (read-only) under hidden dirs."""
    paths = {workdir, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)), os.path.dirname(sys.executable)}
    for entry in [*sys.path, *visible]:
        if os.path.isfile(entry):
            paths.add(os.path.dirname(entry))
        elif os.path.isdir(entry):
            paths.add(entry)
    real = sorted({os.path.realpath(p) for p in paths if p})
    # Keep only outermost paths: a path inside another comes along with it.
    return [p for p in real if not any(p.startswith(q.rstrip("/") + "/") for q in real if q != p)]


def kernel_fs(workdir, hidden, visible):
    ctypes, lib, call = libc()
    c = ctypes

    def mount(source, target, fstype, flags, data):
        enc = lambda s: None if s is None else s.encode()
        call(lib.mount(enc(source), enc(target), enc(fstype), c.c_ulong(flags), enc(data)), "mount " + target)

    class MountAttr(c.Structure):
        _fields_ = [("attr_set", c.c_uint64), ("attr_clr", c.c_uint64),
                    ("propagation", c.c_uint64), ("userns_fd", c.c_uint64)]

    def set_attr(path, attr_set=0, attr_clr=0, recursive=False):
        attr = MountAttr(attr_set, attr_clr, 0, 0)
        call(lib.syscall(c.c_long(SYS_MOUNT_SETATTR), c.c_int(AT_FDCWD), c.c_char_p(path.encode()),
                         c.c_uint(AT_RECURSIVE if recursive else 0), c.byref(attr), c.c_size_t(c.sizeof(attr))),
             "mount_setattr " + path)

    def clone_tree(path):  # a detached copy of the mount tree at path (open_tree OPEN_TREE_CLONE)
        return call(lib.syscall(c.c_long(SYS_OPEN_TREE), c.c_int(AT_FDCWD), c.c_char_p(path.encode()),
                                c.c_uint(1 | 0o2000000 | AT_RECURSIVE)), "open_tree " + path)

    def attach_tree(fd, path):
        call(lib.syscall(c.c_long(SYS_MOVE_MOUNT), c.c_int(fd), c.c_char_p(b""), c.c_int(AT_FDCWD),
                         c.c_char_p(path.encode()), c.c_uint(0x4)), "move_mount " + path)

    # Nothing done here may reach the host's mount table.
    mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    keep = needed_paths(workdir, visible)
    for path in hidden:
        if not os.path.isdir(path) or path in keep:
            continue
        inside = [k for k in keep if k.startswith(path.rstrip("/") + "/")]
        clones = [(k, clone_tree(k)) for k in inside]
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        for k, fd in clones:
            os.makedirs(k, exist_ok=True)
            attach_tree(fd, k)
            os.close(fd)
    mount(workdir, workdir, None, MS_BIND | MS_REC, None)
    writable = [workdir]
    if os.path.isdir("/dev/shm"):  # multiprocessing needs a writable /dev/shm: a private one
        mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m")
        writable.append("/dev/shm")
    set_attr("/", attr_set=MOUNT_ATTR_RDONLY, recursive=True)
    for path in writable:
        set_attr(path, attr_clr=MOUNT_ATTR_RDONLY)
    os.chdir(workdir)  # the old cwd is the hidden, now read-only, directory


def drop_bounding_set(lib, call):
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        call(lib.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop capability %d" % cap)


def drop_to_uid(uid, gid):
    ctypes, lib, call = libc()
    drop_bounding_set(lib, call)
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # clears the permitted and effective capabilities
    call(lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def drop_capabilities():
    ctypes, lib, call = libc()
    # noroot + locked, no_setuid_fixup locked, keep_caps locked, no_cap_ambient_raise + locked
    call(lib.prctl(PR_SET_SECUREBITS, 0xEB, 0, 0, 0), "securebits")
    drop_bounding_set(lib, call)
    call(lib.prctl(PR_CAP_AMBIENT, 4, 0, 0, 0), "clear ambient capabilities")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    call(lib.capset(header, data), "capset")
    call(lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def check_no_capabilities():
    with open("/proc/self/status") as f:
        caps = dict(line.split(":", 1) for line in f if line.startswith("Cap"))
    if any(int(caps[k], 16) for k in ("CapPrm", "CapEff", "CapBnd", "CapAmb")):
        fail("capabilities left: %r" % caps)


def set_rlimits(limits):
    import resource
    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def guard_files(workdir):
    import builtins, io, re
    root = os.path.realpath(workdir)
    devices = {"/dev/null", "/dev/zero", "/dev/full", "/dev/tty"}
    environ = re.compile(r"^/proc/(\d+)/(task/\d+/)?environ$")
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def resolve(path, dir_fd=None):
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink("/proc/self/fd/%d" % dir_fd), path)
        return os.path.realpath(path)

    def check_write(path, what, dir_fd=None):
        if isinstance(path, int):
            return
        real = resolve(path, dir_fd)
        if not (real == root or real.startswith(root + os.sep) or real in devices):
            raise PermissionError(13, "sandbox: %s outside the working directory is not allowed" % what,
                                  os.fsdecode(path))

    def check_read(path, dir_fd=None):
        if isinstance(path, int):
            return
        match = environ.match(resolve(path, dir_fd))
        if match and int(match.group(1)) != os.getpid():
            raise PermissionError(13, "sandbox: reading another process's environment is not allowed",
                                  os.fsdecode(path))

    real_open, real_os_open = builtins.open, os.open

    def guarded_open(file, mode="r", *args, **kwargs):
        if any(ch in mode for ch in "wax+"):
            check_write(file, "writing")
        else:
            check_read(file)
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & write_flags:
            check_write(path, "writing", dir_fd)
        else:
            check_read(path, dir_fd)
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    def wrap(name, positions, fd_keyword="dir_fd"):
        real = getattr(os, name, None)
        if real is None:
            return

        def guarded(*args, **kwargs):
            for index, keyword in positions:
                path = args[index] if index < len(args) else kwargs.get(keyword)
                if path is not None:
                    fd = kwargs.get("dst_dir_fd" if keyword == "dst" else "src_dir_fd", kwargs.get(fd_keyword))
                    check_write(path, name, fd)
            return real(*args, **kwargs)
        setattr(os, name, guarded)

    builtins.open = io.open = guarded_open
    os.open = guarded_os_open
    for name in ("remove", "unlink", "rmdir", "mkdir", "chmod", "chown", "lchown", "truncate",
                 "utime", "mkfifo", "mknod", "chflags", "lchmod", "setxattr", "removexattr"):
        wrap(name, [(0, "path")])
    for name in ("rename", "replace", "link"):
        wrap(name, [(0, "src"), (1, "dst")])
    wrap("symlink", [(1, "dst")])


def guard_network_and_exec():
    import socket, subprocess

    def denied(*args, **kwargs):
        raise PermissionError(1, "sandbox: network access and running programs are disabled")

    for name in ("connect", "connect_ex", "bind", "listen", "accept", "sendto", "sendmsg"):
        setattr(socket.socket, name, denied)
    for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr",
                 "create_connection", "create_server"):
        setattr(socket, name, denied)
    # Another program (curl, a shell) would not see the Python guards: refuse to start one.
    for name in ("system", "popen", "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp",
                 "execvpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp",
                 "spawnlpe", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, denied)

    class DeniedPopen(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            denied()

    subprocess.Popen = DeniedPopen


def isolate():
    try:
        if CFG["fs"] == "kernel":
            kernel_fs(CFG["workdir"], CFG["hide"], CFG["visible"])
        if CFG["drop"] == "uid":
            drop_to_uid(CFG["uid"], CFG["gid"])
            check_no_capabilities()
        elif CFG["drop"] == "caps":
            drop_capabilities()
            check_no_capabilities()
        set_rlimits(CFG["rlimits"])
    except Exception as error:
        fail("%s: %s" % (type(error).__name__, error))


def supervise(status_fd):
    """As the PID namespace's first process, run the program in a child and report how it ended.

    The namespace's first process ignores signals it has no handler for (SIGXCPU, a SIGTERM the
    program sends itself), so the program must not be it; when it exits, the kernel kills every
    process left in the namespace.
    """
    child = os.fork()
    if child == 0:
        os.close(status_fd)
        return
    status = None
    while True:
        try:
            pid, wait_status = os.waitpid(-1, 0)  # also reaps orphans, as an init must
        except ChildProcessError:
            break
        if pid == child:
            status = wait_status
            break
    if status is not None:
        os.write(status_fd, b"%d" % status)
    os._exit(0)


def guard():
    try:
        if CFG["fs"] == "guard":
            guard_files(CFG["workdir"])
        if CFG["net"] == "guard":
            guard_network_and_exec()
    except Exception as error:
        fail("%s: %s" % (type(error).__name__, error))


def run_main(script):
    import traceback, types
    main = types.ModuleType("__main__")
    main.__file__ = script
    sys.modules["__main__"] = main
    sys.argv = [script]
    sys.path.insert(0, os.path.dirname(script))
    try:
        with open(script, encoding="utf-8") as f:
            code = compile(f.read(), script, "exec")
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as error:
        # Leave this prelude's own frame out of the traceback the user's code caused.
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        sys.stderr.flush()
        os._exit(1)


isolate()
if CFG["status_fd"] is not None:
    supervise(CFG["status_fd"])
guard()
run_main(CFG["script"])
'''


# --------------------------------------------------------------------------- helpers


class _UidPool:
    """Unused uids for programs run by root, one per concurrent program.

    RLIMIT_NPROC counts the processes of a uid, so a uid of its own makes the limit hold per
    program. The range is far above any real account and offset by this process's pid so that
    two trainers on one machine are unlikely to share uids.
    """

    def __init__(self, size: int = 64) -> None:
        self._base = 1_900_000_000 + (os.getpid() % 100_000) * size
        self._size = size
        self._free = list(range(size))
        self._lock = threading.Lock()

    def acquire(self) -> int:
        with self._lock:
            slot = self._free.pop(0) if self._free else 0  # more programs than slots: share slot 0
            return self._base + slot

    def release(self, uid: int) -> None:
        with self._lock:
            slot = uid - self._base
            if slot not in self._free and 0 <= slot < self._size:
                self._free.append(slot)


_UID_POOL = _UidPool()


def _kernel_version() -> tuple[int, int]:
    try:
        major, minor = platform.release().split(".")[:2]
        return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)
    except ValueError:
        return (0, 0)


def _task_count(uid: int) -> int:
    """Tasks (threads included, as RLIMIT_NPROC counts them) whose real uid is `uid`."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            total += int(fields.get("Threads", "1"))
    return total


def _nproc_limit(plan: _Plan, limits: SandboxLimits) -> int:
    """RLIMIT_NPROC for a program: exact where the kernel counts it per sandbox, else added to the current count."""
    if plan.uses_uid:
        return limits.max_processes  # a uid of its own: its count starts at 0
    if "user" in plan.namespaces and _kernel_version() >= _MIN_NPROC_KERNEL:
        return limits.max_processes  # counted per user namespace
    return _task_count(os.getuid()) + limits.max_processes


def _rlimits(plan: _Plan, limits: SandboxLimits) -> dict[str, tuple[int, int]]:
    """(soft, hard) limits; the CPU soft limit sends SIGXCPU, the hard one a second later SIGKILL."""
    cpu = max(1, math.ceil(limits.cpu_s))
    return {
        name: (value, value)
        for name, value in {
            "RLIMIT_AS": int(limits.memory_bytes),
            "RLIMIT_FSIZE": int(limits.file_size_bytes),
            "RLIMIT_NPROC": _nproc_limit(plan, limits),
            "RLIMIT_CORE": 0,
        }.items()
    } | {"RLIMIT_CPU": (cpu, cpu + 1)}


def _write_inputs(workdir: str, code: str, files: Mapping[str, str] | None) -> str:
    """main.py and the extra files, by relative paths that must stay inside the working dir."""
    script = os.path.join(workdir, SCRIPT_NAME)
    Path(script).write_text(code, encoding="utf-8")
    for name, content in (files or {}).items():
        target = os.path.realpath(os.path.join(workdir, name))
        if os.path.isabs(name) or not target.startswith(workdir + os.sep) or target == script:
            raise ValueError(
                f"sandbox file name {name!r} must be a relative path inside the working dir, not {SCRIPT_NAME}"
            )
        os.makedirs(os.path.dirname(target), exist_ok=True)
        Path(target).write_text(content, encoding="utf-8")
    return script


def _chown_tree(root: str, uid: int) -> None:
    os.chown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, uid)


def _environment(workdir: str) -> dict[str, str]:
    """A minimal environment: nothing of the parent's (tokens, keys) reaches the program."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _command(plan: _Plan, python: str, site_packages: bool, config: dict[str, Any]) -> list[str]:
    interpreter = [python, "-I", "-B", *([] if site_packages else ["-S"]), "-c", _PRELUDE, json.dumps(config)]
    if not plan.namespaces:
        return interpreter
    unshare = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if unshare is None:
        raise FileNotFoundError("unshare (util-linux) is not installed")
    flags = [flag for name in plan.namespaces for flag in _UNSHARE_FLAGS[name]]
    return [unshare, *flags, "--", *interpreter]


class _CappedBuffer:
    """Keeps the first `cap` bytes of a stream and counts the rest."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.truncated = False

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        if len(chunk) > room:
            self.truncated = True

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (the PID namespace's first process, under `unshare --fork`)."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _is_zombie(proc_dir: str) -> bool:
    try:
        stat = Path(proc_dir, "stat").read_text()
    except OSError:
        return True  # gone
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def _stragglers(workdir: str, uid: int | None) -> list[int]:
    """Live processes still running under the sandbox's uid, or with their cwd in its working dir."""
    found = []
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if uid is not None and os.stat(entry.path).st_uid == uid:
                match = True
            else:
                cwd = os.readlink(os.path.join(entry.path, "cwd"))
                match = cwd == workdir or cwd.startswith(workdir + os.sep)
        except OSError:
            continue
        if match and not _is_zombie(entry.path):  # a zombie is dead already; its parent reaps it
            found.append(int(entry.name))
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_everything(proc: subprocess.Popen, workdir: str, uid: int | None, pid_namespace: bool) -> None:
    """SIGKILL the PID namespace, the process group and every straggler, until none is left."""
    if pid_namespace and proc.returncode is None:  # not reaped yet, so proc.pid is still unshare
        namespace_init = _children(proc.pid)
        for child in namespace_init:
            _kill(child)  # the kernel then kills every process in the namespace
        if namespace_init:
            try:  # let unshare reap it (a zombie left to the host's init may linger)
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for _ in range(100):  # a fork bomb may still be forking (within RLIMIT_NPROC) while we sweep
        left = _stragglers(workdir, uid)
        if not left:
            return
        for pid in left:
            _kill(pid)
        time.sleep(0.01)
    logger.warning("sandbox: processes %s in %s survived SIGKILL", _stragglers(workdir, uid), workdir)


@dataclass
class _Outcome:
    stdout: _CappedBuffer
    stderr: _CappedBuffer
    timed_out: bool
    wall_s: float


def _collect(proc: subprocess.Popen, limits: SandboxLimits, started: float, on_exit: Callable[[], None]) -> _Outcome:
    """Read both pipes (capped) until they close or the wall clock runs out."""
    assert proc.stdout is not None and proc.stderr is not None
    buffers = {
        proc.stdout.fileno(): _CappedBuffer(limits.output_bytes),
        proc.stderr.fileno(): _CappedBuffer(limits.output_bytes),
    }
    deadline = started + limits.timeout_s
    ended: float | None = None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        selector.register(proc.stderr, selectors.EVENT_READ)
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline:
                return _Outcome(buffers[proc.stdout.fileno()], buffers[proc.stderr.fileno()], True, now - started)
            if ended is None and proc.poll() is not None:
                ended = now
                on_exit()  # children that kept the pipes open must not hold us until the timeout
            for key, _ in selector.select(timeout=min(deadline - now, 0.05)):
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    buffers[key.fd].add(chunk)
                else:
                    selector.unregister(key.fileobj)
    timed_out = False
    if ended is None:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        ended = time.monotonic()
    return _Outcome(buffers[proc.stdout.fileno()], buffers[proc.stderr.fileno()], timed_out, ended - started)


def _program_returncode(returncode: int, status_read: int | None) -> int:
    """The program's own return code: from the status pipe under a PID namespace, else the process's."""
    if status_read is None:
        return returncode
    os.set_blocking(status_read, False)
    try:
        reported = os.read(status_read, 64)
    except BlockingIOError:
        reported = b""
    return os.waitstatus_to_exitcode(int(reported)) if reported else returncode


def _signal_name(returncode: int | None) -> str | None:
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _execute(
    plan: _Plan,
    code: str,
    *,
    limits: SandboxLimits,
    stdin: str,
    files: Mapping[str, str] | None,
    python: str,
    site_packages: bool,
    hidden: Sequence[str],
    visible: Sequence[str] = (),
) -> SandboxResult:
    """Run one program under `plan`; every process it started is dead when this returns."""
    uid = _UID_POOL.acquire() if plan.uses_uid else None
    pid_namespace = "pid" in plan.namespaces
    # Under a PID namespace the program's exit status comes from the namespace's first process
    # through this pipe (unshare cannot pass on a death by SIGKILL).
    status_read, status_write = os.pipe() if pid_namespace else (None, None)
    try:
        with (
            tempfile.TemporaryDirectory(prefix="grpo-sandbox-", ignore_cleanup_errors=True) as tmp,
            tempfile.TemporaryFile() as stdin_file,
        ):
            workdir = os.path.realpath(tmp)
            script = _write_inputs(workdir, code, files)
            if uid is not None:
                _chown_tree(workdir, uid)
            stdin_file.write(stdin.encode("utf-8"))
            stdin_file.seek(0)
            config = {
                "workdir": workdir,
                "script": script,
                "fs": plan.fs,
                "net": plan.net,
                "drop": plan.drop,
                "uid": uid,
                "gid": uid,
                "hide": list(hidden),
                "visible": list(visible),
                "rlimits": _rlimits(plan, limits),
                "status_fd": status_write,
            }
            popen_user: dict[str, Any] = {"user": uid, "group": uid, "extra_groups": []} if plan.popen_uid else {}
            started = time.monotonic()
            proc = subprocess.Popen(
                _command(plan, python, site_packages, config),
                cwd=workdir,
                env=_environment(workdir),
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
                pass_fds=() if status_write is None else (status_write,),
                **popen_user,
            )
            if status_write is not None:
                os.close(status_write)
                status_write = None
            try:
                outcome = _collect(proc, limits, started, lambda: _kill_everything(proc, workdir, uid, pid_namespace))
            finally:
                _kill_everything(proc, workdir, uid, pid_namespace)
                proc.wait()
                proc.stdout.close()  # type: ignore[union-attr]
                proc.stderr.close()  # type: ignore[union-attr]
            returncode = _program_returncode(proc.returncode, status_read)
    finally:
        for fd in (status_read, status_write):
            if fd is not None:
                os.close(fd)
        if uid is not None:
            _UID_POOL.release(uid)
    if outcome.timed_out:
        returncode = -signal.SIGKILL  # whatever the kill looked like from outside
    return SandboxResult(
        stdout=outcome.stdout.text(),
        stderr=outcome.stderr.text(),
        exit_code=returncode if returncode >= 0 else None,
        signal=_signal_name(returncode),
        wall_s=outcome.wall_s,
        timed_out=outcome.timed_out,
        stdout_truncated=outcome.stdout.truncated,
        stderr_truncated=outcome.stderr.truncated,
    )


# --------------------------------------------------------------------------- the probe

_PROBE_LOCK = threading.Lock()


def _probe_plan(plan: _Plan, python: str, site_packages: bool, hidden: Sequence[str]) -> str | None:
    """None when `plan` runs a program and keeps it in; else why not."""
    outside = tempfile.mkdtemp(prefix="grpo-sandbox-probe-")
    os.chmod(outside, 0o777)  # so that only the isolation, not file permissions, can refuse the write
    target = os.path.join(outside, "escaped")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        code = (
            "import decimal, json, socket\n"
            f"try:\n    open({target!r}, 'w').write('x')\nexcept OSError:\n    pass\n"
            f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\nexcept OSError:\n    pass\n"
            "print('probe-ok')\n"
        )
        try:
            result = _execute(
                plan,
                code,
                limits=SandboxLimits(timeout_s=30.0),
                stdin="",
                files=None,
                python=python,
                site_packages=site_packages,
                hidden=hidden,
            )
        except OSError as error:
            shutil.rmtree(outside, ignore_errors=True)
            return f"cannot start: {error}"
        listener.setblocking(False)
        try:
            listener.accept()[0].close()
            connected = True
        except BlockingIOError:
            connected = False
    escaped = os.path.exists(target)
    shutil.rmtree(outside, ignore_errors=True)
    if not result.ok or "probe-ok" not in result.stdout:
        return f"probe program failed (exit {result.exit_code}, {result.signal}): {result.stderr.strip()[-300:]}"
    if escaped:
        return "the probe wrote outside its working dir"
    if connected:
        return "the probe reached a socket on the host"
    return None


@functools.cache
def _choose_plan(python: str, mode: str, site_packages: bool, hidden: tuple[str, ...]) -> _Plan:
    """The strongest plan of the ladder that works on this machine (probed once per setting)."""
    failures = []
    for plan in _ladder(mode, os.geteuid()):
        reason = _probe_plan(plan, python, site_packages, hidden)
        if reason is None:
            logger.info("sandbox isolation: %s", plan.description)
            return plan
        failures.append(f"{plan.namespaces or 'no namespaces'}/{plan.fs}: {reason}")
        logger.info("sandbox isolation %s unavailable: %s", plan.description, reason)
    raise RuntimeError("no sandbox isolation works on this machine:\n" + "\n".join(failures))


class _IsolationAttribute:
    """`LocalSandbox.isolation` (the default sandbox) or `sandbox.isolation`: the isolation in force."""

    def __get__(self, obj: LocalSandbox | None, owner: type) -> str:
        if obj is None:
            return LocalSandbox().isolation
        return obj.plan.description


class LocalSandbox:
    """Runs untrusted Python programs on this machine, each isolated and limited (see the module doc).

    `run(code)` runs one program; `run_batch(codes)` runs several, at most `max_workers` at a
    time. `mode="auto"` takes the strongest isolation that works here; `mode="python-guard"`
    forces the Python-level guard (for tests, or machines where the probe misjudges).
    """

    isolation = _IsolationAttribute()

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        max_workers: int | None = None,
        python: str | None = None,
        mode: Literal["auto", "python-guard"] = "auto",
        hidden_paths: Sequence[str] | None = None,
        visible_paths: Sequence[str] = (),
        site_packages: bool = True,
    ) -> None:
        if mode not in ("auto", "python-guard"):
            raise ValueError(f"mode must be 'auto' or 'python-guard', got {mode!r}")
        self.limits = limits or SandboxLimits()
        self.max_workers = max_workers or max(1, min(4, os.cpu_count() or 1))
        self.python = python or sys.executable
        self.mode = mode
        self.hidden_paths = tuple(
            os.path.realpath(p) for p in (default_hidden_paths() if hidden_paths is None else hidden_paths)
        )
        # Inside hidden dirs, these stay visible (read-only), as the interpreter's own paths do: the
        # import paths of a program that imports the caller's code (a tool given by its module path).
        self.visible_paths = tuple(os.path.realpath(p) for p in visible_paths)
        self.site_packages = site_packages

    @property
    def plan(self) -> _Plan:
        with _PROBE_LOCK:  # one probe at a time, even when the first calls come from a batch
            return _choose_plan(self.python, self.mode, self.site_packages, self.hidden_paths)

    def run(
        self,
        code: str,
        *,
        stdin: str = "",
        timeout_s: float | None = None,
        files: Mapping[str, str] | None = None,
    ) -> SandboxResult:
        """Run `code` as `main.py` in a fresh directory holding `files`; `timeout_s` overrides the limit."""
        limits = self.limits if timeout_s is None else replace(self.limits, timeout_s=timeout_s)
        return _execute(
            self.plan,
            code,
            limits=limits,
            stdin=stdin,
            files=files,
            python=self.python,
            site_packages=self.site_packages,
            hidden=self.hidden_paths,
            visible=self.visible_paths,
        )

    def run_batch(
        self,
        codes: Sequence[str],
        *,
        stdins: Sequence[str] | None = None,
        timeout_s: float | None = None,
        files: Mapping[str, str] | None = None,
    ) -> list[SandboxResult]:
        """Run each program (at most `max_workers` at a time); results in the order of `codes`."""
        _ = self.plan  # probe before the threads start, so they do not queue on the probe lock
        return run_each(self.run, codes, stdins, timeout_s, files, self.max_workers)


def run_each(
    run: Callable[..., SandboxResult],
    codes: Sequence[str],
    stdins: Sequence[str] | None,
    timeout_s: float | None,
    files: Mapping[str, str] | None,
    max_workers: int,
) -> list[SandboxResult]:
    """`run(code, stdin=, timeout_s=, files=)` for each program, at most `max_workers` at a time; results in
    the order of `codes` (every sandbox's `run_batch`)."""
    if stdins is not None and len(stdins) != len(codes):
        raise ValueError(f"{len(stdins)} stdins for {len(codes)} programs")
    if not codes:
        return []
    inputs = stdins if stdins is not None else [""] * len(codes)
    with ThreadPoolExecutor(max_workers=min(max_workers, len(codes)), thread_name_prefix="sandbox") as pool:
        futures = [
            pool.submit(run, code, stdin=text, timeout_s=timeout_s, files=files)
            for code, text in zip(codes, inputs, strict=True)
        ]
        return [future.result() for future in futures]
