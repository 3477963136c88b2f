"""One turn's tool calls; whatever goes wrong becomes the tool's message.

    results = run_tool_calls(requests, timeout_s=None, sandbox=True)   # one ToolResult per request

A call gives TRL's tool message content: the tool's text, or, for anything else it returns,
`str(result)` (as TRL does); a failure gives `str({"error": message})`, TRL's form, and counts as a
failure (TRL's tools/failure_frequency): an unknown tool, a call that is not a function call, arguments
that are not an object or that the function refuses, an exception, or a call past `timeout_s`.

Where a call runs: a tool given as a `module:function` path runs, with `sandbox`, in the local sandbox
(workers/rewards/sandbox.py: a fresh isolated process per call, no network, a read-only file system,
killed at `timeout_s`, or at the sandbox's own limit), because tool code, like reward code, is
untrusted; it cannot keep state between calls, which TRL's plain tools do not either. A tool given as
a Python object (the Python API's lambdas and closures), a path tool without `sandbox`, and every
environment method are called here, as TRL calls them, with no limit (an environment may hold a socket,
a browser, a subprocess). With `timeout_s` they run in a long-lived process instead
(workers/rewards/deadline.py: a plain tool sent to its own once, methods to another), killed at the
timeout whatever the call is doing; the next call starts a fresh one. There an environment's method
travels with each call, its instance with it, and the instance's attributes come back, so its state
must pickle.

Only the standard library is imported at module level: the sandbox imports this module to run a tool.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

RESULT_MARKER = "\x1egrpo-flow-tool-result\x1e"  # the sandboxed program's answer follows it on stdout


@dataclass(frozen=True)
class ToolRequest:
    """One parsed tool call (TRL's form: {"type": "function", "function": {"name", "arguments"}}) and the
    tools the calling rollout has, by name."""

    call: Mapping[str, Any]
    tools: Mapping[str, Any]  # name -> toolbox.Tool


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str
    failed: bool = False


def error_content(message: str) -> str:
    """TRL's tool message for a failed call: `str({"error": str(exception)})`."""
    return str({"error": message})


def tool_content(result: Any) -> str:
    """A tool's return value as a tool message: text as it is; TRL's multimodal content blocks as their
    text (grpo-flow's episodes are text only); anything else as `str(result)`, as TRL does."""
    if isinstance(result, str):
        return result
    if isinstance(result, list) and result and all(isinstance(part, dict) and "type" in part for part in result):
        if any(part["type"] != "text" for part in result):
            kinds = sorted({str(part["type"]) for part in result})
            raise TypeError(f"the tool returned content blocks of types {kinds}; grpo-flow takes text only")
        return "".join(str(part.get("text", "")) for part in result)
    return str(result)


def call_target(request: ToolRequest) -> tuple[str, Any, dict[str, Any] | None, str | None]:
    """(name, tool or None, arguments, error): what a request asks for, or why it cannot be called."""
    call = request.call
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(call, Mapping) or call.get("type", "function") != "function" or not isinstance(function, Mapping):
        kind = call.get("type") if isinstance(call, Mapping) else type(call).__name__
        return (
            str((call.get("name") if isinstance(call, Mapping) else None) or "unknown"),
            None,
            None,
            (f"Unsupported tool call type: {kind}"),
        )
    name = str(function.get("name"))
    tool = request.tools.get(name)
    if tool is None:
        return name, None, None, f"Tool {name} not found."
    arguments = function.get("arguments")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):  # a template whose parser leaves the JSON as text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return name, tool, None, f"the arguments of {name} are not JSON: {arguments[:200]!r}"
    if not isinstance(arguments, Mapping):
        return name, tool, None, f"the arguments of {name} must be an object of named arguments, got {arguments!r}"
    return name, tool, dict(arguments), None


def run_tool_calls(requests: Sequence[ToolRequest], timeout_s: float | None, sandbox: bool = True) -> list[ToolResult]:
    """Every request's result, in order: sandboxed ones together (a few processes at a time), then the
    ones that run in this process, one after another."""
    results: list[ToolResult | None] = [None] * len(requests)
    sandboxed: list[tuple[int, str, str, dict[str, Any]]] = []
    for index, request in enumerate(requests):
        name, tool, arguments, error = call_target(request)
        if error is not None or tool is None or arguments is None:
            results[index] = ToolResult(name, error_content(error or f"Tool {name} not found."), failed=True)
        elif sandbox and getattr(tool, "path", None):
            sandboxed.append((index, name, tool.path, arguments))
        else:
            results[index] = (
                call_here(name, tool.func, arguments)
                if timeout_s is None
                else call_in_process(name, tool.func, arguments, timeout_s)
            )
    if sandboxed:
        answers = call_in_sandbox([(path, arguments) for _, _, path, arguments in sandboxed], timeout_s)
        for (index, name, _, _), answer in zip(sandboxed, answers, strict=True):
            results[index] = ToolResult(name, answer[0], failed=answer[1])
    return [result for result in results if result is not None]


