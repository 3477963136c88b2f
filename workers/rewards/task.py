"""The task a run trains and evaluates on, with its accuracy reward resolved: data (workers/data) and
reward functions (this package) together, so it lives above both.

Imports no model library; from grpo-flow, `grpo_flow.workers.data` and this package's functions.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from grpo_flow.workers.data.loaders import (
    DEFAULT_REWARDS,
    HELDOUT_FRACTION,
    TaskData,
    cached_task,
    load_custom_task,
    load_task,
    with_user_messages,
)
from grpo_flow.workers.rewards.functions import resolve_reward_funcs, reward_key


def run_task(config: Any) -> TaskData:
    """The task a run trains and evaluates on (`config`: its GRPOFlowConfig): `load_task(config.dataset)`,
    with an `hf:` data set's held-out prompts and accuracy reward as its accuracy_reward says, and its
    plain-string prompts as user messages where config.string_prompts says so."""
    entry, fraction = None, 0.0
    if config.dataset.startswith("hf:"):
        entry = accuracy_entry(config)
        fraction = HELDOUT_FRACTION if entry and config.eval_prompts else 0.0
    if config.string_prompts == "user_message":
        return _user_message_task(config.dataset, fraction, entry)
    return _dataset_task(config.dataset, fraction, entry)


def _dataset_task(dataset: str, fraction: float, accuracy: str | None) -> TaskData:
    return _load_scored_task(dataset, fraction, accuracy) if dataset.startswith("hf:") else load_task(dataset)


@cached_task
def _user_message_task(dataset: str, fraction: float, accuracy: str | None) -> TaskData:
    return with_user_messages(_dataset_task(dataset, fraction, accuracy))


def accuracy_entry(config: Any) -> str | None:
    """config.accuracy_reward as a reward_funcs entry: one of them by its name (`exact` for
    `my_rewards:exact`), else as given (a built-in or a `module:function` path)."""
    if not config.accuracy_reward:
        return None
    names = list(config.reward_funcs) or list(DEFAULT_REWARDS.get(config.dataset, ()))
    return {reward_key(name): name for name in names}.get(config.accuracy_reward, config.accuracy_reward)


@cached_task
def _load_scored_task(dataset: str, fraction: float, accuracy: str | None) -> TaskData:
    task = load_custom_task(dataset.removeprefix("hf:"), heldout_fraction=fraction)
    if accuracy is None:
        return task
    ((name, function),) = resolve_reward_funcs([accuracy]).items()
    return replace(task, accuracy_reward=name, accuracy_function=function)
