"""The Modal app: the plain workers wrapped in a few lines each (`app.cls`, GPU, image, volume).

Built with no network: images, the Volume and Secrets are lazy handles until the app runs.

- `ActorWorker` wraps `grpo_flow.workers.actor.actor.Actor`: `load`, `step`, `save_checkpoint`,
  `publish_weights` (the Volume is committed after every write).
- `RolloutWorker` wraps a rollout engine (`VLLMRolloutEngine` with rollout_engine='vllm', in an
  image of its own: vLLM's pins cannot share one with the actor's, as locally they cannot share
  an environment; or the transformers engine): `generate`, `sync_weights` (the Volume is
  reloaded before every read), `policy_version`, `reset`. `worker_index` is a
  `modal.parameter()`, so rollout worker i has its own container pool and keeps its engine warm
  between steps.

The GPU type comes from the run's config, but Modal fixes it when a class is decorated; so the
classes below are plain, undecorated classes at module scope, and `build_app(config)`
decorates them for one config (`gpu="H100:2"` from actor_gpu and actor_gpu_count, the
rollout_gpu, timeouts, `modal.Retries`, volume, secrets). Modal supports exactly this: a container imports
the class by name from this module and, finding it undecorated, binds it to the function
definition the app registered (modal/_runtime/user_code_imports.py, "local scope-decoration").
`app` at the bottom is the same app for the default config, for `modal deploy` / `modal shell`.

Tested offline (tests/workers/backends/test_modal_app.py): the app builds, declares these classes with
the GPUs, volume, image, timeouts and retries asked for, and every wrapped method runs with
`Cls(...).method.local(...)` on CPU engines (`.local()` runs `@modal.enter` and the method in
this process; the Volume is not mounted, commit/reload are skipped). With rollout_engine='vllm'
the local run reaches the real vLLM engine through the local vLLM environment (tests/flows/
test_vllm_train.py). UNTESTED HERE (no network to Modal, no GPU): building the CUDA images,
running the classes remotely, Volume commit/reload, and vLLM in a container of its own image.
"""

# No `from __future__ import annotations`: Modal reads the classes' parameter annotations as types.
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import modal

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.backends.vllm_env import CUDA_PACKAGES
from grpo_flow.workers.state.source import package_files

APP_NAME = "grpo-flow"
VOLUME_PATH = "/grpo-storage"  # the storage root inside every container: the run Volume is mounted here
HF_HOME = f"{VOLUME_PATH}/hf-cache"  # hub downloads land on the Volume: one download per model, not per container

CUDA_BASE_IMAGE = "nvidia/cuda:12.8.0-devel-ubuntu22.04"
PYTHON_VERSION = "3.11"  # the local client's, so pickled arguments and results read the same on both sides
# The actor's image (and the transformers rollout engine's): what the project's own tests run with.
GPU_PACKAGES: tuple[str, ...] = (
    "torch==2.13.0",
    "transformers==5.23.0",
    "trl==1.16.0",
    "peft==0.21.2",
    "accelerate==1.15.0",
    "datasets==5.2.0",
    "safetensors==0.8.0",
    "pyarrow==26.0.1",
    "pandas==3.1.1",
    "pydantic==2.14.3",
)
# vLLM rollout engines get an image of their own, as locally an environment of their own: the
# vLLM that `grpo setup-vllm` installs on a CUDA machine, with the torch and transformers it pins.
VLLM_PACKAGES: tuple[str, ...] = CUDA_PACKAGES
LOCAL_SOURCES = ("schemas", "workers")  # of grpo_flow: workers never import Prefect, flows or tasks

# Per attempt (Modal's timeouts are per attempt; a retry gets a fresh one).
ACTOR_TIMEOUT_S = 60 * 60
ROLLOUT_TIMEOUT_S = 30 * 60
STARTUP_TIMEOUT_S = 20 * 60  # image pull + model download + vLLM start
# Idle containers stay up this long, so one run's steps reuse warm engines. min_containers stays 0:
# a kept-warm GPU would go on billing after a detached run ends.
SCALEDOWN_WINDOW_S = 20 * 60
MIN_CONTAINERS = 0
SANDBOX_TIMEOUT_S = 10 * 60


