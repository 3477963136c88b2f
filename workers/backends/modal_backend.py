"""The Modal backend: the `LocalWorkers` surface over the remote classes of workers/backends/modal_app.py.

- `ModalWorkers(config, model_path)`: `.actor.step(expected_version, rollouts)`,
  `.actor.save_checkpoint(folder)`, `.rollout[i].generate(prompts, params, max_prompt_length)`,
  `.sync_weights() -> int`, as `grpo_flow.workers.backends.local.LocalWorkers` has them, plus GPU-seconds per role
  (`gpu_seconds/actor`, `gpu_seconds/rollout`: the wall time of each remote call times the GPUs
  of its container, summed over the run; returned with every actor step's metrics).
  `mode="remote"` runs the app (`app.run()`) and calls `.remote()`; `mode="local"` calls
  `.local()` on the same classes in this process (how the tests run it, on CPU).
- `check_modal_ready(config)`: before anything starts, a clear error when Modal credentials are
  missing or a named Secret does not exist (the Secret lookup needs the network, so it is
  injectable).
- `ModalSandboxExecutor`: reward code in a `modal.Sandbox` with no network, with the local
  sandbox's interface (workers/rewards/sandbox.py): `run(code, stdin=, timeout_s=, files=)` and
  `run_batch(...)` return its `SandboxResult`.

UNTESTED HERE (Modal's cloud is unreachable from this machine): `mode="remote"`, uploading a
local model folder to the Volume, the default Secret lookup, and the sandbox against real
Modal. The sandbox executor is tested with a fake `Sandbox.create`; the rest offline.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping, Sequence

import modal

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.backends.registry import RunWorkers
from grpo_flow.workers.backends.modal_app import (
    APP_NAME,
    SANDBOX_TIMEOUT_S,
    VOLUME_PATH,
    WorkerApp,
    build_worker_app,
    worker_config_json,
)
from grpo_flow.workers.state.resume import replay_actor_to
from grpo_flow.workers.rollout.base import GenerationResult, SamplingParams
from grpo_flow.workers.state.storage import file_matches
from grpo_flow.workers.backends.weight_sync import WeightPayload, check_weight_sync_config

Mode = Literal["remote", "local"]
REMOTE_MODELS_DIR = "models"  # local model folders are uploaded to <volume>/models/<name>
VOLUME_CHECKPOINT_POINTER = "volume_checkpoint.json"
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


# -- the facade ---------------------------------------------------------------------------------------
Call = Callable[..., Any]


class RemoteActor:
    """`Actor`'s surface (step, save_checkpoint, policy_version) over `ActorWorker`."""

    def __init__(self, workers: ModalWorkers, handle: Any) -> None:
        self._workers = workers
        self._handle = handle
        self.policy_version = 0

    def _call(self, method: str, *args: Any) -> Any:
        with self._workers.meter.timed("actor", self._workers.config.actor_gpu_count):
            return self._workers.call(getattr(self._handle, method), *args)

    def load(self) -> int:
        self.policy_version = self._call("load")["policy_version"]
        return self.policy_version

    def step(self, expected_version: int, rollouts: Any) -> dict[str, float]:
        """One optimizer step on the remote actor; its metrics plus the run's GPU-seconds so far."""
        metrics = self._call("step", expected_version, rollouts)
        self.policy_version = expected_version + 1
        return {**metrics, **self._workers.meter.metrics()}

    def save_checkpoint(self, folder: Path) -> dict[str, Any]:
        """Write the checkpoint where the worker's storage root mirrors `folder` (the Volume, remotely).

        Remotely the files stay on the Volume (a 0.5B model's optimizer state is GBs); `folder`
        gets a pointer file with the Volume path and each file's size and sha256, so the local
        checkpoint manifest still names a complete checkpoint.
        """
        relative = self._workers.relative_to_storage_root(Path(folder))
        result = self._call("save_checkpoint", relative)
        if self._workers.mode == "remote":
            pointer = {"volume": self._workers.config.modal_volume, "path": result["folder"], "files": result["files"]}
            (Path(folder) / VOLUME_CHECKPOINT_POINTER).write_text(json.dumps(pointer, indent=2, sort_keys=True))
        return result["state"]

    def publish_weights(self, method: str) -> WeightPayload:
        return self._call("publish_weights", method)

    def restore(self, folder: Path | None) -> int:
        """Back to the checkpoint in `folder` (read from the Volume remotely), or the initial model."""
        relative = None if folder is None else self._workers.relative_to_storage_root(Path(folder))
        self.policy_version = self._call("restore", relative)["policy_version"]
        return self.policy_version

    def reset(self) -> int:
        return self.restore(None)


