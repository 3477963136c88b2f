"""Held-out accuracy: greedy completions of prompts the run never trains on, scored 0/1."""

from __future__ import annotations

from typing import Any

from grpo_flow.workers.data.loaders import TaskData
from grpo_flow.workers.rewards.functions import BUILTIN_REWARDS, RewardTrainerState, check_scores, trl_completions
from grpo_flow.workers.rollout.base import SamplingParams


def heldout_accuracy(
    engine: Any,
    task: TaskData,
    limit: int,
    max_tokens: int,
    max_prompt_length: int | None = None,
    batch_size: int = 64,
    state: RewardTrainerState | None = None,
    episodes: Any = None,
) -> float:
    """Fraction of the first `limit` held-out prompts whose greedy completion scores 1.0 (`engine`: anything
    with a rollout engine's `generate`). The accuracy
    reward is called as TRL calls reward functions (prompts, completions, completion_ids, the data
    set's columns, trainer_state, log_extra, log_metric), so a user's training reward can serve. With
    `episodes` (an EpisodeRunner: a run with tools or environments), each prompt is a greedy multi-turn
    episode, scored on its messages (and environments) as in training."""
    if task.accuracy_reward is None:  # a custom data set given no 0/1 reward: nothing to measure
        return float("nan")
    rows = task.heldout.select(range(min(limit, len(task.heldout))))
    reward = task.accuracy_function or BUILTIN_REWARDS[task.accuracy_reward]
    correct = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows.select(range(start, min(start + batch_size, len(rows))))
        greedy = SamplingParams(max_tokens=max_tokens, greedy=True)
        more: dict[str, Any] = {}
        if episodes is None:
            result = engine.generate(chunk["prompt"], greedy, max_prompt_length)
            prompts, completions = chunk["prompt"], trl_completions(chunk["prompt"], result.texts)
            completion_ids = result.completion_token_ids
        else:
            played, starts, environments, _ = episodes.play(
                lambda ids, params: engine.generate(ids, params, None), list(chunk), 1, greedy
            )
            prompts, completions = [s.prompt for s in starts], [e.messages for e in played]
            completion_ids = [e.completion_ids for e in played]
            more = {"environments": environments} if episodes.toolbox.factories is not None else {}
        scores = reward(
            prompts=prompts,
            completions=completions,
            completion_ids=completion_ids,
            **{c: chunk[c] for c in task.extra_columns},
            trainer_state=state,
            log_extra=lambda column, values: None,  # held-out scoring logs nothing
            log_metric=lambda name, value: None,
            **more,
        )
        correct += sum(1 for s in check_scores(task.accuracy_reward, scores, len(chunk)) if s == 1.0)
    return correct / len(rows) if len(rows) else 0.0