# -- images, volume, secrets ----------------------------------------------------------------------------
def _cuda_image(packages: tuple[str, ...], env: dict[str, str]) -> modal.Image:
    image = (
        modal.Image.from_registry(CUDA_BASE_IMAGE, add_python=PYTHON_VERSION)
        .entrypoint([])  # the CUDA image's entrypoint only prints a banner
        .uv_pip_install(*packages)
        .env({"HF_HOME": HF_HOME, "TOKENIZERS_PARALLELISM": "false", **env})
    )
    # Last: added at container start, no rebuild on code edits. File by file rather than with
    # add_local_python_source, which does not follow the source checkout's links (workers/state/source.py).
    for remote, local in package_files(LOCAL_SOURCES).items():
        if local.is_dir():
            image = image.add_local_dir(local, f"/root/{remote}", ignore=["**/__pycache__"])
        else:
            image = image.add_local_file(local, f"/root/{remote}")
    return image


def gpu_image() -> modal.Image:
    """CUDA base + pinned torch / TRL / transformers + this project's `schemas` and `workers`: the actor."""
    return _cuda_image(GPU_PACKAGES, {})


def vllm_image() -> modal.Image:
    """CUDA base + the pinned vLLM (with the torch and transformers it pins) + `schemas` and `workers`."""
    # Weight sync sends our own module-level function to vLLM's worker process.
    return _cuda_image(VLLM_PACKAGES, {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})


def sandbox_image() -> modal.Image:
    """A bare Python for reward code in `modal.Sandbox` (no project code, no network)."""
    return modal.Image.debian_slim(python_version=PYTHON_VERSION)


def storage_volume(config: GRPOFlowConfig) -> modal.Volume:
    return modal.Volume.from_name(config.modal_volume, create_if_missing=True)


def secrets(config: GRPOFlowConfig) -> list[modal.Secret]:
    return [modal.Secret.from_name(name) for name in config.modal_secrets]


def actor_gpu(config: GRPOFlowConfig) -> str:
    """Modal's `gpu=` string: `A100` or `A100:2` (config validates the type, 1-8 GPUs)."""
    return config.actor_gpu if config.actor_gpu_count == 1 else f"{config.actor_gpu}:{config.actor_gpu_count}"


def worker_config_json(config: GRPOFlowConfig) -> str:
    """The config as the workers get it (a class parameter, <= 16 KiB), unchanged: `backend` stays
    `modal`, so the actor in its container knows its engines are elsewhere (and corrects for them)."""
    return config.model_dump_json()


class VolumeSync:
    """`commit()` / `reload()` of the run Volume inside a container; no-ops when running locally.

    `.local()` calls (tests) run with no Volume mounted and no Modal credentials, so there is
    nothing to commit or reload.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._volume: Any = None

    def _handle(self) -> Any:
        if modal.is_local():
            return None
        if self._volume is None:
            self._volume = modal.Volume.from_name(self.name)
        return self._volume

    def commit(self) -> None:
        if volume := self._handle():
            volume.commit()

    def reload(self) -> None:
        if volume := self._handle():
            volume.reload()


# -- the wrapped workers (plain classes; build_app decorates them) -----------------------------------------
class ActorWorker:
    """The actor in its own GPU container: a few lines around `grpo_flow.workers.actor.actor.Actor`."""

    config_json: str = modal.parameter()
    model_path: str = modal.parameter()
    device: str = modal.parameter(default="cuda")  # "cpu" for `.local()` tests
    storage_root: str = modal.parameter(default=VOLUME_PATH)

    @modal.enter()
    def start(self) -> None:
        from grpo_flow.workers.actor.actor import Actor
        from grpo_flow.workers.state.storage import RunStorage

        self.config = GRPOFlowConfig.model_validate_json(self.config_json)
        self.volume = VolumeSync(self.config.modal_volume)
        self.volume.reload()  # the model may have been uploaded or downloaded by another container
        self.run_dir = RunStorage(self.storage_root, self.config.run_id or "unnamed").run_dir
        self.actor = Actor(self.config, self.model_path, device=self.device)
        self.actor.load()

    @modal.method()
    def load(self) -> dict[str, int]:
        """Start (or find) the container; the policy version it holds."""
        return {"policy_version": self.actor.policy_version}

    @modal.method()
    def step(self, expected_version: int, rollouts: Any) -> dict[str, float]:
        """One optimizer step on a step's rollouts (a pyarrow Table); a retry of a finished step is answered, not re-run."""
        return self.actor.step(expected_version, rollouts)

    @modal.method()
    def save_checkpoint(self, relative_folder: str) -> dict[str, Any]:
        """Write a checkpoint under the storage root (the Volume); its state and file manifest."""
        from grpo_flow.workers.state.storage import file_manifest

        folder = Path(self.storage_root) / relative_folder
        folder.mkdir(parents=True, exist_ok=True)
        state = self.actor.save_checkpoint(folder)
        self.volume.commit()
        return {"state": state, "files": file_manifest(folder), "folder": str(folder)}

    @modal.method()
    def restore(self, relative_folder: str | None) -> dict[str, int]:
        """Back to a checkpoint under the storage root (the Volume), or to the initial model (None)."""
        if relative_folder is None:
            self.actor.reset()
        else:
            self.volume.reload()  # the checkpoint may have been written by an earlier container
            self.actor.restore(Path(self.storage_root) / relative_folder)
        return {"policy_version": self.actor.policy_version}

    @modal.method()
    def publish_weights(self, method: str) -> Any:
        """The actor's half of a weight sync (grpo_flow.workers.backends.weight_sync.export_weights); commits what it wrote."""
        from grpo_flow.workers.backends.weight_sync import export_weights

        payload = export_weights(method, self.actor, self.run_dir)
        if payload.path is not None:
            self.volume.commit()
        return payload


