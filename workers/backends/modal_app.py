"""The Modal app: the plain workers wrapped in a few lines each (`app.cls`, GPU, image, volume).

Built with no network: images, the Volume and Secrets are lazy handles until the app runs.

- `ActorWorker` decorates `servers.ActorServer`: `ready`, `step`, `save_checkpoint`, `restore`,
  `publish` (the Volume is committed after every write).
- `RolloutWorker` decorates `servers.RolloutServer` (a `VLLMRolloutEngine` with rollout_engine='vllm',
  in an image of its own: vLLM's pins cannot share one with the actor's, as locally they cannot
  share an environment; or the transformers engine): `ready`, `initial`, `generate`,
  `load_weights` (the Volume is reloaded before every read), `shutdown`. `worker_index` is a
  `modal.parameter()`, so rollout worker i has its own container pool and keeps its engine warm
  between steps.

The storage root inside a container is the run Volume, mounted at VOLUME_PATH; or, for a URL root
(`s3://`, `gs://`), the bucket itself: the actor writes and commits the run's files there through the
client its image adds (`storage_packages`), with the credentials of a Secret (`modal_secrets`), and the
weights travel in the calls (`url_root_problem` refuses what cannot work). The Volume then holds only the
Hugging Face cache and uploaded models.

The GPU type comes from the run's config, but Modal fixes it when a class is decorated; so the
classes below are plain, undecorated classes at module scope, and `build_app(config)`
decorates them for one config (`gpu="H100:2"` from modal_actor_gpu and modal_actor_gpu_count, the
modal_rollout_gpu, timeouts, volume, secrets). Modal supports exactly this: a container imports
the class by name from this module and, finding it undecorated, binds it to the function
definition the app registered (modal/_runtime/user_code_imports.py, "local scope-decoration").
`app` at the bottom is the same app for the default config, for `modal deploy` / `modal shell`.

Tested offline (tests/workers/backends/test_modal_app.py): the app builds, declares these classes with
the GPUs, volume, image and timeouts asked for, and no Modal retries, and every wrapped method runs with
`Cls(...).method.local(...)` on CPU engines (`.local()` runs `@modal.enter` and the method in
this process; the Volume is not mounted, commit/reload are skipped). With rollout_engine='vllm'
the local run reaches the real vLLM engine through the local vLLM environment (tests/flows/
test_vllm_train.py). UNTESTED HERE (no network to Modal, no GPU): building the CUDA images,
running the classes remotely, Volume commit/reload, and vLLM in a container of its own image.
"""

# No `from __future__ import annotations`: Modal reads the classes' parameter annotations as types.
from dataclasses import dataclass
from typing import Any

import modal

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.backends.vllm_env import CUDA_PACKAGES
from grpo_flow.workers.rewards.modal_sandbox import sandbox_image
from grpo_flow.workers.state.location import EXTRAS, check_reachable, is_url, url_scheme, use_storage_options
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
# A URL storage root's client, in the actor's image (the worker that writes the run's files on a URL root):
# grpo-flow's fsspec and universal-pathlib, and the extra of the URL's scheme (pyproject.toml's `s3`, `gcs`),
# as ranges, so that uv resolves them against the image's own pins (datasets bounds fsspec).
STORAGE_PACKAGES: tuple[str, ...] = ("fsspec>=2024.6", "universal-pathlib>=0.3,<0.4")
CLIENT_PACKAGES = {"s3": "s3fs>=2024.6", "gcs": "gcsfs>=2024.6"}  # by extra (location.EXTRAS)
# On a URL root the containers share no folder, so the weights travel in the call: `direct` (`reload` becomes it).
URL_SYNC_METHODS = ("reload", "direct")
LOCAL_SOURCES = ("schemas", "workers")  # of grpo_flow: workers never import Prefect, flows or tasks

# Per call (Modal's timeouts are per attempt; a Prefect task retry makes a new call).
ACTOR_TIMEOUT_S = 60 * 60
ROLLOUT_TIMEOUT_S = 30 * 60
STARTUP_TIMEOUT_S = 20 * 60  # image pull + model download + vLLM start
# Idle containers stay up this long, so one run's steps reuse warm engines. min_containers stays 0:
# a kept-warm GPU would go on billing after a detached run ends.
SCALEDOWN_WINDOW_S = 20 * 60
MIN_CONTAINERS = 0


