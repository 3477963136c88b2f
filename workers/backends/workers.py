"""A run's workers as the tasks see them: one implementation of start, weight sync, resume and
healing, over the handles a backend supplies.

    workers = Workers(config, model_path, placement)    # placement: LocalPlacement, ModalPlacement, RayPlacement
    workers.start()                                      # every worker up (verl's init_workers)
    workers.generate(shard, version, prompts, params, max_prompt_length)
    workers.actor_step(expected_version, rollouts)
    workers.sync_weights() · workers.save_checkpoint(storage, step, extra) · workers.restore(storage, step)

A backend says only where each worker runs and how it is called (`Placement`): its `start()`
returns one `Handle` for the actor and one per rollout engine, each calling the verbs of
`workers/backends/servers.py`. Adding a backend (Kubernetes, SLURM) means writing a placement.

Healing: every call whose answer depends on the weights carries the policy version it needs; a
worker holding another one refuses (`StaleActorError`, `StaleEngineError`), and one that is gone
raises what its backend raises for that (`Placement.lost_errors`). Either way the call is made
again after healing the worker, up to MAX_HEALS times: the actor restores the newest checkpoint at
or before the version and replays the logged steps since; an engine goes back to the initial model
and loads what was published for its version. A replaced worker costs time, never correctness.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.actor.actor import StaleActorError
from grpo_flow.workers.backends.servers import StaleEngineError
from grpo_flow.workers.backends.weight_sync import WeightPayload
from grpo_flow.workers.rollout.base import GenerationResult, SamplingParams
from grpo_flow.workers.state.resume import replay_actor_to
from grpo_flow.workers.state.location import is_url, local_root
from grpo_flow.workers.state.storage import RunStorage

MAX_HEALS = 5  # heals per call before the error reaches the task (whose Prefect retries come next)
ROLLOUT_WEIGHTS = "rollout_model.safetensors"  # in a checkpoint, when the rollout workers lag the actor
logger = logging.getLogger("grpo_flow.workers")


class PublishedWeightsLost(RuntimeError):
    """What the actor published for the engines is gone (Ray: its node died): publish it again."""


class Handle(Protocol):
    """One worker (an ActorServer or a RolloutServer) wherever it runs: a blocking call of one verb."""

    name: str

    def call(self, verb: str, *args: Any) -> Any: ...


class Placement:
    """Where a run's workers run and how they are called: what a backend supplies to `Workers`.

    The defaults fit workers whose answers come back as values (in this process, or Modal's)."""

    lost_errors: tuple[type[BaseException], ...] = ()  # besides the stale-version errors
    check_storage = False  # whether workers must show they see the storage root (another node's disk)

    def __init__(self, config: GRPOFlowConfig, model_path: str | Path) -> None:
        self.config = config
        self.model_path = str(model_path)
        # Healing loads models and sets RNG states; one heal at a time (the local backend shares its lock
        # with in-process generation, which draws from the same global RNG).
        self.heal_lock: Any = threading.RLock()

    def start(self) -> tuple[Handle, list[Handle]]:
        """The actor's handle and one per rollout engine, each worker started and loaded."""
        raise NotImplementedError

    def parallel(self, calls: Sequence[Callable[[], Any]]) -> list[Any]:
        """Calls that may overlap (one per engine); in turn unless the workers run elsewhere."""
        return [call() for call in calls]

    def weights_method(self) -> str:
        """How the engines take the actor's weights: `STATE_DICT`, or a weight_sync method."""
        return self.config.sync_method

    def publish(self, actor: Handle, version: int, method: str) -> tuple[Any, dict[str, Any]]:
        """(what the engines load, what was published): the first as this backend holds it."""
        held, info = actor.call("publish", version, method)
        return held, info

    def fetch(self, held: Any) -> Any:
        """What `publish` holds, as a value here (a state dict or a WeightPayload)."""
        return held

    def hold(self, weights: Any) -> Any:
        """A value as `publish` holds it (Ray: put in the object store once for every engine)."""
        return weights

    def worker_folder(self, folder: Path) -> str:
        """A folder under the storage root, as the workers are told it: relative to the root."""
        root = local_root(self.config.storage_root).resolve()
        try:
            return str(Path(folder).resolve().relative_to(root))
        except ValueError:
            raise ValueError(f"{folder} is not under the run's storage_root {root}") from None

    def checkpoint_written(
        self, storage: RunStorage, step: int, answer: dict[str, Any], files: dict[str, bytes]
    ) -> None:
        """After the actor wrote and committed checkpoint `step` (`answer`: its manifest and folder) where
        the workers see the storage root; the Modal backend commits a pointer to it in the run's own folder."""

    def checkpoints_pruned(self, storage: RunStorage, steps: list[int]) -> None:
        """After `prune_checkpoints` removed these checkpoints from the run's storage (Modal: the Volume's too)."""

    def step_metrics(self) -> dict[str, float]:
        """What this backend adds to every actor step's metrics (Modal: GPU-seconds per role)."""
        return {}

    def engine_pid(self, index: int) -> int | None:
        """Engine `index`'s own process, where this process can signal it (fault injection)."""
        return None

    def kill(self) -> None:
        """End engine processes at once (the process is about to exit: a second Ctrl-C)."""

    def close(self) -> None:
        """End the workers (their processes, containers, actors); nothing on the storage root changes."""


class ActorCalls:
    """The actor as `replay_actor_to` drives it (reset, restore, step), each call made once."""

    def __init__(self, workers: Workers) -> None:
        self.workers = workers

    @property
    def policy_version(self) -> int:
        return self.workers.actor_version or 0

    def reset(self) -> None:
        self.workers.actor_version = self.workers.actor.call("restore", None)

    def restore(self, folder: Path) -> None:
        self.workers.actor_version = self.workers.actor.call("restore", self.workers.placement.worker_folder(folder))

    def step(self, expected_version: int, rollouts: Any) -> dict[str, float]:
        metrics = self.workers.actor.call("step", expected_version, rollouts)
        self.workers.actor_version = expected_version + 1
        return metrics


class EngineAt:
    """One engine of `Workers` at one policy version, with a rollout engine's `generate`."""

    def __init__(self, workers: Workers, index: int, version: int) -> None:
        self.workers, self.index, self.version = workers, index, version

    def generate(
        self, prompts: list[Any], params: SamplingParams, max_prompt_length: int | None = None
    ) -> GenerationResult:
        return self.workers.generate(self.index, self.version, prompts, params, max_prompt_length)


class Workers:
    """A run's actor and rollout engines, wherever its placement runs them."""

    def __init__(self, config: GRPOFlowConfig, model_path: str | Path, placement: Placement) -> None:
        assert config.run_id is not None
        self.config = config
        self.model_path = str(model_path)
        self.placement = placement
        root = config.storage_root
        self.storage = RunStorage(root if is_url(root) else Path(root).resolve(), config.run_id)
        self.actor: Handle
        self.rollout: list[Handle] = []
        self.actor_version: int | None = 0  # what the actor holds; None: unknown (it was lost)
        self.rollout_versions: list[int | None] = []
        self.published: tuple[int, Any] | None = None  # (version, as the placement holds it)
        self.last_sync: dict[str, Any] = {}
        self.lost: tuple[type[BaseException], ...] = (
            StaleActorError,
            StaleEngineError,
            PublishedWeightsLost,
            *placement.lost_errors,
        )
        self._depth = threading.local()  # calls nest while healing: only the outermost one heals and retries
        if config.publishes_adapter:
            from grpo_flow.workers.actor import trl_objective

            self.adapter_config: Any = trl_objective.lora_config(config)
        else:
            self.adapter_config = None

    # -- start and end ------------------------------------------------------------------------------
    def start(self) -> Workers:
        """Start every worker and check each is up (and, on a cluster, sees the storage root)."""
        try:
            self.actor, self.rollout = self.placement.start()
            self.rollout_versions = [0] * len(self.rollout)
            marker = None
            if self.placement.check_storage and not self.storage.remote:  # a URL: each node asked before start
                marker = self.storage.root / ".storage-check" / f"{self.storage.run_id}-{time.time_ns()}"
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text("grpo-flow\n")
            try:
                for worker in (self.actor, *self.rollout):
                    answer = worker.call("ready", None if marker is None else str(marker))
                    if not answer["storage_visible"]:
                        raise RuntimeError(
                            f"storage_root: {self.storage.root} is not visible from the worker {worker.name} on "
                            f"{answer['host']}: put the storage root on a filesystem every node mounts at the same path"
                        )
            finally:
                if marker is not None:
                    marker.unlink(missing_ok=True)
        except BaseException:
            self.close()  # nothing keeps running for workers that never started
            raise
        return self

    def close(self) -> None:
        self.placement.close()

    def kill(self) -> None:
        self.placement.kill()

    # -- calls that need a version: heal the worker and call again ------------------------------------
    @contextlib.contextmanager
    def _outermost(self) -> Iterator[bool]:
        depth = getattr(self._depth, "value", 0)
        self._depth.value = depth + 1
        try:
            yield depth == 0
        finally:
            self._depth.value = depth

    def _retrying(self, what: str, call: Callable[[], Any], heal: Callable[[], None]) -> Any:
        with self._outermost() as outermost:
            if not outermost:
                return call()
            for attempt in range(MAX_HEALS + 1):
                try:
                    if attempt:
                        time.sleep(min(0.2 * (attempt - 1), 2.0))  # a backend notices a death and restarts the worker
                        with self.placement.heal_lock:
                            heal()
                    return call()
                except self.lost as error:
                    if attempt == MAX_HEALS:
                        raise
                    logger.warning("%s: worker lost or stale (%s); healing it (attempt %d)", what, error, attempt + 1)
        raise AssertionError("unreachable")

    def _heal_actor(self, version: int) -> None:
        """Whatever the actor holds now: the newest checkpoint at or before `version`, the logged steps since."""
        logger.warning("actor holds version %s, expected %d: restoring and replaying", self.actor_version, version)
        self.actor_version = None
        replay_actor_to(ActorCalls(self), version, self.storage)

    def _heal_engine(self, index: int, version: int) -> None:
        """Engine `index` on the initial model, then what was published for `version` (published again if lost)."""
        logger.warning(
            "rollout-%d holds version %s, expected %d: loading it", index, self.rollout_versions[index], version
        )
        self.rollout_versions[index] = self.rollout[index].call("initial")
        if version == 0:
            return
        if self.published is None or self.published[0] != version:
            if self.actor_version != version:
                self._heal_actor(version)  # the actor steps on from there at its next step (healed again)
            try:
                held = self._publish(version)
            except self.lost:  # the actor was lost too (or replaced): it holds another version than we knew
                self._heal_actor(version)
                held = self._publish(version)
            self.published = (version, held)
        self._load(index, self.published[1], version)

    def with_actor_at(self, version: int, call: Callable[[], Any]) -> Any:
        return self._retrying(f"actor at version {version}", call, lambda: self._heal_actor(version))

    def with_engine_at(self, index: int, version: int, call: Callable[[], Any]) -> Any:
        return self._retrying(f"rollout-{index} at version {version}", call, lambda: self._heal_engine(index, version))

    # -- the verbs the tasks use ------------------------------------------------------------------------
    def actor_step(self, expected_version: int, rollouts: Any) -> dict[str, float]:
        """One optimizer step from `expected_version` on a step's logged rollouts (a retried step is answered)."""
        metrics = self.with_actor_at(expected_version, lambda: ActorCalls(self).step(expected_version, rollouts))
        return {**metrics, **self.placement.step_metrics()}

    def generate(
        self, index: int, version: int, prompts: list[Any], params: SamplingParams, max_prompt_length: int | None
    ) -> GenerationResult:
        """Engine `index`'s completions at policy `version`; `extra` has worker_id, policy_version, prompt_texts."""
        handle = self.rollout[index]
        result: GenerationResult = self.with_engine_at(
            index, version, lambda: handle.call("generate", version, list(prompts), params, max_prompt_length)
        )
        self.rollout_versions[index] = version
        return result

    def _publish(self, version: int) -> Any:
        """The actor's weights at `version`, as the placement holds them (the actor healed to it first)."""
        method = self.placement.weights_method()
        held, info = self.with_actor_at(version, lambda: self.placement.publish(self.actor, version, method))
        self.last_publish = info
        return held

    def _load(self, index: int, held: Any, version: int) -> None:
        try:
            self.rollout[index].call("load_weights", held, version, self.adapter_config)
        except PublishedWeightsLost:
            self.published = None  # the engine's heal publishes them again
            raise
        self.rollout_versions[index] = version

    def _load_all(self, held: Any, version: int) -> None:
        """Every engine from the one published copy; one lost meanwhile loads it at its next use."""

        def load(index: int) -> None:
            try:
                self._load(index, held, version)
            except self.lost as error:
                logger.warning(
                    "rollout-%d lost during the weight sync (%s); it loads %d at its next use", index, error, version
                )
                self.rollout_versions[index] = None

        self.placement.parallel([functools.partial(load, i) for i in range(len(self.rollout))])

    def sync_weights(self) -> int:
        """Every engine takes the actor's current weights by the placement's method; returns the version."""
        started = time.perf_counter()
        version = self.actor_version if self.actor_version is not None else 0
        self.published = (version, self._publish(version))
        self._load_all(self.published[1], version)
        self.last_sync = {
            "method": self.last_publish.get("method"),
            "version": version,
            "bytes": float(self.last_publish.get("bytes", 0)),
            "seconds": time.perf_counter() - started,
        }
        return version

    @property
    def rollout_version(self) -> int:
        """The version the engines hold (they are synced together), as published."""
        return self.published[0] if self.published is not None else 0

    def engine_at_current_version(self, index: int = 0) -> EngineAt:
        """Engine `index` as something with `generate(prompts, params, max_prompt_length)`, at the version the
        engines hold now (held-out evaluation)."""
        return EngineAt(self, index, self.rollout_version)

    def engine_pid(self, index: int) -> int | None:
        return self.placement.engine_pid(index)

    # -- checkpoints and resume ----------------------------------------------------------------------------
    def save_checkpoint(self, storage: RunStorage, version: int, extra: dict[str, Any]) -> dict[str, Any]:
        """Checkpoint `version`, written and committed by the actor under the storage root as it sees it
        (the writer commits what it wrote), its manifest carrying `extra` and what restoring the engines
        needs when they lag the actor (sync_weights_every > 1): the weights they hold. Returns the manifest."""
        state, files = self._rollout_state(version)
        answer = self.with_actor_at(
            version, lambda: self.actor.call("save_checkpoint", version, version, {**extra, **state}, files)
        )
        self.placement.checkpoint_written(storage, version, answer, files)
        manifest: dict[str, Any] = answer["manifest"]
        return manifest

    def checkpoints_pruned(self, storage: RunStorage, steps: list[int]) -> None:
        """Pruned checkpoints go from wherever the workers wrote them too (a Modal Volume)."""
        if steps:
            self.placement.checkpoints_pruned(storage, steps)

    def _rollout_state(self, actor_version: int) -> tuple[dict[str, Any], dict[str, bytes]]:
        """(manifest fields, files for the checkpoint) that let a resume give the engines what they hold."""
        rollout_version = self.rollout_version
        state: dict[str, Any] = {"rollout_policy_version": rollout_version}
        if rollout_version == actor_version:
            return state, {}
        if self.published is None:
            raise RuntimeError("rollout workers hold the initial model; restore it from model_path instead")
        weights = self.placement.fetch(self.published[1])
        if isinstance(weights, WeightPayload):
            if weights.method in ("volume", "checkpoint", "lora"):  # versioned files, never written again
                return {**state, "rollout_weights": weights.path, "rollout_weights_method": weights.method}, {}
            if weights.method == "direct":
                return state, {ROLLOUT_WEIGHTS: weights.bytes()}
            if weights.path is None or not Path(weights.path).is_file():
                raise RuntimeError(
                    f"the rollout workers hold policy version {rollout_version} and the actor {actor_version}; with "
                    f"weight_sync_method {weights.method!r} those weights are in a scratch file this process cannot "
                    "read, so a resume from this checkpoint would not be exact. Use 'volume', 'checkpoint', 'direct' "
                    "or 'lora', or sync_weights_every 1."
                )
            return state, {ROLLOUT_WEIGHTS: Path(weights.path).read_bytes()}  # overwritten by the next sync
        from safetensors.torch import save

        return state, {ROLLOUT_WEIGHTS: save({k: v.contiguous() for k, v in weights.items()})}

    def _rollout_weights_from(self, folder: Path, manifest: dict[str, Any]) -> Any:
        """What `_rollout_state` kept in a checkpoint, as the placement holds published weights."""
        version = manifest["rollout_policy_version"]
        if "rollout_weights" in manifest:
            return self.placement.hold(
                WeightPayload(manifest["rollout_weights_method"], version, manifest["rollout_weights"])
            )
        from safetensors.torch import load_file

        return self.placement.hold(load_file(folder / ROLLOUT_WEIGHTS))

    def restore(self, storage: RunStorage, checkpoint_step: int | None) -> int:
        """Actor and engines as they were at a checkpoint (or the start); returns the engines' version."""

        def restore() -> int:
            if checkpoint_step is None:
                ActorCalls(self).reset()
                self.published = None
                self.placement.parallel([functools.partial(h.call, "initial") for h in self.rollout])
                self.rollout_versions = [0] * len(self.rollout)
                return 0
            manifest = storage.verify_checkpoint(checkpoint_step)
            folder = storage.local_checkpoint(checkpoint_step)
            ActorCalls(self).restore(folder)
            actor_version = self.actor_version or 0
            version = manifest.get("rollout_policy_version", actor_version)
            held = self._publish(version) if version == actor_version else self._rollout_weights_from(folder, manifest)
            self.published = (version, held)
            self._load_all(held, version)
            return version

        return self._retrying(f"restore of checkpoint {checkpoint_step}", restore, lambda: None)
