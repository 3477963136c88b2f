"""Ctrl-C and SIGTERM for `grpo train`: stop at the end of the step under way, or at once.

    result = run_until_signalled(target, stop_at_once)   # target runs the grpo flow
    stop_requested()                                      # read by the grpo flow before each step

The flow runs on a thread of its own and the main thread waits and handles signals: Python runs
signal handlers on the main thread only, and Prefect replaces the SIGTERM handler of a flow run
that runs there. The first SIGINT or SIGTERM sets the stop flag; the `grpo` flow sees it before its
next step, records the run as `interrupted` (summary.json), releases its workers and ends as a
Cancelled flow run. If the step under way has not ended GRACE_S seconds after the signal, or a
second signal comes, `stop_at_once(signum)` runs instead: it records the run as interrupted from
what is on disk, ends the engine processes and the server, and exits the process. Both are safe:
a run survives being killed anywhere (staged files are discarded at resume, checkpoints are
verified), so stopping mid-step costs only the step's work.

A served run (a deployment run) is cancelled by its runner, from the UI, the CLI or an automation:
the runner sends SIGTERM and SIGKILLs the process 30 s later. Prefect's engine, which runs the flow
on the process's main thread, turns the SIGTERM into a TerminationSignal there, so
`run_until_cancelled` runs the body on a thread and the main thread waits: the signal asks the
loop to stop between steps, as Ctrl-C does, and the run is recorded as `cancelled` with the reason
the server gives; a step that has not ended CANCEL_GRACE_S later is stopped at once.
"""

from __future__ import annotations

import contextvars
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

# The graceful stop waits this long for the step under way; then the process stops at once, so a
# Ctrl-C ends it in seconds whatever the step is doing.
GRACE_S = 6.0
# Under the runner's 30 s between its SIGTERM and its SIGKILL (prefect/runner/runner.py `_kill_process`).
CANCEL_GRACE_S = 20.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)

_stop = threading.Event()
_signal: list[int] = []
_cancelled_by: list[str] = []  # a served run's: the reason its flow run was cancelled


def stop_requested() -> bool:
    return _stop.is_set()


def cancelled_by() -> str | None:
    return _cancelled_by[0] if _cancelled_by else None


def stop_signal_number() -> int | None:
    return _signal[0] if _signal else None


def stop_signal_name() -> str | None:
    return signal.Signals(_signal[0]).name if _signal else None


def exit_status(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number (130 for SIGINT)."""
    return 128 + signum


def resume_command(run_id: str, storage_root: Any) -> str:
    return f"grpo train --run-id {run_id} --resume --storage-root {storage_root}"


def run_until_signalled(
    target: Callable[[], Any], stop_at_once: Callable[[int], None], grace_s: float = GRACE_S
) -> Any:
    """`target()` on a thread, with SIGINT/SIGTERM handled as described above; returns what it
    returns or raises what it raised. `stop_at_once` must not return (it exits the process)."""
    outcome: dict[str, Any] = {}
    deadline: list[float] = []
    thread = _start(target, outcome)

    def on_signal(signum: int, frame: Any) -> None:
        if _stop.is_set():
            stop_at_once(signum)
        _signal[:] = [signum]
        _stop.set()
        deadline.append(time.monotonic() + grace_s)
        name = signal.Signals(signum).name
        print(
            f"\ngrpo train: {name}: stopping after the step under way (at most {grace_s:.0f} s); "
            "Ctrl-C again stops at once",
            file=sys.stderr,
            flush=True,
        )

    previous = {signum: signal.signal(signum, on_signal) for signum in SIGNALS}
    try:
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if deadline and time.monotonic() > deadline[0] and thread.is_alive():
                stop_at_once(_signal[0])
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return _outcome(outcome)


def run_until_cancelled(
    target: Callable[[], Any],
    reason: Callable[[], str | None],
    stop_now: Callable[[], None],
    grace_s: float = CANCEL_GRACE_S,
) -> Any:
    """A served run's `target()` on a thread, the runner's cancel handled as described above; returns
    what it returns or raises what it raised. `reason()` reads why the flow run is being cancelled
    (None: not cancelled, a bare SIGTERM); `stop_now()` records the run stopped mid-step."""
    from prefect.exceptions import TerminationSignal

    outcome: dict[str, Any] = {}
    done = threading.Event()
    thread = _start(target, outcome, done)
    thread.start()
    # Waited for on an Event: a signal handler that raises inside Thread.join marks the thread stopped
    # while it still runs (CPython's bpo-45274 handling in `_wait_for_tstate_lock`).
    try:
        while not done.wait(0.5):
            pass
    except TerminationSignal as termination:
        _signal[:] = [termination.signal]
        _cancelled_by[:] = [text] if (text := reason()) else []
        _stop.set()
        try:
            done.wait(grace_s)
        except TerminationSignal:  # the runner gave up waiting
            pass
        if not done.is_set():
            stop_now()
            raise
    return _outcome(outcome)


def clear_stop() -> None:
    """No stop asked for (a run that follows in this process runs)."""
    _stop.clear()
    _signal.clear()
    _cancelled_by.clear()


def _start(target: Callable[[], Any], outcome: dict[str, Any], done: threading.Event | None = None) -> threading.Thread:
    """A thread (not started) that runs `target()` in a copy of this context (Prefect's run context),
    its value or error put in `outcome`, then `done` set; the stop flag cleared."""
    clear_stop()

    def body() -> None:
        try:
            outcome["value"] = target()
        except BaseException as error:  # handed to the main thread, which raises it
            outcome["error"] = error
        finally:
            if done is not None:
                done.set()

    context = contextvars.copy_context()
    return threading.Thread(target=context.run, args=(body,), name="grpo-flow-run", daemon=True)


def _outcome(outcome: dict[str, Any]) -> Any:
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def interrupted_summary(previous: dict[str, Any] | None, run_id: str, last_step: int, total_steps: Any) -> dict:
    """What summary.json says of an interrupted run (`cancelled`, a served run whose flow run was
    cancelled): its last complete step and how to go on."""
    summary = {
        **(previous or {}),
        "run_id": run_id,
        "status": "cancelled" if _cancelled_by else "interrupted",
        "interrupted_by": stop_signal_name() or "KeyboardInterrupt",
        "last_step": last_step,
        "steps_completed": last_step,
        "total_steps": total_steps,
    }
    return summary | ({"cancelled_by": _cancelled_by[0]} if _cancelled_by else {})


def record_stopped_at_once(config: Any) -> None:
    """A run stopped in the middle of a step: recorded as interrupted (or cancelled) after its last
    logged step, from what is on disk, and its workers' processes ended."""
    from grpo_flow.workers import backends
    from grpo_flow.workers.state.storage import RunStorage

    storage = RunStorage.of(config)
    if storage.exists():
        previous = storage.read_summary()
        steps = storage.logged_steps()
        total = config.max_steps if config.max_steps > 0 else (previous or {}).get("total_steps")
        summary = interrupted_summary(previous, storage.run_id, steps[-1] if steps else 0, total)
        storage.write_summary({**summary, "stopped_at_once": True})
    backends.kill(storage.run_id)