class RemoteRollout:
    """A rollout engine's surface (generate, policy_version, worker_id, tokenizer) over `RolloutWorker` i."""

    def __init__(self, workers: ModalWorkers, handle: Any, index: int) -> None:
        self._workers = workers
        self._handle = handle
        self.index = index
        self.worker_id = f"rollout-{index}"
        self.policy_version = 0
        self.started = False  # its engine was started (load), so a `.local()` run must end it
        self._tokenizer: Any = None

    def _call(self, method: str, *args: Any) -> Any:
        with self._workers.meter.timed("rollout", 1):
            return self._workers.call(getattr(self._handle, method), *args)

    @property
    def tokenizer(self) -> Any:
        """A local copy of the tokenizer, loaded on first use (results also carry `extra['prompt_texts']`)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._workers.model_path)
        return self._tokenizer

    def load(self) -> int:
        self.policy_version = self._call("policy_version")
        self.started = True
        return self.policy_version

    def close(self) -> None:
        """End a `.local()` worker's engine (a remote one ends with its container)."""
        if self._workers.mode == "local" and self.started:
            self._call("shutdown")
            self.started = False

    def generate(
        self, prompts: Sequence[Any], params: SamplingParams, max_prompt_length: int | None = None
    ) -> GenerationResult:
        result: GenerationResult = self._call("generate", list(prompts), params, max_prompt_length)
        self.policy_version = result.extra.get("policy_version", self.policy_version)
        return result

    def sync_weights(self, payload: WeightPayload) -> dict[str, Any]:
        report = self._call("sync_weights", payload.method, payload.version, payload.path, payload.data, payload.nbytes)
        self.policy_version = payload.version
        return report

    def reset(self) -> int:
        self.policy_version = self._call("reset")
        return self.policy_version


