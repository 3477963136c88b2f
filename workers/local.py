"""The embedded backend: the actor and the rollout engines live in this process.

Workers are caches of the run's state, keyed by run id; `release` drops them at the end.
The Modal backend (a later release) provides the same methods on remote classes.
"""

from __future__ import annotations

import threading
from pathlib import Path

from schemas.config import GRPOFlowConfig
from workers.actor import Actor
from workers.rollout import TransformersRolloutEngine

_LOCK = threading.Lock()
_WORKERS: dict[str, LocalWorkers] = {}


class LocalWorkers:
    def __init__(self, config: GRPOFlowConfig, model_path: str | Path):
        self.actor = Actor(config, model_path)
        self.rollout = [
            TransformersRolloutEngine(model_path, worker_id=f"rollout-{i}") for i in range(config.num_rollout_workers)
        ]
        self.actor.load()
        for engine in self.rollout:
            engine.load()

    def sync_weights(self) -> int:
        """Copy the actor's weights into every rollout engine (in memory); returns the version synced."""
        weights = self.actor.policy_state_dict()
        for engine in self.rollout:
            engine.load_state_dict(weights, self.actor.policy_version)
        return self.actor.policy_version


def local_workers(config: GRPOFlowConfig, model_path: str | Path) -> LocalWorkers:
    """The run's workers, created on first use."""
    assert config.run_id is not None
    with _LOCK:
        if config.run_id not in _WORKERS:
            _WORKERS[config.run_id] = LocalWorkers(config, model_path)
        return _WORKERS[config.run_id]


def release(run_id: str) -> None:
    with _LOCK:
        _WORKERS.pop(run_id, None)
