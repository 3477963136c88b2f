"""A deadline for user code (reward functions, reward environments, tools given as Python objects).

    value = call_with_deadline(func, {"completions": ...}, 10.0)   # DeadlineExceeded past 10 s

The call runs in a child process forked from this one, so it sees what this process holds (the Python
API's lambdas and closures, reward environments, data set columns) without pickling any of it, and past
its deadline the child is killed, whatever it is doing: a Python loop, an `except Exception` retry loop,
a sleep, a socket read or another C call. An awaitable result is run to completion in the child.
What comes back is pickled: the return value, or the exception, whose cause then holds the traceback's
text from the child. What the call changes in this process's objects stays in the child (reward
functions' `log_extra`/`log_metric` calls are sent back and replayed by workers/rewards/functions.py).

A call whose changes must stay in this process (an environment's tool method: its instance holds the
episode) runs `in_this_process` instead, on a daemon thread waited for up to the deadline: an async one
is cancelled there, a sync one is left running (nothing stops a thread from outside), and cannot keep
the process alive. Code that must not see this process at all (untrusted code given by path) runs in
the sandbox (workers/rewards/sandbox.py).

Only the standard library is imported: the sandbox's tool program imports workers/tools/calls.py.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import multiprocessing
import threading
import traceback
from collections.abc import Callable
from typing import Any


CANCEL_GRACE_S = 0.5  # an async call on a thread, cancelled at its deadline, gets this long to end


class DeadlineExceeded(Exception):
    """The call did not return within its deadline; its process was killed."""


class CallProcessDied(RuntimeError):
    """The call's process ended without an answer (`os._exit`, a signal, out of memory)."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in the call's process, as text: the re-raised exception's cause."""

    def __str__(self) -> str:
        return str(self.args[0])


def call_with_deadline(
    func: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float, *, in_this_process: bool = False
) -> Any:
    """`func(**kwargs)`, awaited if it returns an awaitable, within `timeout_s` seconds: in a forked child
    that is killed at the deadline, or `in_this_process` on a thread that is left behind."""
    if in_this_process:
        return _on_a_thread(func, kwargs, timeout_s)
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_answer, args=(send, func, kwargs), name="grpo-flow-deadline", daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            raise DeadlineExceeded("its process was killed")
        try:
            returned, value, trace = receive.recv()
        except EOFError:
            child.join()
            raise CallProcessDied(f"its process ended without an answer (exit status {child.exitcode})") from None
    finally:
        child.kill()  # nothing to do once it has answered and exited
        child.join()
        receive.close()
    if returned:
        return value
    raise value from RemoteTraceback(trace)


def _on_a_thread(func: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float) -> Any:
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def body() -> None:
        try:
            value = func(**kwargs)
            if inspect.isawaitable(value):
                value = asyncio.run(asyncio.wait_for(_awaited(value), timeout_s))
            outcome["value"] = value
        except asyncio.TimeoutError:
            outcome["error"] = DeadlineExceeded("it was cancelled")
        except BaseException as error:  # raised in the caller's thread below
            outcome["error"] = error
        finally:
            done.set()

    thread = threading.Thread(target=contextvars.copy_context().run, args=(body,), name="grpo-flow-deadline")
    thread.daemon = True  # left running past the deadline, it cannot keep the process alive
    thread.start()
    if not done.wait(timeout_s + CANCEL_GRACE_S):
        raise DeadlineExceeded("it was left running on a daemon thread")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _answer(send: Any, func: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """In the child: the call's (True, value, "") or (False, exception, traceback text), sent to the parent."""
    try:
        value = func(**kwargs)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        answer: tuple[bool, Any, str] = (True, value, "")
    except BaseException as error:  # SystemExit and KeyboardInterrupt included: the parent re-raises them
        answer = (False, error, traceback.format_exc())
    try:
        send.send(answer)
    except Exception as error:  # a value or exception that cannot be pickled
        kind = "returned" if answer[0] else "raised"
        send.send(
            (False, TypeError(f"it {kind} {type(answer[1]).__name__}, which cannot be sent back: {error}"), answer[2])
        )


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