class ModalWorkers:
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
    ) -> None:
        if mode not in ("remote", "local"):
            raise ValueError(f"mode must be 'remote' or 'local', got {mode!r}")
        self.config = config
        self.model_path = str(model_path)
        self.mode = mode
        self.meter = GpuMeter(clock)
        self.worker_app = worker_app or build_worker_app(config)
        self.last_sync: dict[str, Any] = {}
        # Inside the containers the storage root is the Volume; locally it is the config's folder.
        self.worker_storage_root = VOLUME_PATH if mode == "remote" else str(config.storage_root)
        self.last_payload: WeightPayload | None = None
        self._exit = ExitStack()
        if mode == "remote":
            self._exit.enter_context(self.worker_app.app.run(detach=config.detach))
        try:
            self._start_workers(rollout_device, actor_device)
        except BaseException:
            self._exit.close()  # stop the app: nothing should keep running for workers that never started
            raise

    def _start_workers(self, rollout_device: str, actor_device: str) -> None:
        config = self.config
        worker_model_path = self._model_path_for_workers()
        config_json = worker_config_json(config)
        self.actor = RemoteActor(
            self,
            self.worker_app.actor_cls(
                config_json=config_json,
                model_path=worker_model_path,
                device=actor_device,
                storage_root=self.worker_storage_root,
            ),
        )
        self.rollout = [
            RemoteRollout(
                self,
                self.worker_app.rollout_cls(
                    config_json=config_json,
                    model_path=worker_model_path,
                    worker_index=i,
                    engine=config.rollout_engine,
                    device=rollout_device,
                    storage_root=self.worker_storage_root,
                ),
                i,
            )
            for i in range(config.num_rollout_workers)
        ]
        # Start every container at once (cold starts overlap) and learn what each one holds.
        self.parallel([self.actor.load, *(engine.load for engine in self.rollout)])

    # -- plumbing --------------------------------------------------------------------------------------
    def call(self, method: Any, *args: Any) -> Any:
        return method.remote(*args) if self.mode == "remote" else method.local(*args)

    def parallel(self, calls: Sequence[Callable[[], Any]]) -> list[Any]:
        """Remote calls at once (each is a blocking `.remote()` on its own thread); local ones in turn."""
        if self.mode == "local" or len(calls) <= 1:
            return [fn() for fn in calls]
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            return list(pool.map(lambda fn: fn(), calls))

    def relative_to_storage_root(self, folder: Path) -> str:
        root = Path(self.config.storage_root).resolve()
        try:
            return str(folder.resolve().relative_to(root))
        except ValueError:
            raise ValueError(f"{folder} is not under the run's storage_root {root}") from None

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

    # -- the LocalWorkers surface ------------------------------------------------------------------------
    def sync_weights(self) -> int:
        """Publish the actor's weights by `weight_sync_method`, load them on every rollout worker; the version."""
        started = time.perf_counter()
        payload = self.actor.publish_weights(self.config.weight_sync_method)
        self.last_payload = payload
        reports = self.parallel([functools.partial(engine.sync_weights, payload) for engine in self.rollout])
        self.last_sync = {
            "method": payload.method,
            "version": payload.version,
            "bytes": sum(r.get("bytes", 0) for r in reports),
            "seconds": time.perf_counter() - started,
        }
        return payload.version

    # -- LocalWorkers' resume and self-healing surface ----------------------------------------------------
    def restore(self, storage: Any, checkpoint_step: int | None) -> int:
        """Actor and rollout workers as they were at a checkpoint (or the start); returns the rollout version.

        The actor worker restores the checkpoint from the Volume. Rollout workers get the actor's
        weights by the run's sync method, or, when the checkpoint was written while they lagged
        (sync_weights_every > 1), the versioned weights the checkpoint names.
        """
        if checkpoint_step is None:
            self.actor.restore(None)
            self.parallel([engine.reset for engine in self.rollout if engine.policy_version != 0])
            self.last_payload = None
            return 0
        manifest = storage.verify_checkpoint(checkpoint_step)
        self.actor.restore(storage.checkpoint_dir(checkpoint_step))
        rollout_version = manifest.get("rollout_policy_version", self.actor.policy_version)
        if rollout_version == self.actor.policy_version:
            return self.sync_weights()
        path = manifest.get("rollout_weights")
        method = self.config.weight_sync_method
        if path is None or method in ("reload", "direct"):
            raise RuntimeError(
                f"checkpoint {checkpoint_step} was written while the rollout workers held policy version "
                f"{rollout_version} and the actor {self.actor.policy_version}; with weight_sync_method {method!r} "
                "those weights were not kept (their file is overwritten or never written), so this resume would "
                "not be exact. Resume from an earlier checkpoint, or use 'volume', 'checkpoint' or 'lora'."
            )
        payload = WeightPayload(method, rollout_version, path=path)
        self.parallel([functools.partial(engine.sync_weights, payload) for engine in self.rollout])
        self.last_payload = payload
        return rollout_version

    def ensure_actor_version(self, version: int, storage: Any) -> None:
        """Bring the remote actor to `version`: restore the newest checkpoint at or before it, replay the
        logged steps since (each step call carries the version it expects, as locally)."""
        if self.actor.policy_version == version:
            return
        logger.warning(
            "Modal actor holds version %s, expected %d: restoring and replaying", self.actor.policy_version, version
        )
        replay_actor_to(self.actor, version, storage)

    def ensure_rollout_version(self, index: int, version: int, storage: Any) -> RemoteRollout:
        """Rollout worker `index`, holding `version` (synced from the actor when it holds that version)."""
        engine = self.rollout[index]
        if engine.policy_version != version:
            self.ensure_actor_version(version, storage)
            engine.sync_weights(self.actor.publish_weights(self.config.weight_sync_method))
        return engine

    def save_rollout_weights(self, folder: Path) -> dict[str, Any]:
        """What a checkpoint records of the rollout workers: their version, and where its weights are."""
        versions = {engine.policy_version for engine in self.rollout}
        version = min(versions) if versions else 0
        state: dict[str, Any] = {"rollout_policy_version": version}
        if version != self.actor.policy_version and self.last_payload and self.last_payload.version == version:
            state["rollout_weights"] = self.last_payload.path  # on the Volume (None for `direct`)
        return state

    def gpu_seconds(self) -> dict[str, float]:
        return self.meter.metrics()

    def close(self) -> None:
        """End `.local()` engines (their processes are this process's children), stop the app (remote
        mode); the Volume keeps everything written."""
        try:
            for engine in getattr(self, "rollout", []):
                engine.close()
        finally:
            self._exit.close()

    def __enter__(self) -> ModalWorkers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_WORKERS: RunWorkers[ModalWorkers] = RunWorkers()


