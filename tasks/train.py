"""Actor-side tasks of one step: the optimizer step, weight sync, checkpoint, metrics."""

from __future__ import annotations

import errno
import time
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.schemas.records import RunPlan, metrics_table
from grpo_flow.tasks.caching import STEP_STAGE
from grpo_flow.tasks.observability import publish, step_artifact
from grpo_flow.workers import backends
from grpo_flow.workers.state.faults import maybe_fail
from grpo_flow.workers.state.storage import RunStorage, StorageFullError, is_disk_full


@task(name="start-workers", cache_policy=NO_CACHE)
def start_workers(config: GRPOFlowConfig, plan: RunPlan) -> int:
    """Every worker started (where the backend runs it) and, when resuming, at the resume checkpoint;
    returns the version the rollout engines hold."""
    workers = backends.start_workers(config, plan.model_path)
    if not plan.resumes:
        return 0
    return workers.restore(RunStorage.of(plan), plan.resume_checkpoint)


@task(name="actor-step", retries=1, retry_delay_seconds=1, cache_policy=NO_CACHE)
def actor_step(config: GRPOFlowConfig, plan: RunPlan, step: int, expected_version: int) -> dict[str, float]:
    """TRL's GRPO objective on the step's rollouts as logged (the Parquet files are the truth).

    Safe to retry: an actor behind `expected_version` restores and replays first, and a retry
    of a step that already applied returns that step's metrics without a second update.
    """
    maybe_fail("actor", step)
    rollouts = RunStorage.of(plan).read_rollouts(step)
    started = time.perf_counter()
    metrics = backends.run_workers(config).actor_step(expected_version, rollouts)
    return {**metrics, "time/actor_s": time.perf_counter() - started}


@task(name="sync-weights", retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE)
def sync_weights(config: GRPOFlowConfig, plan: RunPlan) -> dict[str, float]:
    """Publish the actor's weights to every rollout worker; returns the version they now hold."""
    started = time.perf_counter()
    workers = backends.run_workers(config)
    version = workers.sync_weights()
    return {
        "synced_version": version,
        "time/sync_s": time.perf_counter() - started,
        "sync/bytes": float(workers.last_sync["bytes"]),
    }


def not_a_full_disk(task: object, task_run: object, state: object) -> bool:
    """Retry condition of `save_checkpoint`: a full disk is as full a second later."""
    return not isinstance(getattr(state, "data", None), StorageFullError)


@task(
    name="save-checkpoint",
    retries=1,
    retry_delay_seconds=1,
    retry_condition_fn=not_a_full_disk,
    cache_policy=STEP_STAGE,
    persist_result=True,
)
def save_checkpoint(config: GRPOFlowConfig, plan: RunPlan, step: int) -> dict[str, float]:
    """Weights, optimizer, scheduler and RNG states (and the rollout workers' weights when they lag),
    written and committed by the actor itself (manifest last); this task checks the manifest and prunes
    old checkpoints."""
    started = time.perf_counter()
    storage = RunStorage.of(plan)
    if storage.checkpoint_committed(step):  # a retry after the commit: the checkpoint is done
        storage.verify_checkpoint(step)
        return {"time/checkpoint_s": time.perf_counter() - started}
    workers = backends.run_workers(config)
    try:
        manifest = workers.save_checkpoint(storage, step, {"config_hash": config.training_hash()})
    except Exception as error:  # the writer removed what it had half-written; a full disk says so
        if is_disk_full(error):
            raise StorageFullError(
                errno.ENOSPC,
                f"no space left on the device while writing the checkpoint of step {step} under "
                f"{storage.run_dir / 'checkpoints'}; the partial checkpoint was removed, every logged step is kept",
            ) from error
        raise
    if manifest["policy_version"] != step:
        raise RuntimeError(f"checkpoint of step {step}: the actor holds policy version {manifest['policy_version']}")
    storage.verify_checkpoint(step, checksums=False)  # committed where this process reads the run
    maybe_fail("checkpointed", step)
    pruned = storage.prune_checkpoints(config.save_total_limit, config.keep_checkpoint_every)
    workers.checkpoints_pruned(storage, pruned)
    return {"time/checkpoint_s": time.perf_counter() - started, "checkpoints_pruned": len(pruned)}


# Metrics and the step's artifact in one task run: the artifact is a view of the row just
# written, and a task run of its own would cost each step time and events. The artifact is
# written on the artifact thread (tasks/observability.py), so the step does not wait for the API.
@task(
    name="log-metrics",
    task_run_name="log-metrics-step-{step}: metrics Parquet, wandb, step artifact",
    retries=2,
    retry_delay_seconds=1,
    cache_policy=NO_CACHE,
)
def log_metrics(
    config: GRPOFlowConfig,
    plan: RunPlan,
    step: int,
    row: dict[str, Any],
    samples: list[dict[str, Any]] | None = None,
) -> str:
    """One Parquet row per step, wandb when configured, then the step's artifact (metrics and
    three completions: `samples`, or read back from the logged rollouts when None). A replayed
    step's row stays as first logged."""
    maybe_fail("metrics", step)
    storage = RunStorage.of(plan)
    path = storage.metrics_path(step)
    if not path.exists():
        path = storage.write_metrics(step, metrics_table(row))
        if config.report_to == "wandb":  # delivered or counted, never retried: the Parquet row is logged
            from grpo_flow.tasks.observability import USER_FACING
            from grpo_flow.workers.state.tracking import wandb_log

            problem = wandb_log(config, plan.run_id, step, row)
            if problem:  # the run's first failure only
                get_run_logger().warning(problem, extra={USER_FACING: True})
    publish(step_artifact, plan, step, row, samples)  # never raises; linked to this task run
    return str(path)
