"""The `grpo` flow: one run, as a subflow per training step.

    prepare_run → evaluate_heldout (initial)
    for step in 1..N:  grpo_step
        sample_batch → generate.map(shards) → score.map(shards) → compute_advantages
        → write_rollouts.map(shards) → actor_step → sync_weights (when due)
        → save_checkpoint (when due) → log_metrics
    evaluate_heldout (final) → finish_run

Runs on Prefect's ephemeral server when PREFECT_API_URL is unset, on a real server otherwise.
Where it departs from the GRPO paper: one optimizer step per batch (TRL's num_iterations=1),
and the loss is TRL's `loss_type` (dapo by default), not the paper's per-sequence mean.
"""

from __future__ import annotations

import statistics
import time
import uuid
from datetime import datetime, timezone
from typing import Any

from prefect import flow, unmapped
from prefect.runtime import flow_run
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from tqdm.auto import tqdm

from schemas.config import GRPOFlowConfig
from schemas.records import RunPlan
from tasks.rollout import compute_advantages, generate, sample_batch, score, write_rollouts
from tasks.run import evaluate_heldout, finish_run, prepare_run
from tasks.train import actor_step, log_metrics, save_checkpoint, sync_weights


def new_run_id(config: GRPOFlowConfig) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{config.dataset.replace('_', '-')}-{stamp}-{uuid.uuid4().hex[:4]}"


def grpo_run_name() -> str:
    """The flow run is named after the run id, so the Prefect UI and the storage root agree."""
    config = flow_run.parameters.get("config")
    run_id = config.get("run_id") if isinstance(config, dict) else getattr(config, "run_id", None)
    return run_id or "grpo-new-run"


@flow(name="grpo-step", flow_run_name="{plan.run_id}-step-{step}", validate_parameters=False)
def grpo_step(config: GRPOFlowConfig, plan: RunPlan, step: int, policy_version: int) -> dict[str, Any]:
    """One training step; returns its metrics row (also logged as Parquet)."""
    started = time.perf_counter()
    # Each mapped stage is resolved before the next, so a failure surfaces as the failing
    # task's own exception rather than as a missing input further down.
    shards = sample_batch(config, plan, step)
    generated = generate.map(unmapped(config), unmapped(plan), shards).result()
    scored = score.map(unmapped(config), unmapped(plan), generated).result()
    batches, reward_stats = compute_advantages(config, scored)
    write_rollouts.map(unmapped(config), unmapped(plan), batches, range(len(batches))).result()
    train_metrics = actor_step(config, plan, step, policy_version)
    last_step = step == plan.total_steps
    synced = sync_weights(config, plan) if step % config.sync_weights_every == 0 or last_step else {}
    saved = save_checkpoint(config, plan, step) if step % config.save_steps == 0 or last_step else {}
    row = {
        "run_id": plan.run_id,
        "step": step,
        "policy_version": policy_version + 1,
        "num_completions": sum(len(b) for b in batches),
        **reward_stats,
        **train_metrics,
        **synced,
        **saved,
        "time/generate_s": sum(b.generate_s for b in batches),
        "time/score_s": sum(b.score_s for b in batches),
        "step_s": time.perf_counter() - started,
    }
    log_metrics(config, plan, step, row)
    return row


@flow(name="grpo", flow_run_name=grpo_run_name, validate_parameters=True)
def grpo(config: GRPOFlowConfig, show_progress: bool = False) -> dict[str, Any]:
    """A GRPO run from its config; returns the run's summary (also in summary.json)."""
    started = time.perf_counter()
    if config.run_id is None:
        config = config.model_copy(update={"run_id": new_run_id(config)})
    plan = prepare_run(config)
    initial_accuracy = evaluate_heldout(config, plan)
    rows: list[dict[str, Any]] = []
    step_walls: list[float] = []  # around each subflow call: step work plus Prefect's orchestration
    summary: dict[str, Any] = {"run_id": plan.run_id, "total_steps": plan.total_steps}
    try:
        # Step subflows run inside this flow's process, whose own heartbeat reports the run.
        # Prefect 3.8 joins a heartbeat thread that sleeps in 1 s slices at the end of every
        # flow run, which cost each step about a second; the subflows go without.
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            progress = tqdm(range(1, plan.total_steps + 1), desc=plan.run_id, disable=not show_progress, unit="step")
            for step in progress:
                step_started = time.perf_counter()
                rows.append(grpo_step(config, plan, step, policy_version=step - 1))
                step_walls.append(time.perf_counter() - step_started)
                progress.set_postfix(reward=f"{rows[-1]['reward']:.3f}", loss=f"{rows[-1]['loss']:.4f}")
    except BaseException as error:
        failed_step = len(rows) + 1
        summary.update(
            status="failed", error=f"step {failed_step}: {type(error).__name__}: {error}", steps_completed=len(rows)
        )
        finish_run(config, plan, summary)
        raise
    final_accuracy = evaluate_heldout(config, plan)
    recent = rows[-5:]
    summary.update(
        status="completed",
        steps_completed=len(rows),
        initial_eval_accuracy=initial_accuracy,
        final_eval_accuracy=final_accuracy,
        eval_accuracy_gain=final_accuracy - initial_accuracy,
        final_reward=sum(r["reward"] for r in recent) / len(recent),
        wall_seconds=time.perf_counter() - started,
        median_step_seconds=statistics.median(step_walls),
        storage=str(plan.storage_root),
    )
    return finish_run(config, plan, summary)
