"""`grpo-simple`: TRL's own GRPOTrainer loop inside a Prefect flow (`grpo train --simple-mode`).

    prepare_run → trl_train (TRL's loop: generate, score, optimise; metrics and checkpoints
    written to the run's folder as it goes) → finish_run

One task, because TRL's loop is one call; what Prefect adds is the run's record, its
artifact, and the same storage layout as the `grpo` flow. It does not resume: use the
`grpo` flow for runs that must survive a crash.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from grpo_flow.flows.grpo import grpo_run_name
from grpo_flow.flows.run_loop import no_signal_warning
from grpo_flow.schemas.config import new_run_id
from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.schemas.records import RunPlan
from grpo_flow.tasks.observability import USER_FACING
from grpo_flow.tasks.run import finish_run, prepare_run
from grpo_flow.workers.rewards.task import run_task
from grpo_flow.workers.rewards.functions import resolve_reward_funcs
from grpo_flow.workers.state.phase import shown_phases
from grpo_flow.workers.state.storage import RunStorage


@task(name="trl-train", cache_policy=NO_CACHE)
def trl_train(config: GRPOFlowConfig, plan: RunPlan, show_progress: bool = False) -> dict[str, Any]:
    """GRPOTrainer.train() on the run's data and rewards. No retries: TRL's loop is not resumable here."""
    from grpo_flow.workers.actor.simple_mode import train_with_trl

    funcs = resolve_reward_funcs(config.reward_funcs or list(plan.reward_names), plan.run_id)
    rows: list[dict[str, Any]] = []

    def warn_without_signal(row: dict[str, Any]) -> None:
        rows.append(row)
        warning = no_signal_warning(rows, config.no_signal_warning_steps)
        if warning is not None:
            get_run_logger().warning(warning, extra={USER_FACING: True})

    return train_with_trl(
        config, plan, list(funcs.values()), run_task(config).train, show_progress, warn_without_signal
    )


@flow(name="grpo-simple", flow_run_name=grpo_run_name, validate_parameters=True)
def grpo_simple(config: GRPOFlowConfig, show_progress: bool = False) -> dict[str, Any]:
    """A run driven by TRL's GRPOTrainer; returns the run's summary (also in summary.json)."""
    started = time.perf_counter()
    if config.run_id is None:
        config = config.model_copy(update={"run_id": new_run_id(config)})
    assert config.run_id is not None
    if RunStorage.of(config).exists():
        raise ValueError(f"run_id: run {config.run_id!r} exists; simple mode does not resume, choose a new run id")
    with shown_phases(sys.stderr if show_progress else None):  # building or fetching the model
        plan = prepare_run(config, mode="simple")
    summary: dict[str, Any] = {"run_id": plan.run_id, "total_steps": plan.total_steps, "mode": "simple"}
    try:
        output = trl_train(config, plan, show_progress)
    except BaseException as error:
        summary.update(status="failed", error=f"{type(error).__name__}: {error}", steps_completed=0)
        finish_run(config, plan, summary)
        raise
    storage = RunStorage.of(plan)
    rows = storage.read_metrics().to_pylist()
    recent = rows[-5:]
    summary.update(
        status="completed",
        steps_completed=len(rows),
        final_reward=sum(r["reward"] for r in recent) / len(recent) if recent else float("nan"),
        trl_output=output,
        wall_seconds=time.perf_counter() - started,
        storage=str(plan.storage_root),
    )
    return finish_run(config, plan, summary)
