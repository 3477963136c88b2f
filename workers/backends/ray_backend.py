"""The Ray backend: the actor and each rollout engine as Ray actors on a Ray cluster.

- `check_ray_ready(config)`: before anything starts, one clear error (`RayNotReadyError`) when
  Ray is not installed, no cluster answers at the address, or the cluster lacks the CPUs or GPUs
  the config asks for. It connects this process to the cluster (`ray.init`), once.
- `RayWorkers(config, model_path)`: `grpo_flow.workers.backends.local.LocalWorkers`' surface and its sync,
  resume and self-healing logic (it subclasses it), over Ray actor handles. The actor and the
  `num_rollout_workers` engines are `ray.remote` versions of the plain classes in
  workers/backends/ray_app.py, each in one bundle of the run's placement group
  (`actor_cpus`/`actor_gpus`, `rollout_cpus`/`rollout_gpus`), with `max_restarts=-1`.
- Weight sync: `reload` (the default) and `direct` put the actor's state dict in Ray's object
  store once (it is the return value of the actor's `publish`) and every engine gets the
  reference; `volume`, `checkpoint` and `lora` write files on the shared storage root, as on
  Modal (workers/backends/weight_sync.py). Either way the engine loads them with its own
  method (a vLLM engine: in place, a new engine from the folder, or a LoRA adapter).
- vLLM engines (rollout_engine='vllm'): one per rollout Ray actor, on the GPUs of its bundle
  (vllm_mode 'server'; colocating an engine with the actor is the local backend's). vLLM runs in
  the actor's process when the Ray workers' Python imports it, else in a child process started
  from `vllm_python`, which must then exist on every node; `check_ray_ready` asks each node
  before anything starts. Its log goes to `logs/rollout-<i>.log` in the run folder.
- Self-healing: Ray restarts a lost actor process (killed, or its node gone, once the placement
  group's bundle is placed again); a restarted worker holds the initial model. Every call carries
  the policy version it expects. A call that fails because its worker died, or that a worker
  holding another version refuses, marks that worker lost; the backend then brings it to the
  version the call needs with `LocalWorkers.ensure_actor_version` / `ensure_rollout_version`
  (restore the checkpoint and replay the logged steps; engines load the published weights from
  the object store) and makes the call again, up to MAX_HEALS times. The step goes on. A vLLM
  engine's child process that dies reads as a stale engine and heals the same way; one whose Ray
  actor process dies ends itself (it watches its parent), and the restarted actor starts another.

The storage root must be a folder every node mounts at the same path (NFS, a cluster
filesystem); the workers read and write checkpoints and weight files there, and refuse to start
when they cannot see it. Project code reaches the workers as the job's `py_modules` (`grpo_flow`
with its `schemas` and `workers`); the libraries (torch, transformers, trl, peft) must be installed on every node.

Ray is imported only here, and this module only when `backend="ray"`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.backends.registry import RunWorkers
from grpo_flow.workers.actor import trl_objective
from grpo_flow.workers.actor.actor import StaleActorError
from grpo_flow.workers.backends.local import ROLLOUT_WEIGHTS, LocalWorkers
from grpo_flow.workers.backends.ray_app import OBJECT_STORE_METHODS, ActorWorker, RolloutWorker, StaleEngineError
from grpo_flow.workers.backends.weight_sync import WeightPayload, check_weight_sync_config
from grpo_flow.workers.state.source import stage_package
from grpo_flow.workers.state.storage import RunStorage

INSTALL_HINT = 'pip install -e ".[ray]"'
MAX_HEALS = 5  # heals per call before the error reaches the task (whose Prefect retries come next)
STARTUP_TIMEOUT_S = 600.0  # a worker's process start and model load (a restart too)
PLACEMENT_TIMEOUT_S = 120.0  # the placement group's bundles reserved on the cluster
CONNECT_TIMEOUT_S = 5.0  # the TCP probe of the address before ray.init
SHUTDOWN_TIMEOUT_S = 30.0  # the rollout workers ending their engines at the run's end
PROBE_TIMEOUT_S = 120.0  # each node saying whether it can run vLLM (a worker process start)
# What the workers' processes get from this one's environment (they start from the raylet's otherwise).
FORWARDED_ENV = (
    "HF_HUB_OFFLINE",
    "HF_TOKEN",
    "TRANSFORMERS_VERBOSITY",
    "TOKENIZERS_PARALLELISM",
    "GRPO_FLOW_VLLM_PYTHON",  # where the vLLM environment is on the nodes (workers.backends.vllm_env)
    "VLLM_CPU_KVCACHE_SPACE",
)
logger = logging.getLogger("grpo_flow.workers")


class RayNotReadyError(ValueError):
    """The Ray backend cannot run this config: Ray missing, no cluster, too few resources."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayNotReadyError(f"backend 'ray' needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


