"""Prefect tasks: small functions that call workers and storage.

Each task states its retry and cache policy where it is defined. Tasks pass references
and small records (run plan, step, paths, rollout shards), never models or optimizers.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

T = TypeVar("T")


def with_retries(task: T, retries: int, retry_delay_seconds: float) -> T:
    """`task.with_options(retries=..., retry_delay_seconds=...)`, built once per setting and reused.

    The retry counts come from the config (`generate_retries`, ...), so the flow asks for these
    variants at every step; building one runs Prefect's `Task.__init__`, which reads and hashes the
    function's source.
    """
    return _retry_variant(task, retries, float(retry_delay_seconds))


@functools.cache  # tasks hash by identity, and the cache keeps each one alive with its variants
def _retry_variant(task: Any, retries: int, retry_delay_seconds: float) -> Any:
    return task.with_options(retries=retries, retry_delay_seconds=retry_delay_seconds)
