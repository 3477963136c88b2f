"""User code (reward functions, reward environments, tools, environments' methods) under a deadline, in a
long-lived process that can be killed.

    worker = user_code(funcs, key)                      # one process per set of callables, kept
    value = worker.call(0, timeout_s, *args, **kwargs)  # funcs[0](*args, **kwargs); DeadlineExceeded past it
    value = worker.call(func, timeout_s, **kwargs)      # a callable sent with this call only

The process is started on the first call from a fresh interpreter (never a fork of this threaded
process), and the callables are sent to it once, with cloudpickle: a lambda, a closure or a function
defined in a script travels by value, a module's function by reference. They are then called by index,
so a function that keeps state in its own objects keeps it from call to call. A callable that cannot
be sent (it holds a lock, a socket, a CUDA model) is refused at the first call (Unsendable). Arguments
and values travel pickled both ways; an async callable is awaited there. Past the deadline the process
is killed (SIGKILL), whatever the call is doing (a Python loop, a sleep or socket read in C, an
`except BaseException` that swallows everything), and the next call starts a fresh one from the
callables as first sent: their state restarts. Calls that overlap (scoring several shards at once) run
on threads of their own in the same process, sharing its state as they would here; a kill ends them all.
The processes end with the run that started them (close_all), with this process at exit, and on their own
if it is killed.

Only the standard library is imported at module level: the sandbox imports workers/tools/calls.py.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
import io
import itertools
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
from collections import ChainMap, OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

START_TIMEOUT_S = 120.0  # for a fresh process to load the callables (slow where the machine is busy)
KEPT_SETS = 32  # sets of callables whose processes are kept; the least recently used beyond go
PROGRAM = (
    "import sys; sys.path[:0] = {paths!r}; from grpo_flow.workers.rewards.deadline import serve; serve({fd}, {parent})"
)


class DeadlineExceeded(Exception):
    """The call did not return within its timeout; its process was killed."""


class CallProcessDied(RuntimeError):
    """The call's process ended without an answer (os._exit, a crash, a signal)."""


class Unsendable(ValueError):
    """A callable (or a call's arguments) that cannot be sent to, or loaded in, the process: `reason` says why."""

    def __init__(self, reason: str):
        super().__init__(f"cannot be sent to its process: {reason}")
        self.reason = reason


class RemoteTraceback(Exception):
    """The traceback of an exception raised in the call's process, set as its cause."""

    def __str__(self) -> str:
        return str(self.args[0])


def import_paths() -> list[str]:
    """This process's import path, absolute, for another process to import user code as this one does."""
    return list(dict.fromkeys(os.path.abspath(p or ".") for p in sys.path if os.path.isdir(p or ".")))


@dataclass
class _Waiting:
    """A call waiting for its answer: (ok, value or exception, traceback text)."""

    done: threading.Event = field(default_factory=threading.Event)
    answer: tuple[bool, Any, str] | None = None

    def give(self, answer: tuple[bool, Any, str]) -> None:
        self.answer = answer
        self.done.set()


@dataclass
class _Process:
    """One started process, its connection and the calls waiting on it; a thread hands out its answers."""

    popen: subprocess.Popen[bytes]
    connection: Connection
    waiting: dict[int, _Waiting] = field(default_factory=dict)

    def read_answers(self) -> None:
        while True:
            try:
                call_id, answer = pickle.loads(self.connection.recv_bytes())
            except (EOFError, OSError):
                break
            waiting = self.waiting.pop(call_id, None)
            if waiting is not None:
                waiting.give(pickle.loads(answer))
        self.connection.close()
        code = self.popen.wait()
        ended = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        for waiting in list(self.waiting.values()):  # calls that were running when it ended
            waiting.give((False, CallProcessDied(f"its process ended without an answer ({ended})"), ""))

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait()