def make_rollout_engine(config: GRPOFlowConfig, model_path: str, worker_index: int, engine: str, device: str) -> Any:
    """Rollout worker `worker_index`'s engine: transformers on `device`, or vLLM.

    vLLM runs in this process where it is importable (a container of the vLLM image); elsewhere
    (GRPO_FLOW_MODAL_MODE=local, in the project's own environment) in a process of the local
    vLLM environment (`vllm_env.worker_engine`, which the Ray backend's workers use too).
    """
    worker_id = f"rollout-{worker_index}"
    if engine == "transformers":
        from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine

        return TransformersRolloutEngine(model_path, worker_id=worker_id, device=device)
    if engine != "vllm":
        raise ValueError(f"rollout engine must be 'vllm' or 'transformers', got {engine!r}")
    from grpo_flow.workers.backends import vllm_env

    return vllm_env.worker_engine(config, model_path, worker_index, gpu=device == "cuda")


class RolloutWorker:
    """Rollout worker `worker_index` in its own GPU container: a few lines around a rollout engine."""

    config_json: str = modal.parameter()
    model_path: str = modal.parameter()
    worker_index: int = modal.parameter(default=0)  # each index gets its own container pool
    engine: str = modal.parameter(default="vllm")  # or "transformers"
    device: str = modal.parameter(default="cuda")  # "cpu" for `.local()` tests
    storage_root: str = modal.parameter(default=VOLUME_PATH)

    @modal.enter()
    def start(self) -> None:
        self.config = GRPOFlowConfig.model_validate_json(self.config_json)
        self.volume = VolumeSync(self.config.modal_volume)
        self.volume.reload()
        self.rollout_engine = make_rollout_engine(
            self.config, self.model_path, self.worker_index, self.engine, self.device
        )
        self.rollout_engine.load()

    def _close_engine(self) -> None:
        close = getattr(self.rollout_engine, "close", None)  # the transformers engine holds no process
        if close is not None:
            close()

    @modal.exit()
    def stop(self) -> None:
        """Shut the engine down with the container (a vLLM engine ends its own processes)."""
        self._close_engine()

    @modal.method()
    def shutdown(self) -> None:
        """End the engine now: `.local()` instances get no container exit, so the run ends them so."""
        self._close_engine()

    @modal.method()
    def policy_version(self) -> int:
        return self.rollout_engine.policy_version

    @modal.method()
    def reset(self) -> int:
        """A fresh engine on the initial model (a resumed run that has no checkpoint yet); the old one is
        shut down first (on a GPU its weights and memory reservation would stay otherwise)."""
        self._close_engine()
        self.rollout_engine = make_rollout_engine(
            self.config, self.model_path, self.worker_index, self.engine, self.device
        )
        self.rollout_engine.load()
        return self.rollout_engine.policy_version

    @modal.method()
    def generate(self, prompts: list[Any], params: Any, max_prompt_length: int | None = None) -> Any:
        """A GenerationResult; `extra` carries the worker id, the policy version and the decoded prompts."""
        result = self.rollout_engine.generate(prompts, params, max_prompt_length)
        result.extra.update(
            worker_id=self.rollout_engine.worker_id,
            policy_version=self.rollout_engine.policy_version,
            prompt_texts=self.rollout_engine.tokenizer.batch_decode(result.prompt_token_ids),
        )
        return result

    @modal.method()
    def sync_weights(
        self, method: str, version: int, path: str | None = None, data: bytes | None = None, nbytes: int = 0
    ) -> dict[str, Any]:
        """The engine's half of a weight sync; a version it already holds is not loaded again (retries).

        `data` (the `direct` method's safetensors bytes) over 2 MiB travels as a Modal blob
        (modal/_utils/blob_utils.py): fine for small models, a Volume file is cheaper for large ones.
        """
        from grpo_flow.workers.backends.weight_sync import WeightPayload, apply_weights

        if self.rollout_engine.policy_version == version:
            return {"method": method, "version": version, "bytes": 0, "seconds": 0.0, "skipped": True}
        if path is not None:
            self.volume.reload()  # see the actor's commit
        return apply_weights(self.rollout_engine, WeightPayload(method, version, path=path, data=data, nbytes=nbytes))