# -- connecting ----------------------------------------------------------------------------------------
def cluster_address(config: GRPOFlowConfig) -> tuple[str, str]:
    """(address, where it came from): ray_address, else RAY_ADDRESS, else 'local' (a new local instance)."""
    if config.ray_address:
        return config.ray_address, "ray_address"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    return "local", "default"


def probe(address: str, source: str) -> None:
    """A HOST:PORT address must accept a TCP connection: ray.init itself retries for a minute or more."""
    if address in ("local", "auto") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise RayNotReadyError(f"{source}: {address!r} is not HOST:PORT (as `ray start --head` prints it), or 'auto'")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as error:
        raise RayNotReadyError(
            f"{source}: no Ray cluster at {address} ({error.strerror or error}); start one with "
            f"`ray start --head --port {port}` or name a running cluster"
        ) from None


_CONNECTION_LOCK = threading.Lock()
_CONNECTED: str | None = None  # the address this process is connected to


@functools.cache
def staged_package() -> Path:
    """A folder holding `grpo_flow` with its `schemas` and `workers` alone (workers never import the rest)."""
    folder = Path(tempfile.mkdtemp(prefix="grpo-flow-ray-src-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return stage_package(folder, ["schemas", "workers"])


def runtime_env() -> dict[str, Any]:
    """The project's own code travels with the job; the libraries are installed on every node."""
    env_vars = {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}
    return {
        "py_modules": [str(staged_package() / "grpo_flow")],
        "excludes": ["__pycache__", "*.pyc"],
        "env_vars": env_vars,
    }


def connect(config: GRPOFlowConfig) -> Any:
    """This process connected to the run's cluster (once; again if another address is asked for)."""
    global _CONNECTED
    ray = import_ray()
    address, source = cluster_address(config)
    with _CONNECTION_LOCK:
        if ray.is_initialized() and _CONNECTED == address:
            return ray
        probe(address, source)
        if ray.is_initialized():
            ray.shutdown()
        options: dict[str, Any] = dict(
            address=address, runtime_env=runtime_env(), logging_level=logging.ERROR, log_to_driver=False
        )
        if address == "local":
            options["include_dashboard"] = False
        try:
            ray.init(**options)
        except ConnectionError as error:
            raise RayNotReadyError(f"{source}: cannot connect to a Ray cluster at {address!r}: {error}") from None
        _CONNECTED = address
        return ray


# -- resources -----------------------------------------------------------------------------------------
def resolved_gpus(config: GRPOFlowConfig, cluster_gpus: float) -> tuple[float, float]:
    """(actor_gpus, rollout_gpus): None means one GPU each on a cluster that has GPUs, none otherwise."""
    default = 1.0 if cluster_gpus > 0 else 0.0
    actor = default if config.actor_gpus is None else config.actor_gpus
    rollout = default if config.rollout_gpus is None else config.rollout_gpus
    return actor, rollout


def bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def plan_bundles(config: GRPOFlowConfig, cluster_gpus: float) -> list[dict[str, float]]:
    """The placement group: the actor's bundle, then one per rollout engine."""
    actor_gpus, rollout_gpus = resolved_gpus(config, cluster_gpus)
    return [bundle(config.actor_cpus, actor_gpus)] + [
        bundle(config.rollout_cpus, rollout_gpus) for _ in range(config.num_rollout_workers)
    ]


def check_resources(config: GRPOFlowConfig, nodes: list[dict[str, float]], where: str) -> None:
    """Refuse, naming the resource and the fields, a config the cluster's nodes cannot hold."""
    totals = {name: sum(node.get(name, 0.0) for node in nodes) for name in ("CPU", "GPU")}
    bundles = plan_bundles(config, totals["GPU"])
    n = config.num_rollout_workers
    fields = {"GPU": ("actor_gpus", "rollout_gpus"), "CPU": ("actor_cpus", "rollout_cpus")}
    for name, (actor_field, rollout_field) in fields.items():
        actor, each = bundles[0].get(name, 0.0), bundles[1].get(name, 0.0)
        wanted = actor + n * each
        if wanted > totals[name] + 1e-9:
            raise RayNotReadyError(
                f"{actor_field}/{rollout_field}: the run asks for {wanted:g} {name} ({actor_field} {actor:g} + "
                f"num_rollout_workers {n} x {rollout_field} {each:g}), but the Ray cluster at {where} has "
                f"{totals[name]:g} {name} in all"
            )
        largest = max((node.get(name, 0.0) for node in nodes), default=0.0)
        for field, amount in ((actor_field, actor), (rollout_field, each)):
            if amount > largest + 1e-9:
                raise RayNotReadyError(
                    f"{field}: {amount:g} {name} for one worker, but no node of the Ray cluster at {where} has more "
                    f"than {largest:g} {name}"
                )


def cluster_nodes(ray: Any) -> list[dict[str, float]]:
    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]


def check_ray_ready(config: GRPOFlowConfig) -> None:
    """Everything the Ray backend needs before any worker starts, or one RayNotReadyError naming it."""
    check_weight_sync_config(config)
    ray = connect(config)
    nodes = cluster_nodes(ray)
    check_resources(config, nodes, cluster_address(config)[0])
    if config.rollout_engine == "vllm":
        check_vllm_on_nodes(ray, config)


def check_vllm_on_nodes(ray: Any, config: GRPOFlowConfig) -> None:
    """vLLM engines need vLLM on every node that can hold one: importable by the Ray workers' Python, or
    an environment at `vllm_python` (as each node resolves it). A task on each such node says which
    (0 CPUs: it runs beside whatever holds the node)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from grpo_flow.workers.backends import vllm_env

    live = [node for node in ray.nodes() if node.get("Alive")]
    rollout_gpus = resolved_gpus(config, sum(node["Resources"].get("GPU", 0.0) for node in live))[1]
    if config.vllm_enable_sleep_mode and not rollout_gpus:
        raise RayNotReadyError(
            "vllm_enable_sleep_mode: vLLM's sleep mode needs a CUDA GPU, and the run's rollout engines get none "
            "(rollout_gpus 0, or a cluster without GPUs)"
        )
    hosts = [
        node
        for node in live
        if node["Resources"].get("CPU", 0.0) >= config.rollout_cpus
        and node["Resources"].get("GPU", 0.0) >= rollout_gpus
    ]
    probe = ray.remote(num_cpus=0)(vllm_env.where_vllm_runs)
    refs = [
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(config)
        for node in hosts
    ]
    try:
        answers = ray.get(refs, timeout=PROBE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RayNotReadyError(
            f"rollout_engine: the Ray cluster's nodes did not say within {PROBE_TIMEOUT_S:.0f} s whether they "
            "can run vLLM"
        ) from None
    missing = [answer for answer in answers if not (answer["in_process"] or answer["python_ok"])]
    if missing:
        raise RayNotReadyError(vllm_env.no_vllm_message(config, missing))


# -- the facades over the Ray actors --------------------------------------------------------------------
LOST_ERRORS: tuple[type[BaseException], ...] = (StaleActorError, StaleEngineError)


def lost_errors() -> tuple[type[BaseException], ...]:
    """What says a worker is gone or holds other weights than the call needs: heal it and call again."""
    import ray.exceptions

    return (ray.exceptions.RayActorError, *LOST_ERRORS)


class RayHandle:
    """One Ray actor: blocking calls; a failure that says the worker was lost marks it lost."""

    def __init__(self, workers: RayWorkers, handle: Any, name: str) -> None:
        self.workers, self.handle, self.name = workers, handle, name
        self.lost = False

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        try:
            return self.workers.ray.get(ref, timeout=timeout)
        except lost_errors():
            self.lost = True
            raise

    def call(self, method: str, *args: Any) -> Any:
        return self.get(getattr(self.handle, method).remote(*args))

    def ready(self, marker: str | None = None) -> dict[str, Any]:
        return self.get(self.handle.ready.remote(marker), timeout=STARTUP_TIMEOUT_S)


class RayActor(RayHandle):
    """`Actor`'s surface as the tasks and `replay_actor_to` use it: step, save_checkpoint, restore, reset."""

    def __init__(self, workers: RayWorkers, handle: Any, name: str) -> None:
        super().__init__(workers, handle, name)
        self.version = 0  # what it holds, or, when lost, what it must hold again

    @property
    def policy_version(self) -> int | None:
        return None if self.lost else self.version

    @property
    def loaded(self) -> bool:
        return not self.lost

    def step(self, expected_version: int, rollouts: Any) -> dict[str, float]:
        metrics = self.workers.with_actor_at(expected_version, lambda: self.call("step", expected_version, rollouts))
        self.version = expected_version + 1
        return metrics

    def save_checkpoint(self, folder: Path) -> dict[str, Any]:
        version = self.version
        folder = Path(folder).resolve()
        return self.workers.with_actor_at(version, lambda: self.call("save_checkpoint", version, str(folder)))

    def publish(self, method: str) -> tuple[Any, dict[str, Any]]:
        """(reference to the published weights in the object store, what was published)."""
        version = self.version

        def call() -> tuple[Any, dict[str, Any]]:
            run_dir = str(self.workers.storage.run_dir.resolve())
            weights, info = self.handle.publish.options(num_returns=2).remote(version, method, run_dir)
            return weights, self.get(info)

        return self.workers.with_actor_at(version, call)

    # The calls healing itself makes (replay_actor_to): failures go to the caller's retry loop.
    def restore(self, folder: Path) -> None:
        self.version = self.call("restore", str(Path(folder).resolve()))
        self.lost = False

    def reset(self) -> None:
        self.version = self.call("reset")
        self.lost = False


class RayRollout(RayHandle):
    """A rollout engine's surface (generate, load, load_state_dict, policy_version, worker_id, model)."""

    def __init__(self, workers: RayWorkers, handle: Any, name: str, index: int) -> None:
        super().__init__(workers, handle, name)
        self.index = index
        self.worker_id = f"rollout-{index}"
        self.version = 0
        self._tokenizer: Any = None

    @property
    def policy_version(self) -> int | None:
        return None if self.lost else self.version

    @property
    def model(self) -> Any:
        """Truthy while the engine is known to hold `version` (LocalWorkers checks `engine.model is None`)."""
        return None if self.lost else True

    @property
    def tokenizer(self) -> Any:
        """A local copy, loaded on first use (results carry `extra['prompt_texts']`, so tasks rarely need it)."""
        if self._tokenizer is None:
            from grpo_flow.workers.rollout.base import load_generation_tokenizer

            self._tokenizer = load_generation_tokenizer(self.workers.model_path)
        return self._tokenizer

    def generate(self, prompts: list[Any], params: Any, max_prompt_length: int | None = None) -> Any:
        version = self.version
        return self.workers.with_engine_at(
            self.index, version, lambda: self.call("generate", version, list(prompts), params, max_prompt_length)
        )

    # The calls healing itself makes (LocalWorkers.ensure_rollout_version and restore).
    def load(self) -> None:
        self.version = self.get(self.handle.initial.remote(), timeout=STARTUP_TIMEOUT_S)
        self.lost = False

    def load_state_dict(self, weights: Any, version: int, adapter_config: Any = None) -> None:
        self.call("load_weights", weights, version, adapter_config)
        self.version, self.lost = version, False


# -- the workers ---------------------------------------------------------------------------------------
class RayWorkers(LocalWorkers):
    """The run's workers as Ray actors, with `LocalWorkers`' sync, resume and healing logic."""

    actor: RayActor  # type: ignore[assignment]  # Actor's surface, over a Ray actor

    def __init__(
        self, config: GRPOFlowConfig, model_path: str | Path, worker_classes: tuple[type, type] | None = None
    ) -> None:
        """`worker_classes`: the (actor, rollout) classes to run as Ray actors, ray_app's by default
        (benchmarks/instant_workers.py passes ones with the same methods that answer at once)."""
        actor_cls, rollout_cls = worker_classes or (ActorWorker, RolloutWorker)
        self.ray = connect(config)
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert config.run_id is not None
        self.config = config
        self.model_path = str(Path(model_path).resolve()) if Path(model_path).exists() else str(model_path)
        self.storage = RunStorage(Path(config.storage_root).resolve(), config.run_id)
        self.published: tuple[int, Any] | None = None
        # As LocalWorkers says it; its two readers there (__init__, sync_weights) are overridden here.
        self.uses_vllm = config.rollout_engine == "vllm"
        self._heal_lock = threading.RLock()
        self._depth = threading.local()  # retry loops nest: only the outermost one heals and retries
        self.adapter_config = (
            trl_objective.lora_config(config) if config.use_lora and config.lora_publish == "adapter" else None
        )
        self.last_sync: dict[str, Any] = {}
        self._last_publish: dict[str, Any] = {}

        nodes = cluster_nodes(self.ray)
        address = cluster_address(config)[0]
        check_resources(config, nodes, address)
        bundles = plan_bundles(config, sum(node.get("GPU", 0.0) for node in nodes))
        self.placement_group = placement_group(bundles, strategy="PACK", name=f"grpo-flow/{config.run_id}")
        if not self.placement_group.wait(PLACEMENT_TIMEOUT_S):
            remove_placement_group(self.placement_group)
            raise RayNotReadyError(
                f"the Ray cluster at {address} did not reserve the run's resources ({bundles}) within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s: other jobs hold them"
            )
        self._remove_placement_group = remove_placement_group
        self.uid = uuid.uuid4().hex[:6]
        # The workers' processes start elsewhere (the node's Ray working folder): a relative root would move.
        config_json = config.model_copy(update={"storage_root": str(self.storage.root)}).model_dump_json()

        def spawn(cls: type, index: int, name: str, *args: Any) -> Any:
            cpus, gpus = bundles[index]["CPU"], bundles[index].get("GPU", 0.0)
            # Restarted by Ray whenever its process dies; its calls are not retried by Ray (max_task_retries=0):
            # a restarted worker holds the initial model, so the backend heals it first (see the module doc).
            remote = self.ray.remote(cls).options(
                name=f"grpo-flow/{config.run_id}/{self.uid}/{name}",
                num_cpus=cpus,
                num_gpus=gpus,
                max_restarts=-1,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, index),
            )
            return remote.remote(*args, "cuda" if gpus else "cpu")

        try:
            self.actor = RayActor(self, spawn(actor_cls, 0, "actor", config_json, self.model_path), "actor")
            self.rollout: list[Any] = [
                RayRollout(
                    self, spawn(rollout_cls, i + 1, f"rollout-{i}", config_json, self.model_path, i), f"rollout-{i}", i
                )
                for i in range(config.num_rollout_workers)
            ]
            self._check_started()
        except BaseException:
            self.close()
            raise

    def _check_started(self) -> None:
        """Every worker up, and seeing the storage root (it must be on a filesystem every node shares)."""
        marker = self.storage.root / ".ray-storage-check" / f"{self.uid}"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("grpo-flow\n")
        try:
            for worker in (self.actor, *self.rollout):
                answer = worker.ready(str(marker))
                if not answer["storage_visible"]:
                    raise RayNotReadyError(
                        f"storage_root: {self.storage.root} is not visible from the Ray worker {worker.name} on "
                        f"{answer['host']}: put the storage root on a filesystem every node mounts at the same path"
                    )
        finally:
            marker.unlink(missing_ok=True)

    # -- healing: the outermost call retries; nested ones let failures through -----------------------
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
                        time.sleep(min(0.2 * attempt, 2.0))  # Ray notices the death and restarts the process
                        heal()
                    return call()
                except lost_errors() as error:
                    if attempt == MAX_HEALS:
                        raise
                    logger.warning("%s: worker lost or stale (%s); healing it (attempt %d)", what, error, attempt + 1)
        raise AssertionError("unreachable")

    def with_actor_at(self, version: int, call: Callable[[], Any]) -> Any:
        """`call()`, which needs the actor at `version`; a lost or stale actor is brought back to it first."""
        return self._retrying(f"actor at version {version}", call, lambda: self._heal_actor(version))

    def with_engine_at(self, index: int, version: int, call: Callable[[], Any]) -> Any:
        return self._retrying(f"rollout-{index} at version {version}", call, lambda: self._heal_engine(index, version))

    def _heal_actor(self, version: int) -> None:
        self.actor.lost = True  # whatever it holds now, restore and replay to `version`
        LocalWorkers.ensure_actor_version(self, version, self.storage)

    def _heal_engine(self, index: int, version: int) -> None:
        self.rollout[index].lost = True
        LocalWorkers.ensure_rollout_version(self, index, version, self.storage)

    def restore(self, storage: RunStorage, checkpoint_step: int | None) -> int:
        return self._retrying(
            f"restore of checkpoint {checkpoint_step}",
            lambda: LocalWorkers.restore(self, storage, checkpoint_step),
            lambda: None,  # the whole restore again, the lost worker with it
        )

    def ensure_actor_version(self, version: int, storage: RunStorage) -> None:
        self._retrying(
            f"actor at version {version}",
            lambda: LocalWorkers.ensure_actor_version(self, version, storage),
            lambda: self._heal_actor(version),
        )

    def ensure_rollout_version(self, index: int, version: int, storage: RunStorage) -> Any:
        return self._retrying(
            f"rollout-{index} at version {version}",
            lambda: LocalWorkers.ensure_rollout_version(self, index, version, storage),
            lambda: None,  # the failing call marked its worker lost: the next try heals it
        )

    # -- LocalWorkers' hooks: weights live in Ray's object store (or in files on the storage root) ---------
    def sync_weights(self) -> int:
        """Every engine (transformers or vLLM) takes what `_publish` made by the run's weight_sync_method:
        the object store's copy, or a `WeightPayload` naming files (the actor exported them in its own
        process, so LocalWorkers' in-process vLLM path, `weight_sync.sync_weights`, does not apply)."""
        weights = self._publish()
        version = self.actor.version
        self.published = (version, weights)
        self._load_all(weights, version)
        self.last_sync = {"bytes": self._moved_bytes(weights)}
        return version

    def _publish(self) -> Any:
        weights, info = self.actor.publish(self.config.weight_sync_method)
        self._last_publish = info
        return weights

    def _moved_bytes(self, weights: Any) -> float:
        return float(self._last_publish.get("bytes", 0))

    def _load(self, engine: Any, weights: Any, version: int) -> None:
        try:
            engine.load_state_dict(weights, version, self.adapter_config)
        except self.ray.exceptions.ObjectLostError:
            # The published copy is gone (its node died): publish it again from the actor at that version.
            logger.warning("published weights of version %d lost; publishing them again", version)
            LocalWorkers.ensure_actor_version(self, version, self.storage)
            weights = self._publish()
            self.published = (version, weights)
            engine.load_state_dict(weights, version, self.adapter_config)

    def _load_all(self, weights: Any, version: int) -> None:
        """Every engine at once, from the one stored copy; an engine lost meanwhile heals at its next use."""
        refs = [
            (engine, engine.handle.load_weights.remote(weights, version, self.adapter_config))
            for engine in self.rollout
        ]
        for engine, ref in refs:
            try:
                engine.get(ref)
                engine.version, engine.lost = version, False
            except lost_errors() as error:
                logger.warning(
                    "%s lost during the weight sync (%s); it loads version %d at its next use",
                    engine.name,
                    error,
                    version,
                )
                engine.version = version

    def _keep_rollout_weights(self, weights: Any, folder: Path) -> dict[str, Any]:
        if self.config.weight_sync_method in OBJECT_STORE_METHODS:
            return LocalWorkers._keep_rollout_weights(self, self.ray.get(weights), folder)
        payload: WeightPayload = self.ray.get(weights)  # versioned files on the storage root, never rewritten
        return {"rollout_weights": payload.path, "rollout_weights_method": payload.method}

    def _rollout_weights_from(self, folder: Path, manifest: dict[str, Any]) -> Any:
        version = manifest["rollout_policy_version"]
        if "rollout_weights" in manifest:
            return self.ray.put(WeightPayload(manifest["rollout_weights_method"], version, manifest["rollout_weights"]))
        return self.ray.put(LocalWorkers._rollout_weights_from(self, folder, manifest))

    # -- the end --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the run's Ray actors and free its placement group (the cluster keeps running). The rollout
        workers first end their engines (a vLLM engine's process gives its GPU memory back); one that does
        not answer within SHUTDOWN_TIMEOUT_S is killed with its actor (its engine process then ends itself)."""
        rollout = getattr(self, "rollout", [])
        with contextlib.suppress(Exception):
            refs = [worker.handle.shutdown.remote() for worker in rollout if hasattr(worker.handle, "shutdown")]
            if refs:
                self.ray.wait(refs, num_returns=len(refs), timeout=SHUTDOWN_TIMEOUT_S)
        for worker in [getattr(self, "actor", None), *rollout]:
            if worker is not None:
                with contextlib.suppress(Exception):
                    self.ray.kill(worker.handle, no_restart=True)
        if getattr(self, "placement_group", None) is not None:
            with contextlib.suppress(Exception):
                self._remove_placement_group(self.placement_group)


_WORKERS: RunWorkers[RayWorkers] = RunWorkers()


def ray_workers(config: GRPOFlowConfig, model_path: str | Path) -> RayWorkers:
    """The run's Ray workers, started on first use (as `grpo_flow.workers.backends.local.local_workers`)."""
    assert config.run_id is not None
    return _WORKERS.get(config.run_id, lambda: RayWorkers(config, model_path))


def release(run_id: str) -> None:
    _WORKERS.release(run_id)


__all__ = ["ROLLOUT_WEIGHTS", "RayNotReadyError", "RayWorkers", "check_ray_ready", "ray_workers", "release"]