class UserCode:
    """One process holding `funcs`, started at the first call and again after a kill. Calls may overlap:
    each runs on a thread of its own there, as it would here."""

    def __init__(self, funcs: Sequence[Callable[..., Any]]):
        self.funcs = list(funcs)
        self._payload: bytes | None = None
        self._process: _Process | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def call(self, target: int | Callable[..., Any], timeout_s: float, /, *args: Any, **kwargs: Any) -> Any:
        """`funcs[target](*args, **kwargs)` (or `target(...)`), awaited, in the process: its value, or its
        exception raised here with the process's traceback as the cause."""
        try:
            message = dumps((target, args, kwargs))
        except Exception as error:
            raise Unsendable(f"the call's arguments cannot be pickled: {type(error).__name__}: {error}") from None
        waiting, call_id = _Waiting(), next(self._ids)
        with self._lock:
            process = self._started()
            process.waiting[call_id] = waiting
            process.connection.send_bytes(pickle.dumps((call_id, message)))
        try:
            if not waiting.done.wait(timeout_s):
                raise DeadlineExceeded(f"did not return within {timeout_s:g} s")
        except BaseException:  # past the deadline, or this process interrupted: the call is killed
            self._kill(process)
            raise
        assert waiting.answer is not None
        return _value(waiting.answer)

    def close(self) -> None:
        """Kill the process, if any; the next call starts a fresh one."""
        if self._process is not None:
            self._kill(self._process)

    def _kill(self, process: _Process) -> None:
        with self._lock:
            if self._process is process:
                self._process = None
        process.kill()

    def _started(self) -> _Process:
        if self._process is not None and self._process.popen.poll() is None:
            return self._process
        payload = self.payload()
        ours, theirs = Pipe()
        program = PROGRAM.format(paths=import_paths(), fd=theirs.fileno(), parent=os.getpid())
        popen = subprocess.Popen([sys.executable, "-c", program], pass_fds=[theirs.fileno()])
        theirs.close()
        try:
            ours.send_bytes(payload)
            if not ours.poll(START_TIMEOUT_S):
                raise CallProcessDied(f"its process did not start within {START_TIMEOUT_S:g} s")
            loaded, reason = pickle.loads(ours.recv_bytes())
            if not loaded:
                raise Unsendable(reason)
        except BaseException as error:
            popen.kill()
            popen.wait()
            ours.close()
            if isinstance(error, EOFError):
                raise CallProcessDied(f"its process ended while loading (exit status {popen.returncode})") from None
            raise
        self._process = _Process(popen, ours)
        threading.Thread(target=self._process.read_answers, name="grpo-flow-user-code", daemon=True).start()
        return self._process

    def payload(self) -> bytes:
        """The callables, cloudpickled once; Unsendable says why one cannot be."""
        if self._payload is None:
            pickled = []
            for func in self.funcs:
                try:
                    pickled.append(dumps(func))
                except Exception as error:
                    raise Unsendable(f"{type(error).__name__}: {error}") from None
            self._payload = pickle.dumps(pickled)
        return self._payload


def dumps(value: Any) -> bytes:
    """`value` cloudpickled, a function sent by value keeping the name of the file it was written in (which
    cloudpickle drops), so that a traceback from the process shows its lines."""
    buffer = io.BytesIO()
    _pickler()(buffer).dump(value)
    return buffer.getvalue()


@functools.cache
def _pickler() -> type:
    import cloudpickle

    if not hasattr(cloudpickle.cloudpickle, "_code_reduce"):  # a private function: tracebacks lose file names
        return cloudpickle.Pickler

    class Pickler(cloudpickle.Pickler):
        dispatch_table = ChainMap({types.CodeType: _code_with_its_file}, cloudpickle.Pickler.dispatch_table)

    return Pickler


def _code_with_its_file(code: types.CodeType) -> tuple[Any, ...]:
    import cloudpickle.cloudpickle as cloudpickle_module

    rebuild, args = cloudpickle_module._code_reduce(code)
    return rebuild, tuple(code.co_filename if arg == "<dynamic-code>" else arg for arg in args)


