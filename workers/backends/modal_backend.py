"""The Modal backend: the servers as Modal classes (workers/backends/modal_app.py), and where a run finds them.

- `ModalPlacement(config, model_path)`: the placement `Workers` (workers/backends/workers.py) runs
  the run's workers through. `mode="remote"` runs the app (`app.run()`) and calls `.remote()`;
  `mode="local"` calls `.local()` on the same classes in this process (how the tests run it, on
  CPU). Every actor step's metrics carry GPU-seconds per role (`gpu_seconds/actor`,
  `gpu_seconds/rollout`: the wall time of each remote call times the GPUs of its container, summed
  over the run). On a folder root checkpoints stay on the Volume and the local checkpoint folder gets a
  pointer; on a URL root (`s3://`, `gs://`) the workers use the bucket as the flow does, and the actor's
  checkpoint there is the run's (no pointer, no copy), as with the local and Ray backends.
- `check_modal_ready(config)`: before anything starts, a clear error when Modal credentials are
  missing or a named Secret does not exist (the Secret lookup needs the network, so it is
  injectable).

UNTESTED HERE (Modal's cloud is unreachable from this machine): `mode="remote"`, uploading a
local model folder to the Volume, the default Secret lookup, and the sandbox against real Modal.
Reward code runs in a Modal Sandbox through workers/rewards/modal_sandbox.py.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping, Sequence

import modal

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.backends.modal_app import (
    VOLUME_PATH,
    WorkerApp,
    build_worker_app,
    url_root_problem,
    worker_config_json,
)
from grpo_flow.workers.state.location import is_url
from grpo_flow.workers.state.storage import RunStorage, file_matches
from grpo_flow.workers.backends.weight_sync import check_weight_sync_config
from grpo_flow.workers.backends.workers import Handle, Placement

Mode = Literal["remote", "local"]
REMOTE_MODELS_DIR = "models"  # local model folders are uploaded to <volume>/models/<name>
VOLUME_CHECKPOINT_POINTER = "volume_checkpoint.json"
MODEL_FILES = ("model/", "adapter/", "base_model.json")  # what evaluation and export read of a checkpoint
logger = logging.getLogger("grpo_flow.workers")


# -- readiness ---------------------------------------------------------------------------------------
class ModalNotReadyError(RuntimeError):
    """Modal cannot run this config: no credentials, or a named Secret is missing."""


def modal_credentials_found(env: Mapping[str, str] | None = None, config_path: str | os.PathLike | None = None) -> bool:
    """MODAL_TOKEN_ID and MODAL_TOKEN_SECRET in the environment, or a profile with a token in ~/.modal.toml."""
    env = os.environ if env is None else env
    if env.get("MODAL_TOKEN_ID") and env.get("MODAL_TOKEN_SECRET"):
        return True
    path = Path(config_path or env.get("MODAL_CONFIG_PATH") or "~/.modal.toml").expanduser()
    if not path.is_file():
        return False
    import toml  # what modal itself reads its config with

    try:
        profiles = toml.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return any(isinstance(p, dict) and p.get("token_id") and p.get("token_secret") for p in profiles.values())


def lookup_secret(name: str) -> None:
    """Raises modal.exception.NotFoundError if the Secret does not exist (needs the network)."""
    modal.Secret.from_name(name).hydrate()


def check_modal_ready(
    config: GRPOFlowConfig,
    *,
    secret_lookup: Callable[[str], None] = lookup_secret,
    env: Mapping[str, str] | None = None,
    config_path: str | os.PathLike | None = None,
) -> None:
    """Everything the Modal backend needs before any container starts, or one clear error."""
    check_weight_sync_config(config)
    if problem := url_root_problem(config):
        raise ModalNotReadyError(": ".join(problem))
    if not modal_credentials_found(env, config_path):
        raise ModalNotReadyError(
            "backend 'modal': no Modal credentials found (MODAL_TOKEN_ID and MODAL_TOKEN_SECRET are not set and "
            "~/.modal.toml has no token); run `modal token new` or set both variables"
        )
    missing = []
    for name in config.modal_secrets:
        try:
            secret_lookup(name)
        except modal.exception.NotFoundError:
            missing.append(name)
    if missing:
        names = ", ".join(repr(n) for n in missing)
        raise ModalNotReadyError(
            f"modal_secrets: Modal Secret {names} not found in the active Modal environment; create it with "
            f"`modal secret create {missing[0]} KEY=VALUE` or remove it from modal_secrets"
        )


# -- GPU-seconds per role ----------------------------------------------------------------------------
class GpuMeter:
    """GPU-seconds per role: wall time of each remote call x the GPUs of its container.

    Measured on the caller's side, so it includes queueing and cold starts (an upper bound of
    the billed compute for those calls) and leaves out idle warm time (scaledown_window).
    """

    ROLES = ("actor", "rollout")

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds = {role: 0.0 for role in self.ROLES}
        self._lock = threading.Lock()

    @contextmanager
    def timed(self, role: str, gpus: int) -> Iterator[None]:
        started = self.clock()
        try:
            yield
        finally:
            elapsed = self.clock() - started
            with self._lock:
                self.seconds[role] += elapsed * gpus

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return {f"gpu_seconds/{role}": seconds for role, seconds in self.seconds.items()}


# -- the placement ------------------------------------------------------------------------------------
class ModalHandle:
    """One wrapped worker (`modal.Cls` instance): a verb is `.remote()` (or `.local()`), timed as GPU-seconds."""

    def __init__(self, placement: ModalPlacement, instance: Any, name: str, role: str, gpus: int) -> None:
        self.placement, self.instance, self.name, self.role, self.gpus = placement, instance, name, role, gpus

    def call(self, verb: str, *args: Any) -> Any:
        method = getattr(self.instance, verb)
        with self.placement.meter.timed(self.role, self.gpus):
            return method.remote(*args) if self.placement.mode == "remote" else method.local(*args)


class ModalPlacement(Placement):
    """The run's workers on Modal (or, with mode='local', the same wrapped classes in this process)."""

    def __init__(
        self,
        config: GRPOFlowConfig,
        model_path: str | Path,
        *,
        mode: Mode = "remote",
        rollout_device: str = "cuda",
        actor_device: str = "cuda",
        worker_app: WorkerApp | None = None,
        clock: Callable[[], float] = time.perf_counter,
        mount: Callable[[str], str] | None = None,
    ) -> None:
        """`mount`: with mode='local', each worker's storage root by its name (a Volume double's container
        views, tests/workers/backends/volume_double.py); by default every worker shares the config's."""
        if mode not in ("remote", "local"):
            raise ValueError(f"mode must be 'remote' or 'local', got {mode!r}")
        super().__init__(config, model_path)
        self.mode = mode
        self.devices = (actor_device, rollout_device)
        self.meter = GpuMeter(clock)
        self.worker_app = worker_app or build_worker_app(config)
        self.mount = mount
        self.handles: list[Handle] = []
        self._exit = ExitStack()

    def start(self) -> tuple[Handle, list[Handle]]:
        config = self.config
        if self.mode == "remote":
            self._exit.enter_context(self.worker_app.app.run(detach=config.detach))
        model_path, config_json = self._model_path_for_workers(), worker_config_json(config)
        actor_device, rollout_device = self.devices
        actor = ModalHandle(
            self,
            self.worker_app.actor_cls(
                config_json=config_json,
                model_path=model_path,
                device=actor_device,
                storage_root=self.worker_storage_root("actor"),
            ),
            "actor",
            "actor",
            config.modal_actor_gpu_count,
        )
        rollout: list[Handle] = [
            ModalHandle(
                self,
                self.worker_app.rollout_cls(
                    config_json=config_json,
                    model_path=model_path,
                    worker_index=i,
                    device=rollout_device,
                    storage_root=self.worker_storage_root(f"rollout-{i}"),
                ),
                f"rollout-{i}",
                "rollout",
                1,
            )
            for i in range(config.num_rollout_workers)
        ]
        self.handles = [actor, *rollout]
        # Start every container at once: their cold starts overlap (Workers.start then asks each again).
        self.parallel([functools.partial(h.call, "ready", None) for h in self.handles])
        return actor, rollout

    def parallel(self, calls: Sequence[Callable[[], Any]]) -> list[Any]:
        """Remote calls at once (each a blocking `.remote()` on its own thread); local ones in turn."""
        if self.mode == "local" or len(calls) <= 1:
            return [call() for call in calls]
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            return list(pool.map(lambda call: call(), calls))

    def worker_storage_root(self, worker: str) -> str:
        """A URL root as it is (each container reaches the bucket); a folder root is the Volume inside a
        container, locally the config's folder, or `mount`'s."""
        if is_url(self.config.storage_root):
            return self.config.storage_root
        if self.mode == "remote":
            return VOLUME_PATH
        return self.mount(worker) if self.mount else str(self.config.storage_root)

    def worker_storage_differs(self) -> bool:
        """Whether the workers see the run's storage elsewhere than this process (the Volume; a bucket is the
        same for both)."""
        return not is_url(self.config.storage_root) and (self.mode == "remote" or self.mount is not None)

    def weights_method(self) -> str:
        """The run's method; on a URL root `reload` becomes `direct`: the containers share no folder for its file
        (`url_root_problem` refuses the other file methods there)."""
        method = self.config.sync_method
        return "direct" if method == "reload" and is_url(self.config.storage_root) else method

    def checkpoint_written(
        self, storage: RunStorage, step: int, answer: dict[str, Any], files: dict[str, bytes]
    ) -> None:
        """The actor wrote and committed `checkpoints/step-N` on the Volume (a 0.5B model's optimizer state
        is GBs: it stays there; on a URL root the bucket's checkpoint is the run's, and nothing is left to do). The run's own folder gets a checkpoint of its own, committed the same way,
        holding a pointer with the Volume path and each file's size and sha256, the actor's manifest fields
        and `files` (`checkpoint_model_files` fetches the model through it; a resume restores from the path)."""
        if not self.worker_storage_differs():
            return
        manifest = answer["manifest"]
        pointer = {
            "volume": self.config.modal_volume,
            "path": f"{VOLUME_PATH}/{answer['folder']}",
            "files": manifest["files"],
        }

        def write(folder: Path) -> dict[str, Any]:
            (folder / VOLUME_CHECKPOINT_POINTER).write_text(json.dumps(pointer, indent=2, sort_keys=True))
            for name, data in files.items():
                (folder / name).write_bytes(data)
            return {k: v for k, v in manifest.items() if k not in ("step", "files")}

        storage.write_checkpoint(step, write)

    def checkpoints_pruned(self, storage: RunStorage, steps: list[int]) -> None:
        """The Volume's copies of the pruned checkpoints go too (the Volume would otherwise keep them all)."""
        if not self.worker_storage_differs():
            return
        volume = open_volume(self.config.modal_volume)
        for step in steps:
            folder = storage.checkpoint_dir(step)
            volume.remove_file(f"/runs/{storage.run_id}/checkpoints/{folder.name}", recursive=True)

    def step_metrics(self) -> dict[str, float]:
        return self.meter.metrics()

    def _model_path_for_workers(self) -> str:
        """A hub id as is (downloaded into HF_HOME on the Volume); a local folder uploaded to the Volume once."""
        local = Path(self.model_path)
        if self.mode == "local" or not local.is_dir():
            return self.model_path
        remote = f"/{REMOTE_MODELS_DIR}/{local.name}"
        volume = self.worker_app.volume
        try:
            present = any(entry.path.endswith("config.json") for entry in volume.listdir(remote))
        except (modal.exception.NotFoundError, FileNotFoundError):
            present = False
        if not present:
            with volume.batch_upload(force=True) as batch:
                batch.put_directory(str(local), remote)
        return f"{VOLUME_PATH}{remote}"

    def close(self) -> None:
        """End `.local()` engines (their processes are this process's children), stop the app (remote
        mode); the Volume keeps everything written."""
        try:
            if self.mode == "local":
                for handle in self.handles[1:]:
                    with contextlib.suppress(Exception):
                        handle.call("shutdown")
        finally:
            self._exit.close()


