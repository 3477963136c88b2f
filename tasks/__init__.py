"""Prefect tasks: small functions that call workers and storage.

Each task states its retry and cache policy where it is defined. Tasks pass references
and small records (run plan, step, paths, rollout shards), never models or optimizers.
"""

from __future__ import annotations


import threading
from typing import Any, TypeVar

T = TypeVar("T")

_RETRY_VARIANTS: dict[tuple[int, int, float], Any] = {}
_RETRY_VARIANTS_LOCK = threading.Lock()


def with_retries(task: T, retries: int, retry_delay_seconds: float) -> T:
    """`task.with_options(retries=..., retry_delay_seconds=...)`, built once per setting and reused.

    The retry counts come from the config (`generate_retries`, ...), so the flow asks for these
    variants at every step; building one runs Prefect's `Task.__init__`, which reads and hashes the
    function's source (about 1 ms each, three per step).
    """
    key = (id(task), retries, float(retry_delay_seconds))
    with _RETRY_VARIANTS_LOCK:
        if key not in _RETRY_VARIANTS:
            _RETRY_VARIANTS[key] = (task, task.with_options(retries=retries, retry_delay_seconds=retry_delay_seconds))  # type: ignore[attr-defined]
        return _RETRY_VARIANTS[key][1]
