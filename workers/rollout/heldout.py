"""Held-out accuracy: greedy completions of prompts the run never trains on, scored 0/1."""

from __future__ import annotations

from workers.data.loaders import TaskData
from workers.rewards.functions import BUILTIN_REWARDS, check_scores
from workers.rollout.base import SamplingParams
from workers.rollout.transformers_engine import TransformersRolloutEngine


def heldout_accuracy(
    engine: TransformersRolloutEngine,
    task: TaskData,
    limit: int,
    max_tokens: int,
    max_prompt_length: int | None = None,
    batch_size: int = 64,
) -> float:
    """Fraction of the first `limit` held-out prompts whose greedy completion scores 1.0."""
    if task.accuracy_reward is None:  # a custom data set given no 0/1 reward: nothing to measure
        return float("nan")
    rows = task.heldout.select(range(min(limit, len(task.heldout))))
    reward = BUILTIN_REWARDS[task.accuracy_reward]
    correct = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows.select(range(start, min(start + batch_size, len(rows))))
        result = engine.generate(chunk["prompt"], SamplingParams(max_tokens=max_tokens, greedy=True), max_prompt_length)
        columns = {c: chunk[c] for c in task.extra_columns}
        scores = check_scores(task.accuracy_reward, reward(completions=result.texts, **columns), len(chunk))
        correct += sum(1 for s in scores if s == 1.0)
    return correct / len(rows) if len(rows) else 0.0
