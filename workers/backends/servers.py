"""The two workers as every backend runs them: plain classes with one set of verbs.

    ActorServer(config_json, model_path, device, storage_root)
        ready(marker) · step(expected_version, rollouts) · save_checkpoint(expected_version, step, extra, files)
        restore(folder | None) · publish(expected_version, method)
    RolloutServer(config_json, model_path, worker_index, device, storage_root)
        ready(marker) · initial() · generate(expected_version, prompts, params, max_prompt_length)
        load_weights(weights, version, adapter_config) · shutdown()

The local backend calls them in this process, `modal_app` decorates them for Modal containers,
`ray_backend` passes them to `ray.remote`. Folders are relative to the storage root, which each
worker knows as it sees it (a Modal container mounts the run Volume elsewhere).

A worker that was restarted (a new container, a Ray actor restarted after its process died) holds
the initial model, so every verb whose answer depends on the weights carries the policy version the
caller expects, and a worker holding another one refuses it (`StaleActorError`, `StaleEngineError`):
`workers.backends.workers.Workers` then heals it and calls again.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Protocol

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.actor.actor import Actor, StaleActorError
from grpo_flow.workers.actor.sharded import ActorGroup
from grpo_flow.workers.backends.weight_sync import WeightPayload, apply_weights, export_weights
from grpo_flow.workers.rollout.base import GenerationResult, RolloutEngine, SamplingParams
from grpo_flow.workers.rollout.channel import EngineProcessError
from grpo_flow.workers.state.location import local_root, use_storage_options
from grpo_flow.workers.state.storage import RunStorage

# `publish`'s method for weights handed over as a state dict (in memory, or through Ray's object store)
# rather than by one of weight_sync's file or bytes methods.
STATE_DICT = "state_dict"


class StaleEngineError(RuntimeError):
    """The rollout engine holds another policy version than the caller expects (it was restarted, or its
    process died)."""


class SharedStorage(Protocol):
    """A storage root other workers see only after a commit (a Modal Volume): committed after each write,
    reloaded before each read of another worker's files."""

    def commit(self) -> None: ...

    def reload(self) -> None: ...


class LocalDisk:
    """A storage root every worker sees as soon as it is written (a local or network filesystem)."""

    def commit(self) -> None:
        pass

    def reload(self) -> None:
        pass