def open_volume(name: str) -> Any:
    """The named Modal Volume, as `modal.Volume.from_name` gives it (tests put a fake in its place)."""
    return modal.Volume.from_name(name)


def checkpoint_model_dir(checkpoint_dir: Path, cache_root: Path) -> Path:
    """A checkpoint's `model/` folder on this machine.

    The local backend writes it into the checkpoint. The Modal actor leaves the files on the
    Volume and writes a pointer (VOLUME_CHECKPOINT_POINTER) instead. Those files are then
    downloaded once into `cache_root` (never into the run's own folders), each one checked
    against the pointer's size and sha256.
    """
    local = checkpoint_dir / "model"
    pointer_path = checkpoint_dir / VOLUME_CHECKPOINT_POINTER
    if local.is_dir() or not pointer_path.exists():
        return local
    pointer = json.loads(pointer_path.read_text())
    wanted = {name: spec for name, spec in pointer["files"].items() if name.startswith("model/")}
    if not wanted:
        raise FileNotFoundError(f"{pointer_path} lists no model/ files on Volume {pointer['volume']!r}")
    remote_folder = Path(pointer["path"]).relative_to(VOLUME_PATH)  # Volume paths are relative to its root
    target = cache_root / "volume-checkpoints" / pointer["volume"] / remote_folder
    if all(file_matches(target / name, spec) for name, spec in wanted.items()):
        return target / "model"
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
    return target / "model"


def modal_workers(config: GRPOFlowConfig, model_path: str | Path, **kwargs: Any) -> ModalWorkers:
    """The run's Modal workers, started on first use (as `grpo_flow.workers.backends.local.local_workers`)."""
    assert config.run_id is not None
    return _WORKERS.get(config.run_id, lambda: ModalWorkers(config, model_path, **kwargs))


def release(run_id: str) -> None:
    _WORKERS.release(run_id)


# -- reward code in a Modal Sandbox -----------------------------------------------------------------------
try:  # the local sandbox's result and limits (workers/rewards/sandbox.py), so both sandboxes answer alike
    from grpo_flow.workers.rewards.sandbox import SCRIPT_NAME, SandboxLimits, SandboxResult
except ImportError:  # pragma: no cover - a checkout without the local sandbox
    SCRIPT_NAME = "main.py"

    @dataclass(frozen=True)
    class SandboxLimits:  # type: ignore[no-redef]
        timeout_s: float = 10.0
        output_bytes: int = 64 << 10

    @dataclass(frozen=True)
    class SandboxResult:  # type: ignore[no-redef]
        stdout: str
        stderr: str
        exit_code: int | None
        signal: str | None
        wall_s: float
        timed_out: bool
        stdout_truncated: bool = False
        stderr_truncated: bool = False

        @property
        def ok(self) -> bool:
            return self.exit_code == 0 and not self.timed_out


# Run inside the sandbox as `python -I -B -c BOOTSTRAP`. The first line of stdin is a JSON payload
# (the code and its files: an argv string is capped at 128 KiB by Linux, stdin is not); the rest
# of stdin is the program's. The code runs as main.py in a fresh directory, as in LocalSandbox.
BOOTSTRAP = """\
import json, os, runpy, sys, tempfile
payload = json.loads(sys.stdin.readline())
work = tempfile.mkdtemp(prefix="run-")
for name, text in {**payload["files"], payload["script"]: payload["code"]}.items():
    path = os.path.join(work, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(text)
os.chdir(work)
sys.path.insert(0, work)
sys.argv = [payload["script"]]
runpy.run_path(payload["script"], run_name="__main__")
"""


def _capped(text: str, limit: int) -> tuple[str, bool]:
    data = text.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return text, False
    return data[:limit].decode("utf-8", errors="ignore"), True


def _exit_status(returncode: int) -> tuple[int | None, str | None, bool]:
    """(exit_code, signal, timed_out) from Modal's return code.

    Modal reports an exec that passed its timeout as -1, and a process ended by signal N as
    128 + N (modal/container_process.py), the shell's convention; a program that exits with
    such a status itself reads the same.
    """
    import signal

    if returncode == -1:
        return None, "SIGKILL", True
    if returncode > 128:
        try:
            return None, signal.Signals(returncode - 128).name, False
        except ValueError:
            pass
    return returncode, None, False


