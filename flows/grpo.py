"""The `grpo` flow: one run, as a subflow per training step.

    prepare_run → [restore_workers, when resuming] → evaluate_heldout (initial)
    for step in first..N:  grpo_step (a subflow; with step_subflows off, run_step in this flow run)
        sample_batch → generate.map(shards) (one shard, or engines in this process: called in turn)
        → score.map(shards)
        → log_rollouts (compute-advantages, write-rollouts per shard, commit-rollouts)
        → actor_step → sync_weights (when due)
        → log_metrics (metrics Parquet, wandb, step artifact) → save_checkpoint (when due)
      (a step whose rollouts are already logged skips straight to actor_step: a replay;
       with max_staleness 1, step t+1's rollouts are produced alongside step t's actor_step)
    evaluate_heldout (final) → finish_run

Resuming is the same flow on an existing run id: `prepare_run` finds the newest valid
checkpoint and the logged steps after it (workers/state/resume.py). Retrying a failed flow run in
Prefect does the same. A Ctrl-C or SIGTERM in `grpo train` (flows/interrupt.py) stops the loop
between steps: summary.json says `interrupted`, and the flow run ends Cancelled.

Runs on Prefect's ephemeral server when PREFECT_API_URL is unset, on a real server otherwise.
Where it departs from the GRPO paper: the loss is TRL's `loss_type` (dapo by default), not the
paper's per-sequence mean; num_iterations (GRPO's mu) defaults to 1, as TRL's.
"""

from __future__ import annotations

import contextvars
from contextlib import nullcontext
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from prefect import flow, unmapped
from prefect.runtime import flow_run
from prefect.states import Cancelled
from prefect.utilities.annotations import quote
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from tqdm.auto import tqdm

from grpo_flow.flows import ephemeral_database_in_memory
from grpo_flow.flows.interrupt import interrupted_summary, resume_command, stop_requested, stop_signal_name
from grpo_flow.schemas.config import GRPOFlowConfig, new_run_id
from grpo_flow.schemas.records import RunPlan
from grpo_flow.tasks import with_retries
from grpo_flow.tasks.observability import (
    artifact_writes_allowed,
    artifact_writes_paused,
    create_run_progress,
    flush_artifacts,
    publish,
    update_run_progress,
)
from grpo_flow.tasks.rollout import (
    check_metric_names,
    generate,
    keep_informative_groups,
    log_rollouts,
    logged_reward_stats,
    sample_batch,
    score,
)
from grpo_flow.tasks.run import completed_summary, evaluate_heldout, finish_run, prepare_run, release_flow_run_locks
from grpo_flow.tasks.train import actor_step, log_metrics, restore_workers, save_checkpoint, sync_weights
from grpo_flow.workers import backends
from grpo_flow.workers.state.faults import parse_fail_at
from grpo_flow.workers.state.storage import RunStorage


def grpo_run_name() -> str:
    """The flow run is named after the run id, so the Prefect UI and the storage root agree."""
    config = flow_run.parameters.get("config")
    run_id = config.get("run_id") if isinstance(config, dict) else getattr(config, "run_id", None)
    return run_id or "grpo-new-run"


def quoted(batches: list) -> list:
    """Rollout shards as task inputs that Prefect passes through as they are: unquoted, it walks every
    element of every per-row list before each task (about 25 ms a tiny shard, over a second a gsm8k one)."""
    return [quote(b) for b in batches]


def generate_shards(
    config: GRPOFlowConfig, plan: RunPlan, shards: list, rollout_version: int, fail_at: str | None
) -> list:
    """generate.map over the step's prompt shards, resolved. Engines in this process generate one at
    a time anyway, so their shards (and a single shard anywhere) are generated on the calling thread,
    one task run each, without the fan-out: torch then runs on the thread the actor step runs on.
    From task-runner threads, each with OpenMP threads of its own, a tiny CPU step's generation took
    about 10 % longer (benchmarks/vs_trl.py)."""
    generate_shard = with_retries(generate, config.generate_retries, config.retry_delay_seconds)
    if len(shards) == 1 or backends.engines_in_this_process(config):
        return [generate_shard(config, plan, shard, rollout_version, fail_at) for shard in shards]
    return generate_shard.map(
        unmapped(config), unmapped(plan), shards, unmapped(rollout_version), unmapped(fail_at)
    ).result()