def call_here(name: str, func: Callable[..., Any], arguments: dict[str, Any]) -> ToolResult:
    """`func(**arguments)` (awaited if async) in this process, as TRL calls a tool."""
    try:
        return ToolResult(name, tool_message(func, **arguments)[0])
    except Exception as error:
        return ToolResult(name, error_content(str(error) or type(error).__name__), failed=True)


# -- in a process of their own ---------------------------------------------------------------------
def call_in_process(name: str, func: Callable[..., Any], arguments: dict[str, Any], timeout_s: float) -> ToolResult:
    """`func(**arguments)` (awaited if async) in a process of its own (workers/rewards/deadline.py), at most
    `timeout_s` seconds. A plain tool is sent to its process once; an environment's method travels with
    each call, its instance with it, and the instance's attributes come back: its state for the episode."""
    from grpo_flow.workers.rewards.deadline import DeadlineExceeded, Unsendable, user_code

    method = inspect.ismethod(func)
    held = [] if method else [functools.partial(tool_message, func)]
    try:
        worker = user_code(held, key=("tool", None if method else func))  # the function, kept: not its id
        if not method:
            return ToolResult(name, worker.call(0, timeout_s, **arguments)[0])
        content, state = worker.call(tool_message, timeout_s, func, **arguments)
    except DeadlineExceeded:
        return ToolResult(name, error_content(f"Tool {name} did not return within {timeout_s:g} s"), failed=True)
    except Unsendable as refused:
        message = f"Tool {name} cannot be sent to the process that runs it: {refused.reason}"
        return ToolResult(name, error_content(message), failed=True)
    except Exception as error:
        return ToolResult(name, error_content(str(error) or type(error).__name__), failed=True)
    if state is not None:
        attributes: dict[str, Any] = func.__self__.__dict__  # type: ignore[attr-defined]
        attributes.clear()
        attributes.update(state)
    return ToolResult(name, content)


def tool_message(func: Callable[..., Any], /, **arguments: Any) -> tuple[str, dict[str, Any] | None]:
    """The tool message of `func(**arguments)`, awaited, and the attributes of its instance (a method's)."""
    value = func(**arguments)
    if inspect.isawaitable(value):
        from grpo_flow.workers.rewards.deadline import run_coroutine

        value = run_coroutine(value)
    instance = func.__self__ if inspect.ismethod(func) else None
    return tool_content(value), getattr(instance, "__dict__", None)


# -- in the sandbox --------------------------------------------------------------------------------
# The program each sandboxed call runs: the parent's import path, the tool imported by its path, one
# call, its content (or the error) printed after RESULT_MARKER as JSON.
SANDBOX_PROGRAM = """\
import asyncio, importlib, inspect, json, sys
sys.path[:0] = {paths!r}
request = json.loads(sys.stdin.read())
from grpo_flow.workers.tools.calls import RESULT_MARKER, tool_content
module, _, name = request["path"].partition(":")
try:
    value = getattr(importlib.import_module(module), name)(**request["arguments"])
    if inspect.isawaitable(value):
        value = asyncio.run(value)
    answer = {{"content": tool_content(value)}}
except Exception as error:
    answer = {{"error": str(error) or type(error).__name__}}
sys.stdout.write(RESULT_MARKER + json.dumps(answer))
"""


def call_in_sandbox(calls: Sequence[tuple[str, dict[str, Any]]], timeout_s: float | None) -> list[tuple[str, bool]]:
    """(content, failed) for each (path, arguments), each call a sandboxed program of its own, killed at
    `timeout_s` (None: the sandbox's own limit)."""
    from grpo_flow.workers.rewards.deadline import import_paths
    from grpo_flow.workers.rewards.sandbox import LocalSandbox, SandboxLimits
    from grpo_flow.workers.state.source import package_files

    paths = import_paths()
    # What the program imports from stays visible, read-only, where the sandbox hides the home and temp
    # dirs: this process's import path (the working dir a tool module was found in, included) and
    # grpo_flow's own files, which an editable install does not put on the import path.
    visible = [*paths, *map(str, package_files(["schemas", "workers"]).values())]
    limits = SandboxLimits() if timeout_s is None else SandboxLimits(timeout_s=timeout_s, cpu_s=max(1.0, timeout_s))
    sandbox = LocalSandbox(limits, visible_paths=visible)
    program = SANDBOX_PROGRAM.format(paths=paths)
    stdins = [json.dumps({"path": path, "arguments": arguments}) for path, arguments in calls]  # parsed from JSON
    runs = sandbox.run_batch([program] * len(calls), stdins=stdins)
    answers = []
    for (path, _), run in zip(calls, runs, strict=True):
        name = path.rpartition(":")[2]
        if run.timed_out:
            answers.append((error_content(f"Tool {name} did not return within {limits.timeout_s:g} s"), True))
            continue
        head, marker, body = run.stdout.rpartition(RESULT_MARKER)
        if not marker:
            last = (run.stderr.strip().splitlines() or [f"exit status {run.exit_code} ({run.signal})"])[-1]
            answers.append((error_content(f"Tool {name} failed in the sandbox: {last}"), True))
            continue
        answer = json.loads(body)
        if "error" in answer:
            answers.append((error_content(answer["error"]), True))
        else:
            answers.append((answer["content"], False))
    return answers
