"""Held-out accuracy: greedy completions of prompts the run never trains on, scored 0/1.

The one greedy evaluation path: a run's held-out accuracy (`heldout_accuracy`, tasks/run.py) and `grpo
eval`'s greedy accuracy (flows/evaluate.py, which also samples k completions for pass@k) both generate
with `greedy_batch` and score with `correct`, the accuracy reward called as training calls rewards.
"""

from __future__ import annotations

from typing import Any

from grpo_flow.schemas.records import RolloutBatch
from grpo_flow.workers.data.loaders import TaskData
from grpo_flow.workers.rewards.functions import BUILTIN_REWARDS, RewardTrainerState, score_batch
from grpo_flow.workers.rollout.base import GenerationResult, SamplingParams


def accuracy_reward(task: TaskData) -> tuple[str, Any] | None:
    """The data set's 0/1 reward, (name, function); None for a custom data set given none."""
    if task.accuracy_reward is None:
        return None
    return task.accuracy_reward, task.accuracy_function or BUILTIN_REWARDS[task.accuracy_reward]


def answered(engine: Any, result: GenerationResult) -> GenerationResult:
    """`result` with what a rollout worker adds to its answer (workers/backends/servers.py): the worker id,
    policy version and decoded prompts, for an engine called in this process (answers through `Workers`
    carry them already)."""
    if "prompt_texts" not in result.extra:
        prompt_texts = engine.tokenizer.batch_decode(result.prompt_token_ids)
        result.extra.update(worker_id=engine.worker_id, policy_version=engine.policy_version, prompt_texts=prompt_texts)
    return result


def greedy_batch(
    engine: Any,
    rows: list[dict[str, Any]],
    max_tokens: int,
    max_prompt_length: int | None,
    *,
    run_id: str,
    step: int,
    columns: list[str],
    episodes: Any = None,
) -> RolloutBatch:
    """One greedy completion of each row (`engine`: anything with a rollout engine's `generate`); with
    `episodes` (an EpisodeRunner: a run with tools or environments), one greedy multi-turn episode."""
    greedy = SamplingParams(max_tokens=max_tokens, greedy=True)
    if episodes is not None:
        turn = lambda ids, params: answered(engine, engine.generate(ids, params, None))  # noqa: E731 - token ids
        return episodes.batch(turn, rows, 1, greedy, run_id=run_id, step=step, columns=columns)
    result = answered(engine, engine.generate([row["prompt"] for row in rows], greedy, max_prompt_length))
    return RolloutBatch.from_generation(rows, result, run_id=run_id, step=step, columns=columns)


def correct(batch: RolloutBatch, accuracy: tuple[str, Any] | None, state: Any = None) -> list[bool | None]:
    """Each completion's 0/1 correctness by the accuracy reward (None where it does not apply, or without
    one). Its column is reused when the batch was scored with it (code rewards run sandboxes: never twice)."""
    if accuracy is None:
        return [None] * len(batch)
    name, func = accuracy
    scores = batch.rewards.get(name)
    if scores is None:
        scores = score_batch(batch, {name: func}, None, state).rewards[name]
    return [None if s is None else s == 1.0 for s in scores]


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
    """Fraction of the first `limit` held-out prompts whose greedy completion scores 1.0. The accuracy
    reward is called as TRL calls reward functions (prompts, completions, completion_ids, the data set's
    columns, trainer_state, log_extra, log_metric), so a user's training reward can serve; an episode
    is scored on its messages (and environments) as in training."""
    accuracy = accuracy_reward(task)
    if accuracy is None:  # a custom data set given no 0/1 reward: nothing to measure
        return float("nan")
    rows = list(task.heldout.select(range(min(limit, len(task.heldout)))))
    step, columns = (state.global_step if state is not None else 0), task.extra_columns
    hits = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        batch = greedy_batch(
            engine,
            chunk,
            max_tokens,
            max_prompt_length,
            run_id="heldout",
            step=step,
            columns=columns,
            episodes=episodes,
        )
        hits += sum(1 for c in correct(batch, accuracy, state) if c)
    return hits / len(rows) if rows else 0.0
