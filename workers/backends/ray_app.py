"""The workers as Ray actors: a few lines around each plain worker class.

`ActorWorker` wraps `workers.actor.actor.Actor`, `RolloutWorker` a rollout engine. They are
plain classes (nothing here imports Ray); workers/backends/ray_backend.py turns them into Ray
actors with `ray.remote(cls).options(num_cpus=..., num_gpus=..., max_restarts=-1,
scheduling_strategy=<a bundle of the run's placement group>)`.

Ray restarts a lost actor by running its constructor again, so a restarted worker holds the
initial model (policy version 0). Every call whose answer depends on the weights therefore
carries the policy version the caller expects, and a worker holding another one refuses it
(`StaleActorError`, `StaleEngineError`); the backend then heals the worker (restore and replay,
or load the published weights) and calls again.

Weights the actor publishes for the object store are its return value (`publish`): Ray keeps a
method's return value in the object store of the actor's node, owned by the caller, so it
outlives the actor process and every engine takes the same stored copy.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from schemas.config import GRPOFlowConfig
from workers.actor.actor import Actor, StaleActorError
from workers.backends.weight_sync import WeightPayload, apply_weights, export_weights
from workers.rollout.base import GenerationResult, SamplingParams

# Moved through Ray's object store (the state dict itself); the rest through files on the shared storage root.
OBJECT_STORE_METHODS = ("reload", "direct")


class StaleEngineError(RuntimeError):
    """The rollout engine holds a different policy version than the caller expects (e.g. it was restarted)."""


def where() -> dict[str, Any]:
    """Which process and node answer: the backend and the tests find a worker's process with it."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


def storage_visible(marker: str | None) -> bool:
    """Whether this node sees the file the driver wrote on the storage root (a shared filesystem)."""
    return marker is None or Path(marker).is_file()


class ActorWorker:
    """The actor in its own Ray actor process."""

    def __init__(self, config_json: str, model_path: str, device: str = "cpu") -> None:
        self.actor = Actor(GRPOFlowConfig.model_validate_json(config_json), model_path, device=device)
        self.actor.load()

    def ready(self, marker: str | None = None) -> dict[str, Any]:
        return {"policy_version": self.actor.policy_version, "storage_visible": storage_visible(marker), **where()}

    def _expect(self, version: int) -> None:
        if self.actor.policy_version != version:
            raise StaleActorError(f"actor holds policy version {self.actor.policy_version}, caller expects {version}")

    def step(self, expected_version: int, rollouts: Any) -> dict[str, float]:
        return self.actor.step(expected_version, rollouts)

    def publish(self, expected_version: int, method: str, run_dir: str) -> tuple[Any, dict[str, Any]]:
        """The weights for the engines (a state dict, or a `WeightPayload` naming files) and what was moved."""
        self._expect(expected_version)
        if method in OBJECT_STORE_METHODS:
            weights = self.actor.published_weights()
            return weights, {"method": method, "bytes": sum(t.numel() * t.element_size() for t in weights.values())}
        payload = export_weights(method, self.actor, run_dir)
        return payload, {"method": method, "bytes": payload.nbytes, "path": payload.path}

    def save_checkpoint(self, expected_version: int, folder: str) -> dict[str, Any]:
        self._expect(expected_version)
        return self.actor.save_checkpoint(Path(folder))

    def restore(self, folder: str) -> int:
        self.actor.restore(Path(folder))
        return self.actor.policy_version

    def reset(self) -> int:
        self.actor.reset()
        return self.actor.policy_version


def make_engine(model_path: str, worker_index: int, device: str) -> Any:
    from workers.rollout.transformers_engine import TransformersRolloutEngine

    return TransformersRolloutEngine(model_path, worker_id=f"rollout-{worker_index}", device=device)


class RolloutWorker:
    """Rollout engine `worker_index` in its own Ray actor process."""

    def __init__(self, model_path: str, worker_index: int, device: str = "cpu") -> None:
        self.model_path, self.worker_index, self.device = model_path, worker_index, device
        self.engine = make_engine(model_path, worker_index, device)
        self.engine.load()

    def ready(self, marker: str | None = None) -> dict[str, Any]:
        return {"policy_version": self.engine.policy_version, "storage_visible": storage_visible(marker), **where()}

    def initial(self) -> int:
        """The initial model (version 0): what a fresh or restarted worker holds, loaded again only if needed."""
        if self.engine.policy_version != 0 or self.engine.model_path != self.model_path:
            self.engine = make_engine(self.model_path, self.worker_index, self.device)
            self.engine.load()
        return self.engine.policy_version

    def generate(
        self, expected_version: int, prompts: list[Any], params: SamplingParams, max_prompt_length: int | None
    ) -> GenerationResult:
        """A GenerationResult; `extra` carries the worker id, the policy version and the decoded prompts."""
        if self.engine.policy_version != expected_version:
            raise StaleEngineError(
                f"{self.engine.worker_id} holds policy version {self.engine.policy_version}, caller expects "
                f"{expected_version}"
            )
        result = self.engine.generate(prompts, params, max_prompt_length)
        result.extra.update(
            worker_id=self.engine.worker_id,
            policy_version=self.engine.policy_version,
            prompt_texts=self.engine.tokenizer.batch_decode(result.prompt_token_ids),
        )
        return result

    def load_weights(self, weights: Any, version: int, adapter_config: Any = None) -> int:
        """What the actor published: a state dict (Ray resolves the object-store reference before this
        runs), or a `WeightPayload` naming files on the shared storage root."""
        if isinstance(weights, WeightPayload):
            apply_weights(self.engine, weights)
        else:
            self.engine.load_state_dict(weights, version, adapter_config)
        return self.engine.policy_version