def _value(answer: tuple[bool, Any, str]) -> Any:
    ok, value, trace = answer
    if ok:
        return value
    value.__cause__ = RemoteTraceback(trace)
    raise value


# -- processes by the callables they hold ----------------------------------------------------------
_KEPT: OrderedDict[Hashable, UserCode] = OrderedDict()
_KEPT_LOCK = threading.Lock()


def user_code(funcs: Sequence[Callable[..., Any]], key: Hashable) -> UserCode:
    """The process holding `funcs` (the same callables have the same `key`), made at the first call."""
    with _KEPT_LOCK:
        worker = _KEPT.get(key)
        if worker is None:
            worker = _KEPT[key] = UserCode(funcs)
        _KEPT.move_to_end(key)
        evicted = [_KEPT.popitem(last=False)[1] for _ in range(len(_KEPT) - KEPT_SETS)]
    for old in evicted:
        old.close()
    return worker


@atexit.register
def close_all() -> None:
    """End every process, at a run's end: the next call starts fresh ones."""
    with _KEPT_LOCK:
        workers = list(_KEPT.values())
        _KEPT.clear()
    for worker in workers:
        worker.close()


# -- in the process --------------------------------------------------------------------------------
def serve(fd: int, parent: int) -> None:
    """The process's loop: load the callables, then answer each call, until the parent goes."""
    import cloudpickle

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    connection = Connection(fd)
    funcs = []
    for pickled in pickle.loads(connection.recv_bytes()):
        try:
            funcs.append(cloudpickle.loads(pickled))
        except Exception as error:  # a module this process cannot import, say
            connection.send_bytes(pickle.dumps((False, f"loading it raised {type(error).__name__}: {error}")))
            return
    connection.send_bytes(pickle.dumps((True, "")))
    sending = threading.Lock()
    while True:
        try:
            call_id, message = pickle.loads(connection.recv_bytes())
        except EOFError:
            return
        args = (connection, sending, call_id, functools.partial(_called, funcs, message))
        threading.Thread(target=_answer, args=args, daemon=True).start()


def _answer(connection: Connection, sending: threading.Lock, call_id: int, call: Callable[[], Any]) -> None:
    answer = _answered(call)
    with sending:
        connection.send_bytes(pickle.dumps((call_id, answer)))


def _called(funcs: list[Callable[..., Any]], message: bytes) -> Any:
    """The call `message` asks for: (index into `funcs` or a callable, args, kwargs)."""
    import cloudpickle

    target, args, kwargs = cloudpickle.loads(message)
    return (funcs[target] if isinstance(target, int) else target)(*args, **kwargs)


def _exit_with(parent: int) -> None:
    """End this process when its parent has (killed, or gone without closing it)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _answered(call: Callable[[], Any]) -> bytes:
    """(ok, value or exception, traceback text), pickled; what cannot make the way back is said in a
    RuntimeError."""
    try:
        value = call()
        answer = (True, run_coroutine(value) if inspect.isawaitable(value) else value, "")
    except BaseException as error:  # SystemExit too: the caller names it
        answer = (False, error, traceback.format_exc())
    try:
        data = dumps(answer)
        pickle.loads(data)  # an exception whose __init__ takes other arguments than its args pickles, then fails
        return data
    except Exception as error:
        what = f"{'value' if answer[0] else 'exception'} of type {type(answer[1]).__name__}"
        return pickle.dumps((False, RuntimeError(f"the call's {what} cannot be sent back: {error}"), answer[2]))


def run_coroutine(awaitable: Awaitable[Any]) -> Any:
    """Run an awaitable to completion from sync code, even where an event loop is already running."""

    async def wrapper() -> Any:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wrapper())
    # This thread's loop is busy running us: a fresh loop in another thread.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="user-code") as pool:
        return pool.submit(asyncio.run, wrapper()).result()
