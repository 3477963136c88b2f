"""Backends: where the workers run. The only code that knows it.

- `local`: the actor and rollout engines in this process (engines in child processes with
  one-step-off pipelining).
- `modal_app`: the Modal app, each worker class wrapped in a few lines; `modal_backend`: the
  same surface as `local` over those remote classes, the Modal sandbox for reward code.
- `ray_app`: the workers wrapped in a few lines for Ray actors; `ray_backend`: the same surface
  as `local` (it subclasses it) over Ray actors on a Ray cluster, placed with a placement group.
- `weight_sync`: how a rollout engine gets the actor's new policy (five methods).
- this module: which backend a run uses (`run_workers`, `release`, `check_backend_ready`), and
  whether its engines generate in this process (`engines_in_this_process`).

Imports every other worker package; `modal` only in the Modal modules, `ray` only in
`ray_backend` (imported only for `backend="ray"`).

All expose the same surface (`actor.step`, `rollout[i].generate`, `sync_weights`,
`restore`, `ensure_actor_version`, `ensure_rollout_version`, `save_rollout_weights`), so the
tasks do not care which one they talk to.

GRPO_FLOW_MODAL_MODE=local runs the Modal classes in this process through `.local()` on
CPU engines: the offline tests drive the whole flow through the Modal wrappers that way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from grpo_flow.schemas.config import GRPOFlowConfig

# `local` (torch, TRL) is imported where used: a Modal container built from the vLLM image imports
# this package for `modal_app` and has neither.


def run_workers(config: GRPOFlowConfig, model_path: str | Path) -> Any:
    if config.backend == "modal":
        from grpo_flow.workers.backends.modal_backend import modal_workers

        if os.environ.get("GRPO_FLOW_MODAL_MODE") == "local":
            return modal_workers(config, model_path, mode="local", rollout_device="cpu", actor_device="cpu")
        return modal_workers(config, model_path)
    if config.backend == "ray":
        from grpo_flow.workers.backends.ray_backend import ray_workers

        return ray_workers(config, model_path)
    from grpo_flow.workers.backends import local

    return local.local_workers(config, model_path)


def engines_in_this_process(config: GRPOFlowConfig) -> bool:
    """Whether the run's rollout engines generate in this process (the local backend's transformers
    engines without pipelining: the last branch of `LocalWorkers.__init__`'s choice). They generate
    one at a time (transformers_engine.GENERATION_LOCK)."""
    return config.backend == "local" and config.rollout_engine == "transformers" and not config.max_staleness


def release(config: GRPOFlowConfig, run_id: str) -> None:
    from grpo_flow.workers.backends import local

    if config.backend == "modal":
        from grpo_flow.workers.backends.modal_backend import release as release_modal

        release_modal(run_id)
    if config.backend == "ray":
        from grpo_flow.workers.backends.ray_backend import release as release_ray

        release_ray(run_id)
    local.release(run_id)


def check_backend_ready(config: GRPOFlowConfig) -> None:
    """Modal credentials and named secrets present; a Ray cluster that answers and has the resources asked
    for (a clear error before anything starts)."""
    if config.backend == "modal" and os.environ.get("GRPO_FLOW_MODAL_MODE") != "local":
        from grpo_flow.workers.backends.modal_backend import check_modal_ready

        check_modal_ready(config)
    if config.backend == "ray":
        from grpo_flow.workers.backends.ray_backend import check_ray_ready

        check_ray_ready(config)