def where(marker: str | None) -> dict[str, Any]:
    """Which process and node answer, and whether the node sees the file the caller wrote on the storage
    root (it must be shared by every node that runs a worker)."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "storage_visible": marker is None or Path(marker).is_file(),
    }


class ActorServer:
    """The actor (policy, optimizer, TRL's objective) where a backend runs it."""

    def __init__(
        self,
        config_json: str,
        model_path: str,
        device: str = "cpu",
        storage_root: str | None = None,
        storage: SharedStorage | None = None,
    ) -> None:
        self.config = GRPOFlowConfig.model_validate_json(config_json)
        self.root = local_root(storage_root or self.config.storage_root)
        use_storage_options(storage_root or self.config.storage_root, self.config.storage_options)
        self.run_storage = RunStorage(storage_root or self.config.storage_root, self.config.run_id or "unnamed")
        self.storage = storage or LocalDisk()
        self.storage.reload()  # the model may have been uploaded by another worker
        self.run_dir = self.root / "runs" / (self.config.run_id or "unnamed")
        self.actor: Actor | ActorGroup = (
            Actor(self.config, model_path, device=device)
            if self.config.actor_num_processes == 1
            else ActorGroup(self.config, model_path, device=device)  # rank 0 answers the verbs below
        )
        self.actor.load()

    def ready(self, marker: str | None = None) -> dict[str, Any]:
        return {"policy_version": self.actor.policy_version, **where(marker)}

    def close(self) -> None:
        """End the actor's rank processes (actor_num_processes > 1), each leaving the process group first."""
        if isinstance(self.actor, ActorGroup):
            self.actor.close()

    def _expect(self, version: int) -> None:
        if self.actor.policy_version != version:
            raise StaleActorError(f"actor holds policy version {self.actor.policy_version}, caller expects {version}")

    def step(self, expected_version: int, rollouts: Any) -> dict[str, float]:
        """One optimizer step on a step's logged rollouts; a retry of a step it took is answered, not re-run."""
        return self.actor.step(expected_version, rollouts)

    def save_checkpoint(
        self, expected_version: int, step: int, extra: dict[str, Any], files: dict[str, bytes] | None = None
    ) -> dict[str, Any]:
        """Checkpoint `step` (weights, optimizer, scheduler and RNG states, and `files` from the caller)
        written and committed at its final place under the storage root as this worker sees it, the
        manifest carrying `extra`; then the root is committed (a Modal Volume). Returns the manifest and
        the folder relative to the root."""
        self._expect(expected_version)

        def write(folder: Path) -> dict[str, Any]:
            for name, data in (files or {}).items():
                (folder / name).write_bytes(data)
            return {**self.actor.save_checkpoint(folder), **extra}

        manifest = self.run_storage.write_checkpoint(step, write)
        self.storage.commit()
        folder = self.run_storage.checkpoint_dir(step)
        return {"manifest": manifest, "folder": f"runs/{self.run_storage.run_id}/checkpoints/{folder.name}"}

    def restore(self, folder: str | None) -> int:
        """Back to the checkpoint in `folder` (under the storage root), or to the initial model (None)."""
        if folder is None:
            self.actor.reset()
        else:
            self.storage.reload()  # the checkpoint may have been written by an earlier worker
            self.actor.restore(self.checkpoint_folder(folder))
        return self.actor.policy_version

    def checkpoint_folder(self, folder: str) -> Path:
        """A checkpoint (`runs/<id>/checkpoints/step-N`) as a folder torch reads here: on an object store,
        downloaded on this worker's machine (a Ray node that shares no disk with the flow's)."""
        path = Path(folder)
        if self.run_storage.remote and path.parent == Path("runs", self.run_storage.run_id, "checkpoints"):
            return self.run_storage.local_checkpoint(int(path.name.split("-")[1]))
        return self.root / folder

    def publish(self, expected_version: int, method: str) -> tuple[Any, dict[str, Any]]:
        """The weights for the engines and what was moved: a state dict (`STATE_DICT`), or a
        `WeightPayload` of weight_sync's `method` (files under the run folder, or bytes)."""
        self._expect(expected_version)
        if method == STATE_DICT:
            weights = self.actor.published_weights()
            return weights, {"method": method, "bytes": sum(t.numel() * t.element_size() for t in weights.values())}
        payload = export_weights(method, self.actor, self.run_dir)
        if payload.path is not None:
            self.storage.commit()
        return payload, {"method": method, "bytes": payload.nbytes, "path": payload.path}


def default_engine(config: GRPOFlowConfig, model_path: str, worker_index: int, device: str, root: Path) -> Any:
    """Rollout worker `worker_index`'s engine in a worker process of its own (Ray, Modal): transformers on
    `device`, or vLLM (in this process where importable, else a process of the vLLM environment)."""
    if config.rollout_engine == "vllm":
        from grpo_flow.workers.backends import vllm_env

        log_dir = RunStorage(root, config.run_id or "unnamed").local_run_dir / "logs"
        threads = max(1, int(config.ray_rollout_cpus or 1))  # a share of a CPU: one thread
        return vllm_env.worker_engine(config, model_path, worker_index, device == "cuda", threads, log_dir)
    from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine

    return TransformersRolloutEngine(model_path, worker_id=f"rollout-{worker_index}", device=device)


class RolloutServer:
    """A rollout engine where a backend runs it."""

    def __init__(
        self,
        config_json: str,
        model_path: str,
        worker_index: int = 0,
        device: str = "cpu",
        storage_root: str | None = None,
        storage: SharedStorage | None = None,
        engine: RolloutEngine | None = None,
    ) -> None:
        """`engine`: one the backend built itself (the local backend's engine processes); else `default_engine`."""
        self.config = GRPOFlowConfig.model_validate_json(config_json)
        self.model_path, self.worker_index, self.device = model_path, worker_index, device
        self.root = local_root(storage_root or self.config.storage_root)
        self.storage = storage or LocalDisk()
        self.storage.reload()
        self.engine: RolloutEngine = engine or default_engine(self.config, model_path, worker_index, device, self.root)
        self.engine.load()

    def held_version(self) -> int | None:
        """The policy version the engine holds; None when it is not loaded (its process died)."""
        return None if self.engine.model is None else self.engine.policy_version

    def ready(self, marker: str | None = None) -> dict[str, Any]:
        return {
            "policy_version": self.held_version(),
            "engine": type(self.engine).__name__,
            "engine_pid": getattr(self.engine, "pid", None),  # an engine in a process of its own
            **where(marker),
        }

    def initial(self) -> int:
        """The initial model (version 0): what a new worker holds. A dead engine process starts again."""
        if self.held_version() != 0:
            self.engine.load()
        return self.engine.policy_version

    def _expect(self, version: int) -> None:
        if self.held_version() != version:
            raise StaleEngineError(
                f"{self.engine.worker_id} holds policy version {self.held_version()} (None: not loaded, or its "
                f"process died), caller expects {version}"
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

    def load_weights(self, weights: Any, version: int, adapter_config: Any = None) -> dict[str, Any]:
        """What the actor published: a state dict, or a `WeightPayload` naming files (or carrying bytes).
        A version the engine holds already is not loaded again (a retried sync)."""
        if self.held_version() == version:
            return {"version": version, "skipped": True}
        try:
            if self.held_version() is None:
                raise EngineProcessError(f"{self.engine.worker_id}: the engine is not running")
            if isinstance(weights, WeightPayload):
                if weights.path is not None:
                    self.storage.reload()  # the actor's commit
                return {**apply_weights(self.engine, weights), "version": version}
            self.engine.load_state_dict(weights, version, adapter_config)
        except EngineProcessError as error:
            raise StaleEngineError(f"{self.engine.worker_id}: {error}") from error
        return {"version": version}

    def shutdown(self) -> None:
        """End the engine (a vLLM engine's process gives its memory back) before the worker goes."""
        self.engine.close()
