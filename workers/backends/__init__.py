"""Backends: where the workers run. The only code that knows it.

- `servers`: the two workers as plain classes with one set of verbs (`ActorServer`, `RolloutServer`).
- `workers`: a run's workers together (`Workers`: start, weight sync, resume, healing), over a
  `Placement` that each backend supplies: where each worker runs and how it is called.
- `local`: the servers in this process (engines in child processes when pipelined or vLLM).
- `modal_app`: the servers decorated as Modal classes, a few lines each; `modal_backend`: their
  placement, Modal readiness and GPU-seconds.
- `ray_app` / `ray_backend`: the servers as Ray actors in a placement group of a Ray cluster.
- `weight_sync`: how a rollout engine gets the actor's new policy (five methods); `vllm_env`: the
  vLLM environment engines run in.
- this module: a run's workers, started once (`start_workers`), found by the tasks (`run_workers`),
  released at its end (`release`); `check_backend_ready`; `engines_in_this_process`.

Imports every other worker package; `modal` only in the Modal modules, `ray` only in `ray_backend`
(imported only for `backend="ray"`).

GRPO_FLOW_MODAL_MODE=local runs the Modal classes in this process through `.local()` on CPU
engines: the offline tests drive the whole flow through the Modal wrappers that way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.backends.registry import RunWorkers

# `local` (torch, TRL) is imported where used: a Modal container built from the vLLM image imports
# this package for `modal_app` and has neither.
_STARTED: RunWorkers[Any] = RunWorkers()


class WorkersNotStarted(RuntimeError):
    """A task asked for a run's workers before the flow started them."""


def placement(config: GRPOFlowConfig, model_path: str | Path) -> Any:
    """The run's backend: where its workers run and how they are called."""
    if config.backend == "modal":
        from grpo_flow.workers.backends.modal_backend import ModalPlacement

        if os.environ.get("GRPO_FLOW_MODAL_MODE") == "local":
            return ModalPlacement(config, model_path, mode="local", rollout_device="cpu", actor_device="cpu")
        return ModalPlacement(config, model_path)
    if config.backend == "ray":
        from grpo_flow.workers.backends.ray_backend import RayPlacement

        return RayPlacement(config, model_path)
    from grpo_flow.workers.backends.local import LocalPlacement

    return LocalPlacement(config, model_path, device=local_device(config))


class DeviceError(ValueError):
    """The config's device cannot be used here (`cuda` where torch sees no CUDA GPU); names the field."""


def local_device(config: GRPOFlowConfig) -> str:
    """The device the local backend's actor and transformers engines use: config.device, `auto` resolved
    (`cuda` when torch sees a CUDA GPU, else `cpu`)."""
    import torch

    cuda = torch.cuda.is_available()
    if config.device == "auto":
        return "cuda" if cuda else "cpu"
    if config.device == "cuda" and not cuda:
        build = "a CPU-only torch build" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        raise DeviceError(f"device: 'cuda', but torch sees no CUDA GPU here ({build}); use --device cpu or auto")
    return config.device


def start_workers(config: GRPOFlowConfig, model_path: str | Path) -> Any:
    """The run's workers, started (once per run in this process: a second call finds them)."""
    from grpo_flow.workers.backends.workers import Workers

    assert config.run_id is not None
    return _STARTED.get(config.run_id, lambda: Workers(config, model_path, placement(config, model_path)).start())


def run_workers(config: GRPOFlowConfig) -> Any:
    """The run's started workers."""
    assert config.run_id is not None
    workers = _STARTED.peek(config.run_id)
    if workers is None:
        raise WorkersNotStarted(f"the workers of run {config.run_id!r} were not started (start_workers first)")
    return workers


def engines_in_this_process(config: GRPOFlowConfig) -> bool:
    """Whether the run's rollout engines generate in this process (the local backend's transformers
    engines without pipelining: `LocalPlacement.engine`'s last branch). They generate one at a time
    (transformers_engine.GENERATION_LOCK)."""
    return config.backend == "local" and config.rollout_engine == "transformers" and not config.max_staleness


def release(run_id: str) -> None:
    """End the run's workers (their processes, containers, Ray actors); the storage root keeps everything."""
    _STARTED.release(run_id)


def release_all() -> None:
    """End every run's workers in this process."""
    _STARTED.release_all()


def kill(run_id: str) -> None:
    """End the run's engine processes now, without waiting for a call under way (a second Ctrl-C)."""
    workers = _STARTED.peek(run_id)
    if workers is not None:
        workers.kill()


def check_backend_ready(config: GRPOFlowConfig) -> None:
    """Modal credentials and named secrets present; a Ray cluster that answers and has the resources asked
    for (a clear error before anything starts)."""
    if config.backend == "modal" and os.environ.get("GRPO_FLOW_MODAL_MODE") != "local":
        from grpo_flow.workers.backends.modal_backend import check_modal_ready

        check_modal_ready(config)
    if config.backend == "ray":
        from grpo_flow.workers.backends.ray_backend import check_ray_ready

        check_ray_ready(config)
