"""The artifact thread: in order, held back while paused, never overlapping a paused block."""

import threading
import time

from grpo_flow.tasks.observability import artifact_writes_allowed, artifact_writes_paused, flush_artifacts, publish


def test_published_calls_wait_while_paused_and_run_in_order_when_allowed():
    calls: list[str] = []
    with artifact_writes_paused():
        first = publish(calls.append, "a")
        second = publish(calls.append, "b")
        time.sleep(0.2)
        assert calls == [] and not first.done()
        with artifact_writes_allowed():  # a step body inside the paused loop
            second.result(timeout=5)
        assert calls == ["a", "b"]
        third = publish(calls.append, "c")
        time.sleep(0.1)
        assert not third.done()  # paused again once the body is over
    third.result(timeout=5)  # the loop's block is over: writes go on
    assert calls == ["a", "b", "c"]


def test_pausing_waits_for_a_call_under_way_so_none_overlaps_the_paused_block():
    started, release = threading.Event(), threading.Event()
    events: list[str] = []

    def slow_write() -> None:
        started.set()
        release.wait(5)
        time.sleep(0.05)
        events.append("write finished")

    publish(slow_write)
    assert started.wait(5)
    threading.Timer(0.1, release.set).start()
    with artifact_writes_paused():
        events.append("paused block")
    assert events == ["write finished", "paused block"]


def test_flush_writes_everything_even_from_inside_a_paused_block():
    calls: list[int] = []
    with artifact_writes_paused():
        for value in range(3):
            publish(calls.append, value)
        flush_artifacts(timeout=5)
        assert calls == [0, 1, 2]
