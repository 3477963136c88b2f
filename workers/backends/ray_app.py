"""The workers as Ray actors: a few lines around each plain worker class.

`ActorWorker` wraps `grpo_flow.workers.actor.actor.Actor`, `RolloutWorker` a rollout engine. They are
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

With rollout_engine='vllm' the engine is `vllm_env.worker_engine`'s (as on Modal): vLLM in this
process where the Ray workers' Python imports it, else a child process of `vllm_python` on this
node, which inherits the GPUs Ray gave this actor (CUDA_VISIBLE_DEVICES) and ends itself when this
process dies (it watches its parent). A dead child reads as a stale engine, so the backend heals it
as it heals a restarted actor: `initial` starts a new one, then the published weights are loaded.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.actor.actor import Actor, StaleActorError
from grpo_flow.workers.backends.weight_sync import WeightPayload, apply_weights, export_weights
from grpo_flow.workers.rollout.base import GenerationResult, SamplingParams
from grpo_flow.workers.rollout.channel import EngineProcessError
from grpo_flow.workers.state.storage import RunStorage

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


def make_engine(config: GRPOFlowConfig, model_path: str, worker_index: int, device: str) -> Any:
    """Rollout worker `worker_index`'s engine: transformers on `device`, or vLLM (its log in the run's
    `logs/` folder on the storage root, as on the local backend; its threads the CPUs Ray reserved)."""
    if config.rollout_engine == "vllm":
        from grpo_flow.workers.backends import vllm_env

        log_dir = RunStorage(config.storage_root, config.run_id or "unnamed").run_dir / "logs"
        threads = max(1, int(config.rollout_cpus))
        return vllm_env.worker_engine(config, model_path, worker_index, device == "cuda", threads, log_dir)
    from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine

    return TransformersRolloutEngine(model_path, worker_id=f"rollout-{worker_index}", device=device)


def close_engine(engine: Any) -> None:
    close = getattr(engine, "close", None)  # a vLLM engine ends its process; the transformers engine has none
    if close is not None:
        close()


class RolloutWorker:
    """Rollout engine `worker_index` in its own Ray actor process."""

    def __init__(self, config_json: str, model_path: str, worker_index: int, device: str = "cpu") -> None:
        self.config = GRPOFlowConfig.model_validate_json(config_json)
        self.model_path, self.worker_index, self.device = model_path, worker_index, device
        self.engine = make_engine(self.config, model_path, worker_index, device)
        self.engine.load()

    def held_version(self) -> int | None:
        """The policy version the engine holds; None when its process died (a vLLM engine's child)."""
        return None if self.engine.model is None else self.engine.policy_version

    def ready(self, marker: str | None = None) -> dict[str, Any]:
        return {
            "policy_version": self.held_version(),
            "storage_visible": storage_visible(marker),
            "engine": type(self.engine).__name__,
            "engine_pid": getattr(self.engine, "pid", None),  # a vLLM engine's own process, if it has one
            **where(),
        }

    def initial(self) -> int:
        """The initial model (version 0): what a fresh or restarted worker holds, loaded again only if needed."""
        if self.config.rollout_engine == "vllm":
            self.engine.load()  # starts a dead engine process again, or puts the initial weights back in place
        elif self.engine.policy_version != 0 or self.engine.model_path != self.model_path:
            self.engine = make_engine(self.config, self.model_path, self.worker_index, self.device)
            self.engine.load()
        return self.engine.policy_version

    def _expect(self, version: int) -> None:
        if self.held_version() != version:
            raise StaleEngineError(
                f"{self.engine.worker_id} holds policy version {self.held_version()} (None: its engine process "
                f"died), caller expects {version}"
            )

    def generate(
        self, expected_version: int, prompts: list[Any], params: SamplingParams, max_prompt_length: int | None
    ) -> GenerationResult:
        """A GenerationResult; `extra` carries the worker id, the policy version and the decoded prompts."""
        self._expect(expected_version)
        try:
            result = self.engine.generate(prompts, params, max_prompt_length)
        except EngineProcessError as error:  # the engine's process died under the call: heal it, call again
            raise StaleEngineError(f"{self.engine.worker_id}: {error}") from error
        result.extra.update(
            worker_id=self.engine.worker_id,
            policy_version=self.engine.policy_version,
            prompt_texts=self.engine.tokenizer.batch_decode(result.prompt_token_ids),
        )
        return result

    def load_weights(self, weights: Any, version: int, adapter_config: Any = None) -> int:
        """What the actor published: a state dict (Ray resolves the object-store reference before this
        runs), or a `WeightPayload` naming files on the shared storage root."""
        try:
            if self.held_version() is None:
                raise EngineProcessError(f"{self.engine.worker_id}: the engine process is not running")
            if isinstance(weights, WeightPayload):
                apply_weights(self.engine, weights)
            else:
                self.engine.load_state_dict(weights, version, adapter_config)
        except EngineProcessError as error:
            raise StaleEngineError(f"{self.engine.worker_id}: {error}") from error
        return self.engine.policy_version

    def shutdown(self) -> None:
        """End the engine (a vLLM engine's process gives its GPU memory back) before Ray ends this actor."""
        close_engine(self.engine)
