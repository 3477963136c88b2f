"""The Ray backend: the actor and each rollout engine as Ray actors on a Ray cluster.

- `check_ray_ready(config)`: before anything starts, one clear error (`RayNotReadyError`) when
  Ray is not installed, no cluster answers at the address, or the cluster lacks the CPUs or GPUs
  the config asks for. It connects this process to the cluster (`ray.init`), once.
- `RayPlacement(config, model_path)`: where `Workers` (workers/backends/workers.py) finds the run's
  workers on Ray. The actor and the `num_rollout_workers` engines are the servers as Ray actors
  (workers/backends/ray_app.py), each in one bundle of the run's placement group
  (`ray_actor_cpus`/`ray_actor_gpus`, `ray_rollout_cpus`/`ray_rollout_gpus`), with `max_restarts=-1`.
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
  the policy version it expects. A call that fails because its worker died (`RayActorError`), or
  that a worker holding another version refuses, is made again after `Workers` healed the worker
  (restore the checkpoint and replay the logged steps; engines load the published weights from
  the object store), up to MAX_HEALS times. The step goes on. A vLLM
  engine's child process that dies reads as a stale engine and heals the same way; one whose Ray
  actor process dies ends itself (it watches its parent), and the restarted actor starts another.

The storage root is a URL every node reaches (s3://, gs://) or a folder every node mounts at the
same path (NFS, a cluster filesystem); `check_ray_ready` asks each node whether it reaches it.
The actor writes and commits its checkpoints there itself; on a URL root weights go through
Ray's object store (`reload`, `direct`), as the file methods need one path on every node. Project code reaches the workers as the job's `py_modules` (`grpo_flow`
with its `schemas` and `workers`); the libraries (torch, transformers, trl, peft) must be installed on every node.

Ray is imported only here, and this module only when `backend="ray"`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import math
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.backends.ray_app import OBJECT_STORE_METHODS, WORKER_CLASSES, start_actor
from grpo_flow.workers.backends.servers import STATE_DICT
from grpo_flow.workers.backends.weight_sync import check_weight_sync_config
from grpo_flow.workers.backends.workers import Handle, Placement, PublishedWeightsLost
from grpo_flow.workers.state.location import absolute_root, is_url, reach_from_here
from grpo_flow.workers.state.source import stage_package

INSTALL_HINT = 'pip install -e ".[ray]"'
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
    # An object store's endpoint and credentials, where its client reads them (a URL storage_root).
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "GOOGLE_APPLICATION_CREDENTIALS",
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
    """(ray_actor_gpus, ray_rollout_gpus): None means one GPU each (the actor one a rank) on a cluster that has
    GPUs, none otherwise."""
    default = 1.0 if cluster_gpus > 0 else 0.0
    actor = default * config.actor_num_processes if config.ray_actor_gpus is None else config.ray_actor_gpus
    rollout = default if config.ray_rollout_gpus is None else config.ray_rollout_gpus
    return actor, rollout


def resolved_rollout_cpus(config: GRPOFlowConfig, cluster_cpus: float) -> float:
    """ray_rollout_cpus, or its default: 1 each where the cluster has them beside the actor, else an equal share
    of what the actor leaves (in hundredths), so that a `ray start --head` on 2 cores holds the tiny preset."""
    if config.ray_rollout_cpus is not None:
        return config.ray_rollout_cpus
    spare = cluster_cpus - config.ray_actor_cpus
    if spare >= config.num_rollout_workers:
        return 1.0
    share = math.floor(100 * spare / config.num_rollout_workers) / 100
    return share if share > 0 else 1.0  # none left: ask for 1, which check_resources refuses by name


def bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def plan_bundles(config: GRPOFlowConfig, cluster_gpus: float, cluster_cpus: float = math.inf) -> list[dict[str, float]]:
    """The placement group: the actor's bundle, then one per rollout engine."""
    ray_actor_gpus, ray_rollout_gpus = resolved_gpus(config, cluster_gpus)
    ray_rollout_cpus = resolved_rollout_cpus(config, cluster_cpus)
    return [bundle(config.ray_actor_cpus, ray_actor_gpus)] + [
        bundle(ray_rollout_cpus, ray_rollout_gpus) for _ in range(config.num_rollout_workers)
    ]


def check_resources(config: GRPOFlowConfig, nodes: list[dict[str, float]], where: str) -> None:
    """Refuse, naming the resource and the fields, a config the cluster's nodes cannot hold."""
    totals = {name: sum(node.get(name, 0.0) for node in nodes) for name in ("CPU", "GPU")}
    bundles = plan_bundles(config, totals["GPU"], totals["CPU"])
    n = config.num_rollout_workers
    fields = {"GPU": ("ray_actor_gpus", "ray_rollout_gpus"), "CPU": ("ray_actor_cpus", "ray_rollout_cpus")}
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
        if name == "GPU" and config.actor_num_processes > 1 and actor > largest + 1e-9:
            raise RayNotReadyError(
                f"actor_num_processes: the actor's {config.actor_num_processes} ranks run on one node, a GPU each, "
                f"but no node of the Ray cluster at {where} has more than {largest:g} GPU"
            )
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
    check_storage_on_nodes(ray, config)
    if config.rollout_engine == "vllm":
        check_vllm_on_nodes(ray, config)