# -- the app ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerApp:
    """An app built for one config, and its class handles (`modal.Cls`)."""

    app: modal.App
    actor_cls: Any
    rollout_cls: Any
    volume: modal.Volume
    gpu_image: modal.Image
    rollout_image: modal.Image  # the vLLM image with rollout_engine='vllm', else gpu_image
    sandbox_image: modal.Image
    options: dict[str, dict[str, Any]]  # what each class was declared with, for logs and tests


def build_worker_app(
    config: GRPOFlowConfig,
    *,
    actor_timeout_s: int = ACTOR_TIMEOUT_S,
    rollout_timeout_s: int = ROLLOUT_TIMEOUT_S,
    scaledown_window_s: int = SCALEDOWN_WINDOW_S,
    min_containers: int = MIN_CONTAINERS,
) -> WorkerApp:
    """The app for one run's config; builds offline (nothing here talks to Modal)."""
    app = modal.App(APP_NAME)
    volume = storage_volume(config)
    image = gpu_image()
    rollout_image = vllm_image() if config.rollout_engine == "vllm" else image
    common: dict[str, Any] = dict(
        volumes={VOLUME_PATH: volume},
        secrets=secrets(config),
        startup_timeout=STARTUP_TIMEOUT_S,
        scaledown_window=scaledown_window_s,
        min_containers=min_containers,
        # One container per worker (per parameter set): the actor's optimizer and each engine's
        # weights are state, so calls must reach the container that holds them.
        max_containers=1,
        include_source=False,  # the image carries grpo_flow's `schemas` and `workers` (_cuda_image)
    )
    actor_options: dict[str, Any] = dict(
        gpu=actor_gpu(config),
        timeout=actor_timeout_s,
        # Safe to retry: the actor answers a retried step it already took, and refuses a version it does not hold.
        retries=modal.Retries(
            max_retries=getattr(config, "actor_retries", 1), backoff_coefficient=2.0, initial_delay=5.0
        ),
    )
    rollout_options: dict[str, Any] = dict(
        gpu=config.rollout_gpu,
        timeout=rollout_timeout_s,
        # Generation is a function of (weights, prompts, seed), and a sync of a version held is skipped.
        retries=modal.Retries(
            max_retries=getattr(config, "generate_retries", 2), backoff_coefficient=2.0, initial_delay=5.0
        ),
    )
    actor_cls = app.cls(image=image, **common, **actor_options)(ActorWorker)
    rollout_cls = app.cls(image=rollout_image, **common, **rollout_options)(RolloutWorker)

    def described(options: dict[str, Any]) -> dict[str, Any]:
        retries = options["retries"]
        return {
            "gpu": options["gpu"],
            "timeout": options["timeout"],
            "max_retries": retries.max_retries,
            "startup_timeout": STARTUP_TIMEOUT_S,
            "scaledown_window": scaledown_window_s,
            "min_containers": min_containers,
            "max_containers": 1,
        }

    return WorkerApp(
        app=app,
        actor_cls=actor_cls,
        rollout_cls=rollout_cls,
        volume=volume,
        gpu_image=image,
        rollout_image=rollout_image,
        sandbox_image=sandbox_image(),
        options={"ActorWorker": described(actor_options), "RolloutWorker": described(rollout_options)},
    )


def build_app(config: GRPOFlowConfig, **kwargs: Any) -> modal.App:
    """The Modal app for one run's config (see `build_worker_app` for the class handles)."""
    return build_worker_app(config, **kwargs).app


# For `modal deploy -m workers.backends.modal_app` / `modal shell`: the app for the default config.
# A run builds its own with `build_worker_app(config)`; both are named APP_NAME.
app = build_app(GRPOFlowConfig())
