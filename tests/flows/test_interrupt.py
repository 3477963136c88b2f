"""A served run's cancel (flows/interrupt.py run_until_cancelled): the runner's SIGTERM, which Prefect's
engine raises as TerminationSignal on the main thread, stops the run between steps, or at once when
the step under way outlasts the grace."""

import os
import signal
import threading
import time

import pytest
from prefect.exceptions import TerminationSignal
from prefect.utilities.engine import _prefect_sigterm_handler

from grpo_flow.flows import interrupt


@pytest.fixture
def prefect_sigterm():
    """Prefect's SIGTERM bridge, as a flow run's engine installs it; a SIGTERM to this process 0.5 s on.
    After the test, no stop is left asked for: a run started later in this process would stop at once."""
    previous = signal.signal(signal.SIGTERM, _prefect_sigterm_handler)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    yield
    timer.cancel()
    signal.signal(signal.SIGTERM, previous)
    interrupt.clear_stop()
    assert not interrupt.stop_requested() and interrupt.cancelled_by() is None


def a_step_of(seconds: float):
    """A run loop whose step under way takes `seconds` once a stop is asked for."""

    def run() -> str:
        while not interrupt.stop_requested():
            time.sleep(0.02)
        time.sleep(seconds)
        return "stopped between steps"

    return run


def test_a_cancel_stops_the_run_between_steps_and_records_why(prefect_sigterm):
    stopped_now = []
    result = interrupt.run_until_cancelled(
        a_step_of(0.2), lambda: "Cancelled by automation grpo-guard", stopped_now.append
    )
    assert result == "stopped between steps" and stopped_now == []
    summary = interrupt.interrupted_summary({}, "run", 3, 12)
    assert summary["status"] == "cancelled" and summary["cancelled_by"] == "Cancelled by automation grpo-guard"
    assert summary["interrupted_by"] == "SIGTERM" and summary["last_step"] == 3


def test_a_bare_sigterm_is_an_interruption(prefect_sigterm):
    assert interrupt.run_until_cancelled(a_step_of(0.0), lambda: None, lambda: None) == "stopped between steps"
    assert interrupt.interrupted_summary({}, "run", 1, 2)["status"] == "interrupted"


def test_a_step_that_outlasts_the_grace_is_stopped_at_once(prefect_sigterm):
    stopped_now = []
    with pytest.raises(TerminationSignal):
        interrupt.run_until_cancelled(a_step_of(5), lambda: "cancelled", lambda: stopped_now.append(1), grace_s=0.5)
    assert stopped_now == [1]
