"""Calls to a rollout engine in another process, over a `multiprocessing.connection.Connection`.

Both out-of-process engines use it: the transformers engine in a spawned child of this
interpreter (`process_engine`) and the vLLM engine in a process of the vLLM environment's
interpreter (`vllm_process` / `vllm_server`). Standard library only, so the vLLM environment
(which has no grpo-flow dependencies beyond vLLM's own) can import it.

A request is `(method, args, kwargs)`; the answer is `("ok", value)` or `("error", type name,
message, traceback)`. The child raises nothing to the parent: every exception becomes an answer,
so the parent can say which call failed and why, with the child's traceback. The child stops
when the parent closes its end (or dies): the serving loop ends on EOF.
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any

CLOSE = "close"  # the request that ends the serving loop


class EngineProcessError(RuntimeError):
    """The engine process failed a call (the message carries its traceback) or died."""


class EngineCallError(EngineProcessError):
    """The engine process answered a call with an exception; the process itself is alive."""

    def __init__(self, message: str, error_type: str) -> None:
        super().__init__(message)
        self.error_type = error_type


def serve(conn: Any, target: Any) -> None:
    """Answer `(method, args, kwargs)` requests with `target.method(*args, **kwargs)` until CLOSE or EOF."""
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            return
        try:
            method, args, kwargs = pickle.loads(request)
        except Exception as error:  # a request this side cannot read (a class it lacks): answer, live on
            conn.send(("error", type(error).__name__, f"cannot read the request: {error}", traceback.format_exc()))
            continue
        if method == CLOSE:
            conn.send(("ok", None))
            return
        try:
            answer: tuple = ("ok", getattr(target, method)(*args, **kwargs))
        except BaseException as error:  # the parent raises it, with this side's traceback
            answer = ("error", type(error).__name__, str(error), traceback.format_exc())
        try:
            conn.send(answer)
        except (BrokenPipeError, OSError):
            return


def call(conn: Any, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
    """Send one request and wait for its answer; `name` says which engine in error messages."""
    try:
        conn.send((method, args, kwargs))
        answer = conn.recv()
    except (EOFError, OSError) as error:
        raise EngineProcessError(f"rollout engine process {name} died during {method}") from error
    if answer[0] == "error":
        _, error_type, message, trace = answer
        raise EngineCallError(f"rollout engine {name} failed in {method}: {error_type}: {message}\n{trace}", error_type)
    return answer[1]