# -- images, volume, secrets ----------------------------------------------------------------------------
def _cuda_image(packages: tuple[str, ...], env: dict[str, str], storage: tuple[str, ...] = ()) -> modal.Image:
    image = (
        modal.Image.from_registry(CUDA_BASE_IMAGE, add_python=PYTHON_VERSION)
        .entrypoint([])  # the CUDA image's entrypoint only prints a banner
        .uv_pip_install(*packages)
    )
    if storage:  # a layer of its own: the one above stays cached, shared with folder roots' runs
        image = image.uv_pip_install(*storage)
    image = image.env({"HF_HOME": HF_HOME, "TOKENIZERS_PARALLELISM": "false", **env})
    # Last: added at container start, no rebuild on code edits. File by file rather than with
    # add_local_python_source, which does not follow the source checkout's links (workers/state/source.py).
    for remote, local in package_files(LOCAL_SOURCES).items():
        if local.is_dir():
            image = image.add_local_dir(local, f"/root/{remote}", ignore=["**/__pycache__"])
        else:
            image = image.add_local_file(local, f"/root/{remote}")
    return image


def gpu_image(storage: tuple[str, ...] = ()) -> modal.Image:
    """CUDA base + pinned torch / TRL / transformers (+ `storage`: a URL root's client, `storage_packages`) + this
    project's `schemas` and `workers`: the actor."""
    return _cuda_image(GPU_PACKAGES, {}, storage)


def storage_packages(config: GRPOFlowConfig) -> tuple[str, ...]:
    """What the actor's image adds for the run's storage root: nothing for a folder (the Volume); for a URL,
    its scheme's client (`url_root_problem` refuses a scheme with none here)."""
    scheme = url_scheme(config.storage_root)
    if scheme is None:
        return ()
    return (*STORAGE_PACKAGES, CLIENT_PACKAGES[EXTRAS[scheme]])


def url_root_problem(config: GRPOFlowConfig) -> tuple[str, str] | None:
    """(field, why in one line) when the Modal workers cannot run on the config's URL storage root; None for a
    folder root, or a URL they can. The actor's container reaches the bucket through the scheme's client, with
    the credentials of a Secret (`modal_secrets`) and the run's `storage_options`."""
    scheme, root = url_scheme(config.storage_root), config.storage_root
    if scheme is None:
        return None
    if EXTRAS.get(scheme) not in CLIENT_PACKAGES:
        return "storage_root", (
            f"{root!r}: the Modal containers reach a URL storage root through s3fs or gcsfs (s3://, gs://), not "
            f"{scheme}://; use one of those, or a folder (the run's files then live on the Modal Volume)"
        )
    if config.sync_method in URL_SYNC_METHODS:
        return None
    if config.weight_sync_method != "lora" and config.publishes_adapter:
        return "lora_publish", (
            f"the rollout workers would take the LoRA adapter as files ('lora'), which the containers do not share "
            f"on a URL storage_root ({root!r}); set lora_publish 'merged' (the weights then travel in the Modal call)"
        )
    return "weight_sync_method", (
        f"{config.weight_sync_method!r} hands weights over as files at one path every container reads, which a URL "
        f"storage_root ({root!r}) is not; use 'direct' (the weights travel in the Modal call)"
    )


def vllm_image() -> modal.Image:
    """CUDA base + the pinned vLLM (with the torch and transformers it pins) + `schemas` and `workers`."""
    # Weight sync sends our own module-level function to vLLM's worker process.
    return _cuda_image(VLLM_PACKAGES, {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})


def storage_volume(config: GRPOFlowConfig) -> modal.Volume:
    return modal.Volume.from_name(config.modal_volume, create_if_missing=True)


def secrets(config: GRPOFlowConfig) -> list[modal.Secret]:
    return [modal.Secret.from_name(name) for name in config.modal_secrets]


def actor_gpu_spec(config: GRPOFlowConfig) -> str:
    """Modal's `gpu=` string: `A100` or `A100:2` (config validates the type, 1-8 GPUs)."""
    return (
        config.modal_actor_gpu
        if config.modal_actor_gpu_count == 1
        else f"{config.modal_actor_gpu}:{config.modal_actor_gpu_count}"
    )


def worker_config_json(config: GRPOFlowConfig) -> str:
    """The config as the workers get it (a class parameter, <= 16 KiB), unchanged: `backend` stays
    `modal`, so the actor in its container knows its engines are elsewhere (and corrects for them)."""
    return config.model_dump_json()


def container_volume(name: str, mount: str) -> Any:
    """The run Volume as the container that mounts it at `mount` commits and reloads it: Modal's handle
    inside a container; outside one (`.local()` calls) None, as nothing is mounted (a test's Volume double
    puts a view of its own here)."""
    return None if modal.is_local() else modal.Volume.from_name(name)


