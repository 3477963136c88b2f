"""Actor-side tasks of one step: the optimizer step, weight sync, checkpoint, metrics."""

from __future__ import annotations

import time
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from schemas.config import GRPOFlowConfig
from schemas.records import RunPlan, metrics_table
from workers import local
from workers.storage import RunStorage


@task(name="actor-step", cache_policy=NO_CACHE)
def actor_step(config: GRPOFlowConfig, plan: RunPlan, step: int, expected_version: int) -> dict[str, float]:
    """TRL's GRPO objective on the step's rollouts as logged (the Parquet files are the truth).

    No automatic retries: an optimizer step is not idempotent, and the actor refuses a call
    whose expected policy version it does not hold.
    """
    rollouts = RunStorage(plan.storage_root, plan.run_id).read_rollouts(step)
    started = time.perf_counter()
    metrics = local.local_workers(config, plan.model_path).actor.step(expected_version, rollouts)
    return {**metrics, "time/actor_s": time.perf_counter() - started}


@task(name="sync-weights", retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE)
def sync_weights(config: GRPOFlowConfig, plan: RunPlan) -> dict[str, float]:
    """Publish the actor's weights to every rollout worker; returns the version they now hold."""
    started = time.perf_counter()
    version = local.local_workers(config, plan.model_path).sync_weights()
    return {"synced_version": version, "time/sync_s": time.perf_counter() - started}


@task(name="save-checkpoint", retries=1, retry_delay_seconds=1, cache_policy=NO_CACHE)
def save_checkpoint(config: GRPOFlowConfig, plan: RunPlan, step: int) -> dict[str, float]:
    """Weights, optimizer, scheduler and RNG states; the manifest is written last, then the folder is renamed."""
    started = time.perf_counter()
    storage = RunStorage(plan.storage_root, plan.run_id)
    staging = storage.staging_checkpoint_dir(step)
    state = local.local_workers(config, plan.model_path).actor.save_checkpoint(staging)
    storage.commit_checkpoint(step, staging, {**state, "config_hash": config.training_hash()})
    return {"time/checkpoint_s": time.perf_counter() - started}


@task(name="log-metrics", retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE)
def log_metrics(config: GRPOFlowConfig, plan: RunPlan, step: int, row: dict[str, Any]) -> str:
    """One Parquet row per step, and wandb when configured."""
    path = RunStorage(plan.storage_root, plan.run_id).write_metrics(step, metrics_table(row))
    if config.report_to == "wandb":
        from workers.tracking import wandb_log

        wandb_log(config, plan.run_id, step, row)
    return str(path)
