"""Run-level tasks: resolve everything once before work starts, evaluate, summarise."""

from __future__ import annotations

import json
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from schemas.config import GRPOFlowConfig
from schemas.records import RunPlan
from workers import local
from workers.data import load_task
from workers.evaluation import heldout_accuracy
from workers.rewards import resolve_reward_funcs
from workers.storage import RunStorage
from workers.tiny_model import read_build_info, resolve_model_path
from workers.tracking import wandb_finish


def check_new_run(config: GRPOFlowConfig) -> RunStorage:
    storage = RunStorage(config.storage_root, config.run_id or "")
    if storage.exists():
        raise FileExistsError(
            f"run_id: run {config.run_id!r} already exists in {storage.run_dir}; "
            "resuming runs is not supported in this release, choose another --run-id"
        )
    return storage


@task(name="prepare-run", cache_policy=NO_CACHE)
def prepare_run(config: GRPOFlowConfig) -> RunPlan:
    """Validate rewards, data and model before writing anything; then freeze config.json."""
    storage = check_new_run(config)
    task_data = load_task(config.dataset)
    funcs = resolve_reward_funcs(config.reward_funcs or task_data.default_rewards)
    if config.reward_weights is not None and len(config.reward_weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(config.reward_weights)} values for {len(funcs)} reward functions")
    model_path = resolve_model_path(config.model, config.storage_root)
    storage.write_config(config.model_dump(mode="json"))
    return RunPlan(
        run_id=storage.run_id,
        storage_root=config.storage_root,
        model_path=model_path,
        total_steps=config.total_steps(len(task_data.train)),
        reward_names=tuple(funcs),
        extra_columns=tuple(task_data.extra_columns),
        num_train_prompts=len(task_data.train),
    )


@task(name="evaluate-heldout", cache_policy=NO_CACHE)
def evaluate_heldout(config: GRPOFlowConfig, plan: RunPlan) -> float:
    """Greedy held-out accuracy of the policy the rollout workers hold now."""
    if config.eval_prompts == 0:
        return float("nan")
    engine = local.local_workers(config, plan.model_path).rollout[0]
    return heldout_accuracy(
        engine, load_task(config.dataset), config.eval_prompts, config.max_completion_length, config.max_prompt_length
    )


@task(name="finish-run", cache_policy=NO_CACHE)
def finish_run(config: GRPOFlowConfig, plan: RunPlan, summary: dict[str, Any]) -> dict[str, Any]:
    """summary.json, a Prefect artifact with the outcome, and the workers released."""
    summary = {**summary, **{f"model_{k}": v for k, v in read_build_info(plan.model_path).items()}}
    RunStorage(plan.storage_root, plan.run_id).write_summary(summary)
    create_markdown_artifact(
        key=f"grpo-summary-{plan.run_id}".lower().replace("_", "-").replace(".", "-"),
        markdown="## grpo-flow run `" + plan.run_id + "`\n\n```json\n" + json.dumps(summary, indent=2) + "\n```",
        description=f"Outcome of run {plan.run_id}",
    )
    wandb_finish(plan.run_id)
    local.release(plan.run_id)
    return summary
