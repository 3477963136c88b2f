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
SIGNALS = (signal.SIGINT, signal.SIGTERM)

_stop = threading.Event()
_signal: list[int] = []


def stop_requested() -> bool:
    return _stop.is_set()


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
    _stop.clear()
    _signal.clear()

    def body() -> None:
        try:
            outcome["value"] = target()
        except BaseException as error:  # handed to the main thread, which raises it
            outcome["error"] = error

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

    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(body,), name="grpo-flow-run", daemon=True)
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
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def interrupted_summary(previous: dict[str, Any] | None, run_id: str, last_step: int, total_steps: Any) -> dict:
    """What summary.json says of an interrupted run: its last complete step and how to go on."""
    return {
        **(previous or {}),
        "run_id": run_id,
        "status": "interrupted",
        "interrupted_by": stop_signal_name() or "KeyboardInterrupt",
        "last_step": last_step,
        "steps_completed": last_step,
        "total_steps": total_steps,
    }