def check_storage_on_nodes(ray: Any, config: GRPOFlowConfig) -> None:
    """Every live node reaches the storage root, as a small task pinned to it says (0 CPUs): a URL through
    its client there, a local path by a file this process wrote in it (a folder not shared by the nodes
    fails). On a URL root, weights go through Ray's object store: the file methods need one path on every node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    root = absolute_root(config.storage_root)
    if is_url(root) and config.weight_sync_method not in OBJECT_STORE_METHODS:
        raise RayNotReadyError(
            f"weight_sync_method: {config.weight_sync_method!r} hands weights over as files at one path every node "
            f"reads, which a URL storage_root ({root!r}) is not; use 'reload' or 'direct' (Ray's object store)"
        )
    marker = None if is_url(root) else Path(root) / ".storage-check" / f"{config.run_id}-{uuid.uuid4().hex}"
    made: list[Path] = []  # folders the check creates, removed after it: a refused start leaves nothing
    if marker is not None:
        folder = marker.parent
        while not folder.exists():  # deepest first, the order they are removed in
            made.append(folder)
            folder = folder.parent
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("grpo-flow\n")
    probe = ray.remote(num_cpus=0)(reach_from_here)
    try:
        refs = [
            probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
                root, None if marker is None else str(marker), config.storage_options
            )
            for node in ray.nodes()
            if node.get("Alive")
        ]
        answers = ray.get(refs, timeout=PROBE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RayNotReadyError(
            f"storage_root: the Ray cluster's nodes did not say within {PROBE_TIMEOUT_S:.0f} s whether they reach "
            f"{root!r}"
        ) from None
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)
            for folder in made:
                with contextlib.suppress(OSError):  # another run's check may use it now
                    folder.rmdir()
    for answer in answers:
        if answer["problem"]:
            raise RayNotReadyError(storage_problem_message(root, answer))


def storage_problem_message(root: str, answer: dict[str, Any]) -> str:
    """One line: which node cannot reach the storage root, why, and the fix."""
    fix = (
        "check the node's credentials and endpoint (AWS_*, storage_options)"
        if is_url(root)
        else "use a URL every node reaches (s3://..., gs://...) or a folder every node mounts at the same path"
    )
    return f"storage_root: node {answer['host']} cannot reach {root!r} ({answer['problem']}); {fix}"


def check_vllm_on_nodes(ray: Any, config: GRPOFlowConfig) -> None:
    """vLLM engines need vLLM on every node that can hold one: importable by the Ray workers' Python, or
    an environment at `vllm_python` (as each node resolves it). A task on each such node says which
    (0 CPUs: it runs beside whatever holds the node)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from grpo_flow.workers.backends import vllm_env

    live = [node for node in ray.nodes() if node.get("Alive")]
    ray_rollout_gpus = resolved_gpus(config, sum(node["Resources"].get("GPU", 0.0) for node in live))[1]
    ray_rollout_cpus = resolved_rollout_cpus(config, sum(node["Resources"].get("CPU", 0.0) for node in live))
    if config.vllm_enable_sleep_mode and not ray_rollout_gpus:
        raise RayNotReadyError(
            "vllm_enable_sleep_mode: vLLM's sleep mode needs a CUDA GPU, and the run's rollout engines get none "
            "(ray_rollout_gpus 0, or a cluster without GPUs)"
        )
    hosts = [
        node
        for node in live
        if node["Resources"].get("CPU", 0.0) >= ray_rollout_cpus
        and node["Resources"].get("GPU", 0.0) >= ray_rollout_gpus
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


# -- the placement -------------------------------------------------------------------------------------
def lost_errors() -> tuple[type[BaseException], ...]:
    """What says a Ray worker is gone (its process died; Ray restarts it with the initial model)."""
    import ray.exceptions

    return (ray.exceptions.RayActorError,)


class RayHandle:
    """One Ray actor (a server passed to `ray.remote`): a verb is `.remote()` then `ray.get`."""

    def __init__(self, ray: Any, handle: Any, name: str) -> None:
        self.ray, self.handle, self.name = ray, handle, name

    def call(self, verb: str, *args: Any) -> Any:
        """The verb's answer. A worker Ray is restarting is waited for (up to STARTUP_TIMEOUT_S: its process
        start and model load), then asked again: every verb is safe to repeat (they carry versions). This
        is the wait of a heal (Workers heals the restarted worker, which holds the initial model), not a
        layer of retries: a call that failed is retried by its Prefect task."""
        exceptions = self.ray.exceptions
        # A worker's start and model load (a restart too) may take minutes; other calls as long as they take.
        timeout = STARTUP_TIMEOUT_S if verb in ("ready", "initial") else None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                return self.ray.get(getattr(self.handle, verb).remote(*args), timeout=timeout)
            except exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
            except exceptions.ObjectLostError as error:
                raise PublishedWeightsLost(str(error)) from error


class RayPlacement(Placement):
    """The run's workers as Ray actors in a placement group of the run's cluster."""

    check_storage = True  # workers on other nodes must see the storage root
    worker_classes: tuple[type, type] = WORKER_CLASSES  # (actor, rollout): the classes run as Ray actors

    def __init__(self, config: GRPOFlowConfig, model_path: str | Path) -> None:
        resolved = str(Path(model_path).resolve()) if Path(model_path).exists() else str(model_path)
        super().__init__(config, resolved)
        self.ray = connect(config)
        self.lost_errors = lost_errors()
        self.handles: list[RayHandle] = []
        self.placement_group: Any = None
        self.root = absolute_root(config.storage_root)

    def start(self) -> tuple[Handle, list[Handle]]:
        from ray.util.placement_group import placement_group, remove_placement_group

        config = self.config
        assert config.run_id is not None
        nodes = cluster_nodes(self.ray)
        address = cluster_address(config)[0]
        check_resources(config, nodes, address)
        bundles = plan_bundles(
            config, sum(node.get("GPU", 0.0) for node in nodes), sum(node.get("CPU", 0.0) for node in nodes)
        )
        self.placement_group = placement_group(bundles, strategy="PACK", name=f"grpo-flow/{config.run_id}")
        self._remove_placement_group = remove_placement_group
        if not self.placement_group.wait(PLACEMENT_TIMEOUT_S):
            raise RayNotReadyError(
                f"the Ray cluster at {address} did not reserve the run's resources ({bundles}) within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s: other jobs hold them"
            )
        uid = uuid.uuid4().hex[:6]
        # The workers' processes start elsewhere (the node's Ray working folder): a relative root would move.
        config_json = config.model_copy(update={"storage_root": self.root}).model_dump_json()

        def spawn(cls: type, index: int, name: str, *args: Any) -> RayHandle:
            cpus, gpus = bundles[index]["CPU"], bundles[index].get("GPU", 0.0)
            label = f"grpo-flow/{config.run_id}/{uid}/{name}"
            handle = RayHandle(
                self.ray, start_actor(self.ray, cls, label, cpus, gpus, self.placement_group, index, *args), name
            )
            self.handles.append(handle)
            return handle

        actor_cls, rollout_cls = self.worker_classes
        actor = spawn(actor_cls, 0, "actor", config_json, self.model_path)
        rollout: list[Handle] = [
            spawn(rollout_cls, i + 1, f"rollout-{i}", config_json, self.model_path, i)
            for i in range(config.num_rollout_workers)
        ]
        return actor, rollout

    def parallel(self, calls: Sequence[Callable[[], Any]]) -> list[Any]:
        if len(calls) <= 1:
            return [call() for call in calls]
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            return list(pool.map(lambda call: call(), calls))

    def weights_method(self) -> str:
        """`reload` and `direct` move a state dict through the object store; the rest files on the storage root."""
        method = self.config.weight_sync_method
        return STATE_DICT if method in OBJECT_STORE_METHODS else method

    def publish(self, actor: Any, version: int, method: str) -> tuple[Any, dict[str, Any]]:
        """The weights stay in the object store of the actor's node (owned by this process, so they outlive
        the actor's process); every engine takes that one stored copy."""
        weights, info = actor.handle.publish.options(num_returns=2).remote(version, method)
        return weights, self.ray.get(info)

    def fetch(self, held: Any) -> Any:
        return self.ray.get(held)

    def hold(self, weights: Any) -> Any:
        return self.ray.put(weights)

    def close(self) -> None:
        """Stop the run's Ray actors and free its placement group (the cluster keeps running). The rollout
        workers first end their engines (a vLLM engine's process gives its GPU memory back); one that does
        not answer within SHUTDOWN_TIMEOUT_S is killed with its actor (its engine process then ends itself)."""
        with contextlib.suppress(Exception):
            refs = [h.handle.shutdown.remote() for h in self.handles[1:]]
            if refs:
                self.ray.wait(refs, num_returns=len(refs), timeout=SHUTDOWN_TIMEOUT_S)
        for handle in self.handles:
            with contextlib.suppress(Exception):
                self.ray.kill(handle.handle, no_restart=True)
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                self._remove_placement_group(self.placement_group)


__all__ = ["RayNotReadyError", "RayPlacement", "check_ray_ready"]