def open_volume(name: str) -> Any:
    """The named Modal Volume, as `modal.Volume.from_name` gives it (tests put a fake in its place)."""
    return modal.Volume.from_name(name)


def checkpoint_model_files(checkpoint_dir: Path, cache_root: Path) -> Path:
    """A checkpoint folder on this machine holding its model's files (MODEL_FILES: a full fine-tune's
    `model/`, a LoRA run's `adapter/` and `base_model.json`).

    The local backend writes them into the checkpoint. The Modal actor leaves the files on the
    Volume and writes a pointer (VOLUME_CHECKPOINT_POINTER) instead. Those files are then
    downloaded once into `cache_root` (never into the run's own folders), each one checked
    against the pointer's size and sha256.
    """
    pointer_path = checkpoint_dir / VOLUME_CHECKPOINT_POINTER
    if not pointer_path.exists():
        return checkpoint_dir
    pointer = json.loads(pointer_path.read_text())
    wanted = {name: spec for name, spec in pointer["files"].items() if name.startswith(MODEL_FILES)}
    if not wanted:
        raise FileNotFoundError(f"{pointer_path} lists no model files on Volume {pointer['volume']!r}")
    remote_folder = Path(pointer["path"]).relative_to(VOLUME_PATH)  # Volume paths are relative to its root
    target = cache_root / "volume-checkpoints" / pointer["volume"] / remote_folder
    if all(file_matches(target / name, spec) for name, spec in wanted.items()):
        return target
    volume = open_volume(pointer["volume"])
    for name, spec in wanted.items():
        destination = target / name
        if file_matches(destination, spec):
            continue
        destination.parent.mkdir(parents=True, exist_ok=True)
        partial = destination.with_name(destination.name + ".partial")
        with open(partial, "wb") as handle:
            for chunk in volume.read_file(str(remote_folder / name)):
                handle.write(chunk)
        if not file_matches(partial, spec):
            partial.unlink()
            raise ValueError(
                f"{name} of checkpoint {pointer['path']} on Volume {pointer['volume']!r} does not match its "
                f"pointer ({spec['bytes']} bytes, sha256 {spec['sha256'][:12]}...): the Volume's copy changed"
            )
        partial.replace(destination)
    return target
