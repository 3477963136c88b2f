"""Reward functions with TRL's signature, and the scoring of a rollout shard.

A reward function is called as TRL calls it: `func(prompts=..., completions=...,
completion_ids=..., **dataset_columns)` and returns one float (or None: "does not apply")
per completion. The total reward is the weighted sum of the functions that apply
(TRL's nansum rule).
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from schemas.records import RolloutBatch
from workers.data import extract_final_number

RewardFunc = Callable[..., list[float | None]]


def last_digit(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion is exactly the expected digit."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def gsm8k_accuracy(completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion's final number equals the reference answer."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        found = extract_final_number(text)
        try:
            scores.append(1.0 if found is not None and float(found) == float(expected) else 0.0)
        except ValueError:
            scores.append(0.0)
    return scores


def _environment_rewards() -> dict[str, RewardFunc]:
    from workers.environments import (
        CodeTestsEnvironment,
        MathAnswerEnvironment,
        answer_tag_format,
        as_reward_function,
        think_answer_format,
    )

    return {
        "math_accuracy": as_reward_function(MathAnswerEnvironment(), "math_accuracy"),
        "mbpp_tests": as_reward_function(CodeTestsEnvironment(), "mbpp_tests"),
        "mbpp_tests_partial": as_reward_function(CodeTestsEnvironment(partial_credit=True), "mbpp_tests_partial"),
        "think_answer_format": think_answer_format,
        "answer_tag_format": answer_tag_format,
    }


BUILTIN_REWARDS: dict[str, RewardFunc] = {
    "last_digit": last_digit,
    "gsm8k_accuracy": gsm8k_accuracy,
    **_environment_rewards(),
}


def resolve_reward_funcs(names: Sequence[str]) -> dict[str, RewardFunc]:
    """Built-in names or `module:function` paths, resolved before anything loads."""
    funcs: dict[str, RewardFunc] = {}
    for index, name in enumerate(names):
        if name in BUILTIN_REWARDS:
            funcs[name] = BUILTIN_REWARDS[name]
            continue
        module_name, _, attr = name.partition(":")
        if not attr:
            raise ValueError(
                f"reward_funcs[{index}]: {name!r} is neither a built-in reward "
                f"({', '.join(sorted(BUILTIN_REWARDS))}) nor a 'module:function' path"
            )
        try:
            func = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"reward_funcs[{index}]: cannot import {name!r}: {error}") from error
        if not callable(func):
            raise ValueError(f"reward_funcs[{index}]: {name!r} is not callable")
        funcs[attr] = func
    return funcs


def check_scores(name: str, scores: Any, expected: int) -> list[float]:
    """Scores as floats (None becomes NaN); a wrong count, a non-number, NaN or infinity is an error."""
    if not isinstance(scores, (list, tuple)) or len(scores) != expected:
        count = len(scores) if hasattr(scores, "__len__") else type(scores).__name__
        raise ValueError(f"reward function {name!r} returned {count} scores for {expected} completions")
    checked = []
    for index, score in enumerate(scores):
        if score is None:
            checked.append(math.nan)
            continue
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise ValueError(f"reward function {name!r} returned {score!r} for sample {index}; expected a finite number")
        checked.append(float(score))
    return checked


def score_batch(
    batch: RolloutBatch, funcs: dict[str, RewardFunc], weights: Sequence[float] | None
) -> RolloutBatch:
    """Each function's scores and the weighted total, as new columns of the batch."""
    started = time.perf_counter()
    weights = list(weights) if weights is not None else [1.0] * len(funcs)
    per_func: dict[str, list[float]] = {}
    for name, func in funcs.items():
        raw = func(
            prompts=batch.prompt,
            completions=batch.completion,
            completion_ids=batch.completion_token_ids,
            **batch.extra_columns,
        )
        per_func[name] = check_scores(name, raw, len(batch))
    totals = []
    for i in range(len(batch)):
        applied = [w * per_func[name][i] for name, w in zip(per_func, weights) if not math.isnan(per_func[name][i])]
        totals.append(sum(applied) if applied else math.nan)
    return batch.replace(
        rewards={name: [None if math.isnan(s) else s for s in scores] for name, scores in per_func.items()},
        reward=totals,
        reward_error=[None] * len(batch),
        score_s=time.perf_counter() - started,
    )