class ModalSandboxExecutor:
    """LocalSandbox's `run` / `run_batch` in a `modal.Sandbox` with the network blocked (UNTESTED against real Modal).

    One sandbox is created on first use and reused for every run (each run is a new process
    in a fresh directory of it: `sb.exec("python", "-I", "-B", "-c", BOOTSTRAP, timeout=...)`),
    since creating one costs seconds; `reuse=False` gives each run a sandbox of its own. The
    limits are the sandbox's (its `cpu`, `memory_mib`, lifetime) plus the wall clock per run
    and the output cap of `SandboxLimits`.
    """

    def __init__(
        self,
        app: modal.App | None = None,
        image: modal.Image | None = None,
        *,
        limits: SandboxLimits | None = None,
        sandbox_timeout_s: int = SANDBOX_TIMEOUT_S,
        cpu: float = 1.0,
        memory_mib: int = 1024,
        reuse: bool = True,
        max_workers: int = 4,
        create: Callable[..., Any] | None = None,
    ) -> None:
        self.app = app
        self.image = image
        self.limits = limits or SandboxLimits()
        self.sandbox_timeout_s = sandbox_timeout_s
        self.cpu = cpu
        self.memory_mib = memory_mib
        self.reuse = reuse
        self.max_workers = max_workers
        self._create = create or modal.Sandbox.create
        self._sandbox: Any = None
        self._lock = threading.Lock()

    def _new_sandbox(self) -> Any:
        if self.app is None:  # a sandbox belongs to an app; outside a running one, look it up (network)
            self.app = modal.App.lookup(f"{APP_NAME}-sandbox", create_if_missing=True)
        if self.image is None:
            from grpo_flow.workers.backends.modal_app import sandbox_image

            self.image = sandbox_image()
        return self._create(
            app=self.app,
            image=self.image,
            timeout=self.sandbox_timeout_s,
            block_network=True,
            cpu=self.cpu,
            memory=self.memory_mib,
        )

    def _acquire(self) -> Any:
        if not self.reuse:
            return self._new_sandbox()
        with self._lock:
            if self._sandbox is None:
                self._sandbox = self._new_sandbox()
            return self._sandbox

    def run(
        self, code: str, *, stdin: str = "", timeout_s: float | None = None, files: Mapping[str, str] | None = None
    ) -> SandboxResult:
        """Run `code` as main.py in a fresh directory holding `files`; `timeout_s` overrides the limit."""
        timeout = self.limits.timeout_s if timeout_s is None else timeout_s
        payload = json.dumps({"code": code, "files": dict(files or {}), "script": SCRIPT_NAME})
        sandbox = self._acquire()
        started = time.perf_counter()
        try:
            process = sandbox.exec("python", "-I", "-B", "-c", BOOTSTRAP, timeout=max(1, math.ceil(timeout)))
            process.stdin.write(payload + "\n" + stdin)
            process.stdin.write_eof()
            process.stdin.drain()
            stdout, stdout_truncated = _capped(process.stdout.read(), self.limits.output_bytes)
            stderr, stderr_truncated = _capped(process.stderr.read(), self.limits.output_bytes)
            exit_code, signal_name, timed_out = _exit_status(process.wait())
        finally:
            if not self.reuse:
                sandbox.terminate()
        return SandboxResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=exit_code,
            signal=signal_name,
            wall_s=time.perf_counter() - started,
            timed_out=timed_out,
            stdout_truncated=stdout_truncated,
            stderr_truncated=stderr_truncated,
        )

    def run_batch(
        self,
        codes: Sequence[str],
        *,
        stdins: Sequence[str] | None = None,
        timeout_s: float | None = None,
        files: Mapping[str, str] | None = None,
    ) -> list[SandboxResult]:
        """Each program (at most `max_workers` at a time, as processes of the one sandbox); results in order."""
        if stdins is not None and len(stdins) != len(codes):
            raise ValueError(f"{len(stdins)} stdins for {len(codes)} programs")
        stdins = list(stdins) if stdins is not None else [""] * len(codes)
        if not codes:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(codes))) as pool:
            return list(
                pool.map(
                    lambda pair: self.run(pair[0], stdin=pair[1], timeout_s=timeout_s, files=files),
                    zip(codes, stdins, strict=True),
                )
            )

    def close(self) -> None:
        with self._lock:
            if self._sandbox is not None:
                self._sandbox.terminate()
                self._sandbox = None