def score_shards(config: GRPOFlowConfig, plan: RunPlan, generated: list, fail_at: str | None) -> list:
    """score.map over the generated shards, resolved, with the run's retry policy."""
    score_shard = with_retries(score, config.score_retries, config.retry_delay_seconds)
    return score_shard.map(unmapped(config), unmapped(plan), quoted(generated), unmapped(fail_at)).result()


def refill_with_informative_groups(
    config: GRPOFlowConfig, plan: RunPlan, step: int, rollout_version: int, scored: list, fail_at: str | None
) -> tuple[list, dict[str, float]]:
    """DAPO's dynamic sampling: drop groups whose rewards tie, refill from further prompts for up
    to dynamic_sampling_max_rounds extra rounds. If no group carries signal, the step keeps its
    own batch (its advantages are zero: the actor step changes nothing but the optimizer state)."""
    kept, dropped = keep_informative_groups(config, [None] * len(scored), quoted(scored))
    rounds = 0
    target = config.prompts_per_step * config.num_generations
    while sum(len(b) for b in kept) < target and rounds < config.dynamic_sampling_max_rounds:
        rounds += 1
        shards = sample_batch(config, plan, step, refill_round=rounds)
        generated = generate_shards(config, plan, shards, rollout_version, fail_at)
        rescored = score_shards(config, plan, generated, fail_at)
        kept, more = keep_informative_groups(config, quoted(kept), quoted(rescored))
        dropped += more
    if not any(len(b) for b in kept):
        kept = scored
    stats = {
        "dynamic_sampling/filtered_groups": float(dropped),
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/kept_groups": float(sum(len(b) for b in kept) // config.num_generations),
    }
    return kept, stats


