"""Run-level tasks: resolve everything once before work starts, evaluate, summarise."""

from __future__ import annotations

import functools
import json
import re
import uuid
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run as current_flow_run

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.schemas.records import REWARD_PREFIX, RunPlan
from grpo_flow.tasks.observability import USER_FACING
from grpo_flow.workers import backends
from grpo_flow.workers.rewards.task import run_task
from grpo_flow.workers.rollout.base import check_chat_prompts, load_generation_tokenizer, string_prompts_warning
from grpo_flow.workers.rollout.heldout import accuracy_reward, heldout_accuracy
from grpo_flow.workers.state.location import use_storage_options
from grpo_flow.workers.state.lock import hold_run_lock, release_run_lock, release_run_locks_of
from grpo_flow.workers.state.resume import (
    check_config_change,
    check_max_steps,
    check_resumable,
    data_fingerprint,
    find_resume_point,
    record_resume,
)
from grpo_flow.workers.rewards.functions import RewardTrainerState, resolve_reward_funcs
from grpo_flow.workers.state.storage import RunStorage
from grpo_flow.workers.data.models import resolve_model_path
from grpo_flow.workers.state.phase import say
from grpo_flow.workers.data.tiny_model import read_build_info
from grpo_flow.workers.state.tracking import undelivered, wandb_finish


def check_run_start(config: GRPOFlowConfig, allow_config_change: bool = False) -> RunStorage:
    """A new run, or an existing one that may be resumed with this config; raises ResumeError naming the problem.

    Reads only: safe to call from the command line before the flow starts.
    """
    storage = RunStorage.of(config)
    if storage.exists():
        check_resumable(storage)
        check_config_change(storage, config, allow_config_change)
    return storage


@task(name="prepare-run", cache_policy=NO_CACHE)
def prepare_run(config: GRPOFlowConfig, allow_config_change: bool = False, mode: str = "grpo") -> RunPlan:
    """Validate rewards, data and model before writing anything; then create the run, or find where it
    stands. `mode`: the loop that trains it (`simple`: TRL's), recorded in run.json."""
    # One writer per run: raises RunLockedError naming a live holder. Released by finish_run, or by
    # the flow's state hooks (release_flow_run_locks) when the run fails before it gets there.
    use_storage_options(config.storage_root, config.storage_options)
    hold_run_lock(RunStorage.of(config).run_dir, owner=current_flow_run.get_id())
    storage = check_run_start(config, allow_config_change)
    backends.check_backend_ready(config)
    task_data = run_task(config)
    funcs = resolve_reward_funcs(config.reward_funcs or task_data.default_rewards, config.run_id)
    model_path = resolve_model_path(config.model, config.storage_root, config.chat_template)
    environment_rewards: list[str] = []
    if config.tools or config.environment_factory:  # the toolbox, the data's prompts, the chat template
        from grpo_flow.workers.rollout.episodes import check_episodes

        environment_rewards = check_episodes(config, task_data, model_path, list(funcs))
    if not funcs and not environment_rewards:
        raise ValueError(f"reward_funcs: data set {config.dataset!r} has no default rewards; give reward_funcs")
    if config.reward_weights is not None and len(config.reward_weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(config.reward_weights)} values for {len(funcs)} reward functions")
    taken = sorted(REWARD_PREFIX + name for name in funcs if REWARD_PREFIX + name in task_data.extra_columns)
    if taken:
        raise ValueError(f"dataset: columns {taken} clash with the reward columns of the rollout log; rename them")
    if Path(model_path).is_dir():  # a hub model not downloaded yet is checked where it loads
        splits = {"train": task_data.train["prompt"], "heldout": task_data.heldout["prompt"]}
        load = functools.partial(load_generation_tokenizer, model_path)
        check_chat_prompts(load, config.model, splits)
        warning = string_prompts_warning(config.string_prompts, task_data.train[0]["prompt"], load, config.model)
        if warning is not None:  # on the terminal, once, at the start
            get_run_logger().warning(warning, extra={USER_FACING: True})
        if config.use_lora and config.lora_target_modules:
            check_lora_targets(model_path, config.lora_target_modules)
    total_steps = config.total_steps(len(task_data.train))
    session = uuid.uuid4().hex[:12]
    if storage.exists():
        changes = check_config_change(storage, config, allow_config_change)
        check_max_steps(storage, total_steps)  # again: with max_steps -1 the total is known only here
        point = find_resume_point(storage)
        record_resume(storage, config, point, changes, session)
        resume: dict[str, Any] = {
            "resume_checkpoint": point.checkpoint_step,
            "replay_steps": point.replay_steps,
            "first_step": point.first_step,
            "resumes": storage.resume_count(),
        }
        get_run_logger().info(
            "resuming run %s: checkpoint %s, replaying logged steps %s, then from step %d",
            storage.run_id,
            point.checkpoint_step,
            list(point.replay_steps),
            point.first_step + len(point.replay_steps),
        )
        for moved in point.moved:  # on the console too, not only in Prefect's log
            get_run_logger().warning(f"run {storage.run_id}: {moved}", extra={USER_FACING: True})
    else:
        storage.clean_temps()
        storage.write_config(config.model_dump(mode="json"), mode=mode, dataset_sha256=data_fingerprint(config.dataset))
        resume = {}
    return RunPlan(
        run_id=storage.run_id,
        storage_root=config.storage_root,
        model_path=model_path,
        total_steps=total_steps,
        reward_names=(*funcs, *environment_rewards),
        extra_columns=tuple(task_data.extra_columns),
        num_train_prompts=len(task_data.train),
        run_uid=storage.run_uid(),
        session=session,
        environment_rewards=tuple(environment_rewards),
        **resume,
    )


