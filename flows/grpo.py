"""The `grpo` flow: one run, as a subflow per training step.

    prepare_run → start_workers (at the resume checkpoint, when resuming) → evaluate_heldout (initial)
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
between steps: summary.json says `interrupted`, and the flow run ends Cancelled. What the loop
needs from Prefect and the terminal (heartbeat, artifact gate, progress, signals, finishing the
run) is in flows/run_loop.py.

Runs on Prefect's ephemeral server when PREFECT_API_URL is unset, on a real server otherwise.
Where it departs from the GRPO paper: the loss is TRL's `loss_type` (dapo by default), not the
paper's per-sequence mean; num_iterations (GRPO's mu) defaults to 1, as TRL's.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, NamedTuple

from prefect import flow, unmapped
from prefect.runtime import flow_run

from grpo_flow.flows.quiet import keep_completed_states_out, quiet_libraries
from grpo_flow.flows.run_loop import RunLoop, as_is, in_background, step_subflow
from grpo_flow.schemas.config import GRPOFlowConfig, new_run_id
from grpo_flow.schemas.records import RunPlan
from grpo_flow.tasks import with_retries
from grpo_flow.tasks.rollout import (
    check_metric_names,
    generate,
    keep_informative_groups,
    log_rollouts,
    logged_reward_stats,
    sample_batch,
    score,
)
from grpo_flow.tasks.run import completed_summary, evaluate_heldout, prepare_run, release_flow_run_locks
from grpo_flow.tasks.train import actor_step, log_metrics, save_checkpoint, start_workers, sync_weights
from grpo_flow.workers import backends
from grpo_flow.workers.state.phase import say, shown_phases
from grpo_flow.workers.state.faults import fail_at
from grpo_flow.workers.state.storage import RunStorage


def grpo_run_name() -> str:
    """The flow run is named after the run id, so the Prefect UI and the storage root agree."""
    config = flow_run.parameters.get("config")
    run_id = config.get("run_id") if isinstance(config, dict) else getattr(config, "run_id", None)
    return run_id or "grpo-new-run"


def generate_shards(config: GRPOFlowConfig, plan: RunPlan, shards: list, rollout_version: int) -> list:
    """generate.map over the step's prompt shards, resolved. Engines in this process generate one at
    a time anyway, so their shards (and a single shard anywhere) are generated on the calling thread,
    one task run each: torch then keeps one set of OpenMP threads."""
    generate_shard = with_retries(generate, config.generate_retries, config.retry_delay_seconds)
    if len(shards) == 1 or backends.engines_in_this_process(config):
        return [generate_shard(config, plan, shard, rollout_version) for shard in shards]
    return generate_shard.map(unmapped(config), unmapped(plan), shards, unmapped(rollout_version)).result()


def score_shards(config: GRPOFlowConfig, plan: RunPlan, generated: list) -> list:
    """score.map over the generated shards, resolved, with the run's retry policy."""
    score_shard = with_retries(score, config.score_retries, config.retry_delay_seconds)
    return score_shard.map(unmapped(config), unmapped(plan), as_is(generated)).result()


def refill_with_informative_groups(
    config: GRPOFlowConfig, plan: RunPlan, step: int, rollout_version: int, scored: list
) -> tuple[list, dict[str, float]]:
    """DAPO's dynamic sampling: drop groups whose rewards tie, refill from further prompts for up
    to dynamic_sampling_max_rounds extra rounds. If no group carries signal, the step keeps its
    own batch (its advantages are zero: the actor step changes nothing but the optimizer state)."""
    kept, dropped = keep_informative_groups(config, [None] * len(scored), as_is(scored))
    rounds = 0
    target = config.prompts_per_step * config.num_generations
    while sum(len(b) for b in kept) < target and rounds < config.dynamic_sampling_max_rounds:
        rounds += 1
        shards = sample_batch(config, plan, step, refill_round=rounds)
        rescored = score_shards(config, plan, generate_shards(config, plan, shards, rollout_version))
        kept, more = keep_informative_groups(config, as_is(kept), as_is(rescored))
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
    config: GRPOFlowConfig, plan: RunPlan, step: int, rollout_version: int
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """sample_batch → generate.map → score.map → [dynamic sampling] → log_rollouts (advantages,
    write, commit): the step's rows logged; returns its reward statistics and the three
    completions its artifact shows.

    Each mapped stage is resolved before the next, so a failure surfaces as the failing task's
    own exception rather than as a missing input further down.
    """
    shards = sample_batch(config, plan, step)
    scored = score_shards(config, plan, generate_shards(config, plan, shards, rollout_version))
    sampling_stats: dict[str, float] = {}
    if config.dynamic_sampling:
        scored, sampling_stats = refill_with_informative_groups(config, plan, step, rollout_version, scored)
    reward_stats, samples = log_rollouts(config, plan, step, as_is(scored))
    stats = {
        **reward_stats,
        **sampling_stats,
        "num_completions": float(sum(len(b) for b in scored)),
        "time/generate_s": sum(b.generate_s for b in scored),
        "time/score_s": sum(b.score_s for b in scored),
    }
    return stats, samples


