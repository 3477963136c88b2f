"""The embedded backend: the actor lives in this process, the rollout engines here or in child processes.

Engines: transformers in this process (on-policy), or each in a child process of this
interpreter (one-step-off pipelining); with rollout_engine='vllm', each a vLLM engine in a
process of the vLLM environment (`vllm_env.local_engine`), synced by the run's
weight_sync_method through `weight_sync` (the same code the Modal backend uses).

Workers are caches of the run's state, keyed by run id; `release` drops them at the end.
They heal themselves: an actor asked for a policy version it does not hold restores the
newest checkpoint before it and replays the logged rollouts since; a rollout engine asked
for a version it does not hold loads it. So a replaced or restarted worker costs time, never
correctness. The Modal backend provides the same methods on remote classes. The Ray backend
(workers/backends/ray_backend.py) subclasses `LocalWorkers`: the same sync, resume and healing
logic over Ray actor handles, with its own answers to how published weights are held and moved
(the `_publish`, `_load_all`, `_moved_bytes`, `_keep_rollout_weights`, `_rollout_weights_from` hooks),
and its own `sync_weights`: its actor exports by weight_sync_method in its own process, for vLLM
engines too.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.backends.registry import RunWorkers
from grpo_flow.workers.actor import trl_objective
from grpo_flow.workers.actor.actor import Actor
from grpo_flow.workers.backends import vllm_env, weight_sync
from grpo_flow.workers.rollout.process_engine import ProcessRolloutEngine
from grpo_flow.workers.state.resume import replay_actor_to
from grpo_flow.workers.rollout.transformers_engine import GENERATION_LOCK, TransformersRolloutEngine
from grpo_flow.workers.state.storage import RunStorage

ROLLOUT_WEIGHTS = "rollout_model.safetensors"  # in a checkpoint, when the rollout workers lag the actor
logger = logging.getLogger("grpo_flow.workers")

_WORKERS: RunWorkers[LocalWorkers] = RunWorkers()


class LocalWorkers:
    def __init__(self, config: GRPOFlowConfig, model_path: str | Path):
        self.config = config
        self.model_path = str(model_path)
        self.actor = Actor(config, model_path)
        self.rollout: list[Any]
        self.uses_vllm = config.rollout_engine == "vllm"
        if self.uses_vllm:
            # Each engine in its own process of the vLLM environment; on CPU the cores are shared out
            # between the engines (they generate their shards at once), and the actor when pipelined.
            threads = max(1, (os.cpu_count() or 2) // (config.num_rollout_workers + (1 if config.max_staleness else 0)))
            if config.max_staleness:
                torch.set_num_threads(threads)
            log_dir = RunStorage(config.storage_root, config.run_id or "unnamed").run_dir / "logs"
            self.rollout = [
                vllm_env.local_engine(config, model_path, i, threads, log_dir)
                for i in range(config.num_rollout_workers)
            ]
        elif config.max_staleness:
            # One-step-off pipelining: each rollout engine in its own process, so generating the next
            # step really overlaps the actor's step; the cores are shared out between them.
            threads = max(1, (os.cpu_count() or 2) // (config.num_rollout_workers + 1))
            torch.set_num_threads(threads)
            self.rollout = [
                ProcessRolloutEngine(model_path, worker_id=f"rollout-{i}", threads=threads)
                for i in range(config.num_rollout_workers)
            ]
        else:
            self.rollout = [
                TransformersRolloutEngine(model_path, worker_id=f"rollout-{i}")
                for i in range(config.num_rollout_workers)
            ]
        # The weights last published to the rollout workers, so a replaced worker can take them.
        self.published: tuple[int, dict[str, torch.Tensor]] | None = None
        # Shards heal on worker threads, one at a time, and never beside an in-process generation: healing
        # loads models and restores RNG states, and a generation on another shard's thread draws its
        # samples from that same global RNG (a test of replaced workers ended 1e-4 away from the unbroken
        # run's weights in 1 of 4 runs before). Reentrant, since a Ray engine whose published weights were
        # lost heals the actor while it holds the lock (ray_backend.RayWorkers._load).
        self._heal_lock = GENERATION_LOCK
        self.actor.load()
        try:
            if self.uses_vllm:  # separate processes: their starts (imports, engine build) overlap
                with ThreadPoolExecutor(max_workers=len(self.rollout)) as pool:
                    list(pool.map(lambda engine: engine.load(), self.rollout))
            else:
                for engine in self.rollout:
                    engine.load()
        except BaseException:
            self.close()  # no engine process outlives a failed start
            raise
        # With use_lora and lora_publish='adapter' (or a vLLM run's 'lora' sync), engines take the adapter
        # alone over their base model.
        adapters = config.use_lora and (
            config.lora_publish == "adapter" or (self.uses_vllm and config.weight_sync_method == "lora")
        )
        self.adapter_config = trl_objective.lora_config(config) if adapters else None
        self.last_sync: dict[str, float] = {}

    def close(self) -> None:
        """End the engines' processes (the in-process engines have none)."""
        for engine in self.rollout:
            if hasattr(engine, "close"):
                engine.close()

    def published_weights(self) -> dict[str, torch.Tensor]:
        """What the engines take: the adapter alone when they generate with adapters, else the full weights."""
        return self.actor.adapter_state_dict() if self.adapter_config is not None else self.actor.policy_state_dict()

    def _load(self, engine: Any, weights: Any, version: int) -> None:
        engine.load_state_dict(weights, version, self.adapter_config)

    # -- how published weights are held and moved (here: tensors in this process's memory) --------
    def _publish(self) -> Any:
        """The actor's current weights (or adapter), as this backend hands them to engines."""
        return self.published_weights()

    def _load_all(self, weights: Any, version: int) -> None:
        for engine in self.rollout:
            self._load(engine, weights, version)

    def _moved_bytes(self, weights: Any) -> float:
        return float(sum(t.numel() * t.element_size() for t in weights.values()))

    def _keep_rollout_weights(self, weights: Any, folder: Path) -> dict[str, Any]:
        """Into a checkpoint: the weights the rollout workers hold while they lag the actor."""
        save_file({k: v.contiguous() for k, v in weights.items()}, folder / ROLLOUT_WEIGHTS)
        return {}

    def _rollout_weights_from(self, folder: Path, manifest: dict[str, Any]) -> Any:
        """What `_keep_rollout_weights` kept in a checkpoint, ready for `_load_all`."""
        return load_file(folder / ROLLOUT_WEIGHTS)

    def sync_weights(self) -> int:
        """Give every rollout engine the actor's weights (or adapter); returns the version.

        In-process and pipelined transformers engines take them in memory. vLLM engines take them
        by the run's weight_sync_method (`lora` when they generate with adapters): a file on the
        storage root reloaded in place (`reload`, `volume`), safetensors bytes over their socket
        (`direct`), a saved model they restart on (`checkpoint`), an adapter folder (`lora`).
        """
        weights = self._publish()
        self.published = (self.actor.policy_version, weights)
        if self.uses_vllm:
            method = "lora" if self.adapter_config is not None else self.config.weight_sync_method
            run_dir = RunStorage(self.config.storage_root, self.config.run_id or "unnamed").run_dir
            self.last_sync = weight_sync.sync_weights(method, self.actor, self.rollout, run_dir)
            return self.actor.policy_version
        self._load_all(weights, self.actor.policy_version)
        self.last_sync = {"bytes": self._moved_bytes(weights)}
        return self.actor.policy_version

    # -- resume and self-healing ---------------------------------------------------------------
    def restore(self, storage: RunStorage, checkpoint_step: int | None) -> int:
        """Actor and rollout engines as they were at a checkpoint (or the start); returns the rollout version."""
        if checkpoint_step is None:
            self.actor.reset()
            self.published = None
            for engine in self.rollout:
                engine.load()
            return 0
        folder = storage.checkpoint_dir(checkpoint_step)
        manifest = storage.verify_checkpoint(checkpoint_step)
        self.actor.restore(folder)
        rollout_version = manifest.get("rollout_policy_version", self.actor.policy_version)
        if rollout_version == self.actor.policy_version:
            weights = self._publish()
        else:
            weights = self._rollout_weights_from(folder, manifest)
        self.published = (rollout_version, weights)
        self._load_all(weights, rollout_version)
        return rollout_version

    def save_rollout_weights(self, folder: Path) -> dict[str, Any]:
        """What a checkpoint needs to restore the rollout workers when they lag the actor."""
        version = self.published[0] if self.published else 0
        kept: dict[str, Any] = {}
        if version != self.actor.policy_version:
            if self.published is None:
                raise RuntimeError("rollout workers hold the initial model; restore it from model_path instead")
            kept = self._keep_rollout_weights(self.published[1], folder)
        return {"rollout_policy_version": version, **kept}

    def ensure_actor_version(self, version: int, storage: RunStorage) -> None:
        """Bring the actor to `version`: restore the newest checkpoint at or before it, replay the logged steps."""
        with self._heal_lock:
            if self.actor.loaded and self.actor.policy_version == version:
                return
            logger.warning(
                "actor holds version %s, expected %d: restoring and replaying", self.actor.policy_version, version
            )
            replay_actor_to(self.actor, version, storage)

    def ensure_rollout_version(self, index: int, version: int, storage: RunStorage) -> Any:
        """Rollout engine `index`, holding policy `version` (loaded from what was published if not)."""
        engine = self.rollout[index]
        if engine.model is not None and engine.policy_version == version:
            return engine
        with self._heal_lock:
            logger.warning(
                "rollout worker %d holds version %s, expected %d: loading it", index, engine.policy_version, version
            )
            if engine.model is None:
                engine.load()
            if version == 0 and self.published is None:
                return engine  # a freshly loaded engine holds the initial model
            if self.published and self.published[0] == version:
                self._load(engine, self.published[1], version)
                return engine
        self.ensure_actor_version(version, storage)
        with self._heal_lock:
            self._load(engine, self._publish(), version)
        return engine


def local_workers(config: GRPOFlowConfig, model_path: str | Path) -> LocalWorkers:
    """The run's workers, created on first use."""
    assert config.run_id is not None
    return _WORKERS.get(config.run_id, lambda: LocalWorkers(config, model_path))


def kill(run_id: str) -> None:
    """End the run's engine processes now, without waiting for a call under way (the process is about
    to exit at once: a second Ctrl-C). In-process workers go with the process."""
    workers = _WORKERS.peek(run_id)
    for engine in workers.rollout if workers is not None else []:
        if isinstance(engine, ProcessRolloutEngine):
            engine.kill()


def release(run_id: str) -> None:
    _WORKERS.release(run_id)