@task(name="evaluate-heldout", cache_policy=NO_CACHE)
def evaluate_heldout(config: GRPOFlowConfig, plan: RunPlan, initial: bool = False) -> float:
    """Greedy held-out accuracy of the policy the rollout workers hold now.

    The initial figure is recorded once (eval/initial.json); a resumed run reads it back
    rather than measuring a policy that has already trained.
    """
    storage = RunStorage.of(plan)
    if initial and (recorded := storage.read_initial_eval()) is not None:
        return recorded
    trained = plan.resume_checkpoint is not None or bool(plan.replay_steps)
    if config.eval_prompts == 0 or (initial and trained):  # the initial policy is gone
        return float("nan")
    task_data = run_task(config)
    prompts = min(config.eval_prompts, len(task_data.heldout))
    if prompts == 0 or accuracy_reward(task_data) is None:  # nothing held out, or nothing to score it with
        return float("nan")
    say(f"evaluating on {prompts} held-out prompts {'before' if initial else 'after'} training")
    engine = backends.run_workers(config).engine_at_current_version()
    total_steps = plan.total_steps
    # Rewards are called as in training; trainer_state says where the policy stands.
    state = RewardTrainerState(
        global_step=0 if initial else total_steps,
        max_steps=total_steps,
        epoch=0.0 if initial else total_steps * config.prompts_per_step / max(1, len(task_data.train)),
    )
    episodes = None
    if config.tools or config.environment_factory:  # greedy multi-turn episodes, tools called as in training
        from grpo_flow.workers.rollout.episodes import EpisodeRunner

        episodes = EpisodeRunner.from_config(config, plan.model_path)
    accuracy = heldout_accuracy(
        engine,
        task_data,
        prompts,
        config.max_completion_length,
        config.max_prompt_length,
        state=state,
        episodes=episodes,
    )
    if initial:
        storage.write_initial_eval(accuracy)
    return accuracy


def check_lora_targets(model_path: str | Path, targets: list[str]) -> None:
    """Each of lora_target_modules names modules of the model (peft's rule: the module's name, or its
    last dotted parts), checked on the model's shape without its weights, before it loads."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    names = [name for name, _ in model.named_modules() if name]
    missing = [t for t in targets if not any(name == t or name.endswith("." + t) for name in names)]
    if missing:
        leaves = sorted(
            {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if not list(module.children())}
        )
        raise ValueError(
            f"lora_target_modules: {missing} name no module of the model; its layers are called {', '.join(leaves)}"
        )


def completed_summary(plan: RunPlan) -> dict[str, Any] | None:
    """A resumed run with nothing left to train: its summary as it stands (not written again, no model
    loaded, nothing evaluated again), flagged `already_completed`, and its writer lock released."""
    storage = RunStorage.of(plan)
    summary = storage.read_summary() if plan.resumes and plan.first_step > plan.total_steps else None
    if not summary or summary.get("status") != "completed" or summary.get("steps_completed") != plan.total_steps:
        return None
    release_run_lock(storage.run_dir)
    return {**summary, "already_completed": True}


def model_figures(config: GRPOFlowConfig, model_path: str | Path) -> dict[str, Any]:
    """A built model's own record (`model_heldout_accuracy_random_init`, ...), for a run on the task its
    accuracies were measured on; a run on other data would report figures that are not its own."""
    built = read_build_info(model_path)
    if built.get("warm_start_task") != config.dataset:
        return {}
    return {f"model_{key}": value for key, value in built.items()}


@task(name="finish-run", cache_policy=NO_CACHE)
def finish_run(config: GRPOFlowConfig, plan: RunPlan, summary: dict[str, Any]) -> dict[str, Any]:
    """summary.json, a Prefect artifact with the outcome, and the workers released."""
    summary = {**summary, **model_figures(config, plan.model_path)}
    if config.report_to == "wandb":  # each step's row delivered, or counted here
        summary["wandb_steps_not_delivered"] = undelivered(plan.run_id)
    RunStorage.of(plan).write_summary(summary)
    create_markdown_artifact(
        key=re.sub(r"[^a-z0-9-]", "-", f"grpo-summary-{plan.run_id}".lower()),
        markdown="## grpo-flow run `" + plan.run_id + "`\n\n```json\n" + json.dumps(summary, indent=2) + "\n```",
        description=f"Outcome of run {plan.run_id}",
    )
    wandb_finish(plan.run_id)
    backends.release(plan.run_id)
    release_run_lock(RunStorage.of(plan).run_dir)
    return summary


def release_flow_run_locks(flow: Any, flow_run: Any, state: Any) -> None:
    """State hook of the `grpo` flow: a run that fails or crashes before finish_run gives its
    writer lock back, so a later start in the same process (a notebook, a server) is not refused."""
    release_run_locks_of(str(flow_run.id))
