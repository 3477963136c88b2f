"""Each run's workers in this process: built on first use, closed when the run releases them.

One registry per backend (local, Modal, Ray); the flow's tasks reach the same workers from any
thread, so a run's workers are built once, under the registry's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

Workers = TypeVar("Workers")


class RunWorkers(Generic[Workers]):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_run: dict[str, Workers] = {}

    def get(self, run_id: str, build: Callable[[], Workers]) -> Workers:
        """The run's workers; `build()` makes them the first time."""
        with self._lock:
            if run_id not in self._by_run:
                self._by_run[run_id] = build()
            return self._by_run[run_id]

    def peek(self, run_id: str) -> Workers | None:
        """The run's workers if they were built, without building them."""
        return self._by_run.get(run_id)

    def release(self, run_id: str) -> None:
        """Forget the run's workers and close them (their engines, containers, Ray actors)."""
        with self._lock:
            workers = self._by_run.pop(run_id, None)
        close_workers(workers)

    def release_all(self) -> None:
        with self._lock:
            left = list(self._by_run.values())
            self._by_run.clear()
        for workers in left:
            close_workers(workers)


def close_workers(workers: object) -> None:
    close = getattr(workers, "close", None)  # instant benchmark workers have nothing to close
    if close is not None:
        close()