def produce_rollouts(
    config: GRPOFlowConfig, plan: RunPlan, step: int, rollout_version: int, fail_at: str | None
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """sample_batch → generate.map → score.map → [dynamic sampling] → log_rollouts (advantages,
    write, commit): the step's rows logged; returns its reward statistics and the three
    completions its artifact shows.

    Each mapped stage is resolved before the next, so a failure surfaces as the failing task's
    own exception rather than as a missing input further down.
    """
    shards = sample_batch(config, plan, step)
    generated = generate_shards(config, plan, shards, rollout_version, fail_at)
    scored = score_shards(config, plan, generated, fail_at)
    if config.dynamic_sampling:
        scored, sampling_stats = refill_with_informative_groups(config, plan, step, rollout_version, scored, fail_at)
    reward_stats, samples = log_rollouts(config, plan, step, quoted(scored))
    if config.dynamic_sampling:
        reward_stats = {**reward_stats, **sampling_stats}
    stats = {
        **reward_stats,
        "num_completions": float(sum(len(b) for b in scored)),
        "time/generate_s": sum(b.generate_s for b in scored),
        "time/score_s": sum(b.score_s for b in scored),
    }
    return stats, samples


def in_background(function: Any, *args: Any) -> Future:
    """Run `function` on a thread that shares this flow run's Prefect context, so the tasks it calls
    are recorded as this flow run's task runs."""
    context = contextvars.copy_context()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-flow-next-step")
    future = executor.submit(context.run, function, *args)
    executor.shutdown(wait=False)
    return future


# persist_result=False: a retried parent flow run must run a step again, never reuse an old
# step's result (Prefect reuses a finished subflow run only when its result was persisted).
@flow(name="grpo-step", flow_run_name="{plan.run_id}-step-{step}", validate_parameters=False, persist_result=False)
def grpo_step(
    config: GRPOFlowConfig,
    plan: RunPlan,
    step: int,
    policy_version: int,
    rollout_version: int,
    fail_at: str | None = None,
    rollout_stats: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One training step as its own subflow run (`<run>-step-N` in the UI); see `run_step`."""
    return run_step(config, plan, step, policy_version, rollout_version, fail_at, rollout_stats)


def run_step(
    config: GRPOFlowConfig,
    plan: RunPlan,
    step: int,
    policy_version: int,
    rollout_version: int,
    fail_at: str | None = None,
    rollout_stats: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One training step; returns its metrics row (also logged as Parquet). Called by the
    `grpo-step` subflow, or directly in the run's flow when `config.step_subflows` is off.

    `policy_version` is the actor's before the step, `rollout_version` the one the rollout
    workers must hold; a worker holding another loads it first. With max_staleness 1 the
    next step's rollouts are produced on another thread while the actor steps (one-step-off);
    `rollout_stats` are then this step's, handed over from the step that produced them.
    """
    # Artifacts published earlier are written while the step works (see tasks/observability.py).
    with artifact_writes_allowed():
        started = time.perf_counter()
        storage = RunStorage(plan.storage_root, plan.run_id)
        samples = None  # the artifact's three completions; None: read back from the logged rollouts
        if not storage.rollout_dir(step).exists():
            rollout_stats, samples = produce_rollouts(config, plan, step, rollout_version, fail_at)
        elif rollout_stats is None:
            # Logged before a crash: the actor trains on the rows as logged, nothing is generated again.
            num_completions, logged_stats = logged_reward_stats(config, plan, step)
            rollout_stats = {**logged_stats, "num_completions": float(num_completions), "replayed": 1.0}
        next_rollouts = None
        if config.max_staleness and step < plan.total_steps and not storage.rollout_dir(step + 1).exists():
            # Generated with the weights the rollout workers hold now, i.e. before this actor step.
            next_rollouts = in_background(produce_rollouts, config, plan, step + 1, rollout_version, fail_at)
        try:
            train_metrics = with_retries(actor_step, config.actor_retries, config.retry_delay_seconds)(
                config, plan, step, policy_version, fail_at
            )
        finally:
            # The weights change at the sync below, so the next step's generation must be over first.
            next_stats = next_rollouts.result()[0] if next_rollouts is not None else None
        last_step = step == plan.total_steps
        synced = sync_weights(config, plan) if step % config.sync_weights_every == 0 or last_step else {}
        check_metric_names(rollout_stats, train_metrics)
        row = {
            "run_id": plan.run_id,
            "step": step,
            "policy_version": policy_version + 1,
            **rollout_stats,
            "num_completions": int(rollout_stats["num_completions"]),
            **train_metrics,
            **synced,
            "step_s": time.perf_counter() - started,
        }
        # Metrics before the checkpoint: a run resumed from checkpoint N has every row up to N.
        log_metrics(config, plan, step, row, fail_at, samples)  # and the step's artifact, in the UI
        if step % config.save_steps == 0 or last_step:
            save_checkpoint(config, plan, step, fail_at)
        return {**row, "next_rollout_stats": next_stats}


@flow(
    name="grpo",
    flow_run_name=grpo_run_name,
    validate_parameters=True,
    on_failure=[release_flow_run_locks],  # the run's writer lock, when it fails before finish_run
    on_crashed=[release_flow_run_locks],
    on_cancellation=[release_flow_run_locks],
)
def grpo(
    config: GRPOFlowConfig, show_progress: bool = False, allow_config_change: bool = False, fail_at: str | None = None
) -> dict[str, Any]:
    """A GRPO run from its config, or the rest of an existing run with the same run_id; returns the
    run's summary (also in summary.json).

    allow_config_change: resume even if a field that alters training differs from the run's.
    fail_at: testing aid, `stage@step` or `stage@step:kill` (see workers/state/faults.py).
    """
    started = time.perf_counter()
    if config.run_id is None:
        config = config.model_copy(update={"run_id": new_run_id(config)})
    if fail_at:
        parse_fail_at(fail_at)  # a bad spec fails here, before anything starts
    plan = prepare_run(config, allow_config_change)
    if (done := completed_summary(plan)) is not None:
        return done
    rollout_version = restore_workers(config, plan) if plan.resumes else 0
    initial_accuracy = evaluate_heldout(config, plan, initial=True)
    progress_artifact = create_run_progress(plan, plan.total_steps, plan.first_step - 1)  # never raises
    rows: list[dict[str, Any]] = []
    step_walls: list[float] = []  # around each subflow call: step work plus Prefect's orchestration
    summary: dict[str, Any] = {"run_id": plan.run_id, "total_steps": plan.total_steps}
    handed_over: dict[str, float] | None = None  # with max_staleness 1: the next step's rollout statistics
    try:
        # Step subflows run inside this flow's process, whose own heartbeat reports the run.
        # Prefect 3.8 joins a heartbeat thread that sleeps in 1 s slices at the end of every
        # flow run, which cost each step about a second; the subflows go without.
        # Artifacts wait while the loop starts and ends subflows and are written inside step bodies:
        # on a SQLite file, beside Prefect's own writes, they made each subflow start stall ~2 s
        # (tasks/observability.py). Without subflows, or on the ephemeral server's in-memory
        # database (flows/__init__.py), nothing can collide, and no step waits for an artifact.
        gate = (
            artifact_writes_paused() if config.step_subflows and not ephemeral_database_in_memory() else nullcontext()
        )
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}), gate:
            progress = tqdm(
                range(plan.first_step, plan.total_steps + 1),
                desc=plan.run_id,
                disable=not show_progress,
                unit="step",
                initial=plan.first_step - 1,
                total=plan.total_steps,
            )
            for step in progress:
                if stop_requested():  # Ctrl-C or SIGTERM in `grpo train` (flows/interrupt.py): stop between steps
                    progress.close()
                    break
                step_started = time.perf_counter()
                # Looked up here at each step (benchmarks/steps.py times them by replacing it).
                step_runner = grpo_step if config.step_subflows else run_step
                row = step_runner(config, plan, step, step - 1, rollout_version, fail_at, handed_over)
                handed_over = row.pop("next_rollout_stats")
                rows.append(row)
                rollout_version = int(rows[-1].get("synced_version", rollout_version))
                step_walls.append(time.perf_counter() - step_started)
                publish(update_run_progress, progress_artifact, step, plan.total_steps)
                progress.set_postfix(reward=f"{rows[-1]['reward']:.3f}", loss=f"{rows[-1]['loss']:.4f}")
    except BaseException as error:
        failed_step = plan.first_step + len(rows)
        summary.update(
            status="failed",
            error=f"step {failed_step}: {type(error).__name__}: {error}",
            failed_step=failed_step,
            steps_completed=failed_step - 1,
            initial_eval_accuracy=initial_accuracy,
        )
        if isinstance(error, KeyboardInterrupt):  # Ctrl-C in a Python session (the API)
            summary = interrupted_summary(summary, plan.run_id, failed_step - 1, plan.total_steps)
        flush_artifacts()
        finish_run(config, plan, summary)
        raise
    if plan.first_step + len(rows) <= plan.total_steps:  # stopped by a signal before the last step
        last_step = plan.first_step + len(rows) - 1
        summary = interrupted_summary(summary, plan.run_id, last_step, plan.total_steps)
        summary.update(initial_eval_accuracy=initial_accuracy, storage=str(plan.storage_root))
        flush_artifacts()
        finish_run(config, plan, summary)
        return Cancelled(  # type: ignore[return-value]
            message=f"interrupted by {stop_signal_name()} after step {last_step} of {plan.total_steps}; "
            f"resume with: {resume_command(plan.run_id, plan.storage_root)}"
        )
    flush_artifacts()  # every step's artifacts written before the run reports its outcome
    final_accuracy = evaluate_heldout(config, plan)
    storage = RunStorage(plan.storage_root, plan.run_id)
    recent = [storage.read_step_metrics(s) for s in range(max(1, plan.total_steps - 4), plan.total_steps + 1)]
    summary.update(
        status="completed",
        steps_completed=plan.total_steps,
        resumed_from_step=plan.first_step - 1 if plan.resumes else None,
        initial_eval_accuracy=initial_accuracy,
        final_eval_accuracy=final_accuracy,
        eval_accuracy_gain=final_accuracy - initial_accuracy,
        final_reward=sum(r["reward"] for r in recent) / len(recent),
        wall_seconds=time.perf_counter() - started,
        median_step_seconds=statistics.median(step_walls) if step_walls else None,
        storage=str(plan.storage_root),
    )
    return finish_run(config, plan, summary)