class StepResult(NamedTuple):
    """What a step hands the loop: its metrics row, the version the rollout workers hold after it (its
    weight sync's, else the one they held), and with max_staleness 1 the next step's rollout statistics,
    produced during this step and given back to the next as its `rollout_stats`."""

    row: dict[str, Any]
    rollout_version: int
    next_rollout_stats: dict[str, float] | None


def run_step(
    config: GRPOFlowConfig,
    plan: RunPlan,
    step: int,
    policy_version: int,
    rollout_version: int,
    rollout_stats: dict[str, float] | None = None,
) -> StepResult:
    """One training step; returns its metrics row (also logged as Parquet), the rollout workers' version
    after it and, when it produced them, the next step's rollout statistics (see StepResult).

    `policy_version` is the actor's before the step, `rollout_version` the one the rollout
    workers must hold (a worker holding another is brought to it first). A step whose rollouts
    are already logged (before a crash) trains on them as logged: nothing is generated again.
    With max_staleness 1 the next step's rollouts are produced on another thread while the actor
    steps (one-step-off); `rollout_stats` are then this step's, handed over from the step before.
    """
    started = time.perf_counter()
    logged = RunStorage.of(plan).rollouts_committed
    samples = None  # the artifact's three completions; None: read back from the logged rollouts
    if not logged(step):
        rollout_stats, samples = produce_rollouts(config, plan, step, rollout_version)
    elif rollout_stats is None:  # a replay
        num_completions, logged_stats = logged_reward_stats(config, plan, step)
        rollout_stats = {**logged_stats, "num_completions": float(num_completions), "replayed": 1.0}
    next_rollouts = None
    if config.max_staleness and step < plan.total_steps and not logged(step + 1):
        # Generated with the weights the rollout workers hold now, i.e. before this actor step.
        next_rollouts = in_background(produce_rollouts, config, plan, step + 1, rollout_version)
    try:
        train_metrics = with_retries(actor_step, config.actor_retries, config.retry_delay_seconds)(
            config, plan, step, policy_version
        )
    finally:  # the weights change at the sync below, so the next step's generation must be over first
        next_stats = next_rollouts.result()[0] if next_rollouts is not None else None
    last_step = step == plan.total_steps
    synced = sync_weights(config, plan) if step % config.sync_weights_every == 0 or last_step else {"sync/bytes": 0.0}
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
    log_metrics(config, plan, step, row, samples)  # and the step's artifact, in the UI
    if step % config.save_steps == 0 or last_step:
        save_checkpoint(config, plan, step)
    return StepResult(row, int(synced.get("synced_version", rollout_version)), next_stats)


grpo_step = step_subflow(run_step)


@flow(
    name="grpo",
    flow_run_name=grpo_run_name,
    validate_parameters=True,
    on_failure=[release_flow_run_locks],  # the run's writer lock, when it fails before finish_run
    on_crashed=[release_flow_run_locks],
    on_cancellation=[release_flow_run_locks],
)
def grpo(
    config: GRPOFlowConfig,
    show_progress: bool = False,
    allow_config_change: bool = False,
    progress_every: int = 0,
    verbose: bool = False,
) -> dict[str, Any]:
    """A GRPO run from its config, or the rest of an existing run with the same run_id; returns the
    run's summary (also in summary.json).

    allow_config_change: resume even if a field that alters training differs from the run's.
    progress_every: with show_progress, a line every this many steps when not on a terminal (0: ten a run).
    verbose: keep transformers' and datasets' progress bars ("Loading weights", "Writing model shards")
    and advisory warnings, as `grpo train --verbose` does; otherwise they stay out of the run.
    """
    if config.run_id is None:
        config = config.model_copy(update={"run_id": new_run_id(config)})
    fail_at()  # a bad GRPO_FLOW_FAIL_AT fails here, before anything starts
    keep_completed_states_out()  # the run's log tab: one line per step, not one per task run
    # Here rather than in the CLI alone, so that a call from Python and a deployment run are quiet too.
    with (
        contextlib.nullcontext() if verbose else quiet_libraries(),
        shown_phases(sys.stderr if show_progress else None),
    ):
        return run_grpo(config, allow_config_change, show_progress, progress_every)


def run_grpo(config: GRPOFlowConfig, allow_config_change: bool, show_progress: bool, progress_every: int) -> Any:
    """The grpo flow's body: plan the run (the model made ready), then its loop."""
    plan = prepare_run(config, allow_config_change)
    if (done := completed_summary(plan)) is not None:
        return done
    train_step = grpo_step if config.step_subflows else run_step
    with RunLoop(config, plan, show_progress, progress_every) as run:
        say(f"starting the actor and {config.num_rollout_workers} rollout worker(s) on {config.model}")
        rollout_version = start_workers(config, plan)
        run.initial_accuracy = evaluate_heldout(config, plan, initial=True)
        handed_over = None
        for step in run.steps():
            stepped = train_step(config, plan, step, step - 1, rollout_version, handed_over)
            run.record(stepped.row)
            rollout_version, handed_over = stepped.rollout_version, stepped.next_rollout_stats
        if run.finished:
            run.final_accuracy = evaluate_heldout(config, plan)
    return run.result