class VolumeSync:
    """`commit()` / `reload()` of the run Volume inside a container (`container_volume`); no-ops when
    running locally with no Volume mounted."""

    def __init__(self, name: str, mount: str = VOLUME_PATH) -> None:
        self.name, self.mount = name, mount
        self._volume: Any = None

    def _handle(self) -> Any:
        if self._volume is None:
            self._volume = container_volume(self.name, self.mount)
        return self._volume

    def commit(self) -> None:
        if volume := self._handle():
            volume.commit()

    def reload(self) -> None:
        if volume := self._handle():
            volume.reload()


# -- the wrapped workers (plain classes; build_app decorates them) -----------------------------------------
class ActorWorker:
    """The actor in its own GPU container: `servers.ActorServer`'s verbs, the Volume committed after writes."""

    config_json: str = modal.parameter()
    model_path: str = modal.parameter()
    device: str = modal.parameter(default="cuda")  # "cpu" for `.local()` tests
    storage_root: str = modal.parameter(default=VOLUME_PATH)

    @modal.enter()
    def start(self) -> None:
        from grpo_flow.workers.backends.servers import ActorServer

        config = GRPOFlowConfig.model_validate_json(self.config_json)
        if is_url(self.storage_root):  # this container's credentials (a Secret's) reach the bucket, or one clear error
            use_storage_options(self.storage_root, config.storage_options)
            check_reachable(self.storage_root)
        volume = VolumeSync(config.modal_volume, self.storage_root)
        self.server = ActorServer(self.config_json, self.model_path, self.device, self.storage_root, volume)

    @modal.exit()
    def stop(self) -> None:
        self.server.close()  # its rank processes (actor_num_processes > 1) leave the process group

    @modal.method()
    def ready(self, marker: Any = None) -> Any:
        return self.server.ready(marker)

    @modal.method()
    def step(self, expected_version: int, rollouts: Any) -> Any:
        return self.server.step(expected_version, rollouts)

    @modal.method()
    def save_checkpoint(self, expected_version: int, step: int, extra: Any, files: Any = None) -> Any:
        return self.server.save_checkpoint(expected_version, step, extra, files)

    @modal.method()
    def restore(self, folder: Any = None) -> Any:
        return self.server.restore(folder)

    @modal.method()
    def publish(self, expected_version: int, method: str) -> Any:
        return self.server.publish(expected_version, method)


class RolloutWorker:
    """Rollout worker `worker_index` in its own GPU container: `servers.RolloutServer`'s verbs, the Volume
    reloaded before reads. `worker_index` is a parameter, so each worker has its own container pool."""

    config_json: str = modal.parameter()
    model_path: str = modal.parameter()
    worker_index: int = modal.parameter(default=0)
    device: str = modal.parameter(default="cuda")  # "cpu" for `.local()` tests
    storage_root: str = modal.parameter(default=VOLUME_PATH)

    @modal.enter()
    def start(self) -> None:
        from grpo_flow.workers.backends.servers import RolloutServer

        volume = VolumeSync(GRPOFlowConfig.model_validate_json(self.config_json).modal_volume, self.storage_root)
        self.server = RolloutServer(
            self.config_json, self.model_path, self.worker_index, self.device, self.storage_root, volume
        )

    @modal.exit()
    def stop(self) -> None:
        self.server.shutdown()  # a vLLM engine ends its own processes with the container

    @modal.method()
    def ready(self, marker: Any = None) -> Any:
        return self.server.ready(marker)

    @modal.method()
    def initial(self) -> int:
        return self.server.initial()

    @modal.method()
    def generate(self, expected_version: int, prompts: Any, params: Any, max_prompt_length: Any = None) -> Any:
        return self.server.generate(expected_version, prompts, params, max_prompt_length)

    @modal.method()
    def load_weights(self, weights: Any, version: int, adapter_config: Any = None) -> Any:
        return self.server.load_weights(weights, version, adapter_config)

    @modal.method()
    def shutdown(self) -> None:
        """`.local()` instances get no container exit, so the run ends their engines with this."""
        self.server.shutdown()


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
    image = gpu_image(storage_packages(config))
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
    # No modal.Retries: a call that fails is retried by its Prefect task (actor_retries, generate_retries), and
    # a fresh container (Modal re-runs a preempted input itself) refuses a version it does not hold, which the
    # heal loop (workers/backends/workers.py) answers. Retries here would multiply those.
    actor_options: dict[str, Any] = dict(gpu=actor_gpu_spec(config), timeout=actor_timeout_s)
    rollout_options: dict[str, Any] = dict(gpu=config.modal_rollout_gpu, timeout=rollout_timeout_s)
    actor_cls = app.cls(image=image, **common, **actor_options)(ActorWorker)
    rollout_cls = app.cls(image=rollout_image, **common, **rollout_options)(RolloutWorker)

    def described(options: dict[str, Any]) -> dict[str, Any]:
        return {
            "gpu": options["gpu"],
            "timeout": options["timeout"],
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
