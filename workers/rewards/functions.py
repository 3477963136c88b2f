"""Reward functions with TRL's signature, and the scoring of a rollout shard.

A reward function is called as TRL calls it: `func(prompts=..., completions=...,
completion_ids=..., **dataset_columns)` and returns one float (or None: "does not apply")
per completion. The total reward is the weighted sum of the functions that apply
(TRL's nansum rule).

With a timeout (the config's `reward_timeout_s`), each function runs in a long-lived process of its
own (workers/rewards/deadline.py), sent there once, so it keeps the state it holds in its objects from call to
call; past the deadline that process is killed, whatever the call is doing, the step fails with a
RewardTimeoutError naming the function and the step, and the next call starts a fresh process (the
function's state restarts). The scores and what it gives log_extra/log_metric come back; other changes
it makes (to its `environments`, to a global) stay in that process. Without a timeout it is called in
this process, as TRL does.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpo_flow.workers.rewards.deadline import DeadlineExceeded, Unsendable, run_coroutine, user_code

if TYPE_CHECKING:  # the process that runs a reward under its deadline imports this module: no pandas, no datasets
    from grpo_flow.schemas.records import RolloutBatch

RewardFunc = Callable[..., Sequence[float | None]]


def last_digit(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion is exactly the expected digit."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def reverse_digits(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion is exactly the prompt's digits reversed."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def reverse_digits_partial(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """The share of positions right: matching characters over the longer of completion and answer,
    so a missing or an extra digit costs as much as a wrong one; 1.0 only for the exact answer."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion.strip()
        right = sum(1 for got, want in zip(text, expected, strict=False) if got == want)
        scores.append(right / max(len(text), len(expected)))
    return scores


def final_answer(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion's last message (a plain completion: its text) is exactly the answer, spaces
    around it aside: the answer after a multi-turn episode's tool calls."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else (completion[-1].get("content") or "")
        scores.append(1.0 if str(text).strip() == str(expected) else 0.0)
    return scores


def gsm8k_accuracy(completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion's final number equals the reference answer."""
    from grpo_flow.workers.data.loaders import extract_final_number

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
    from grpo_flow.workers.rewards.environments import (
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
    "reverse_digits": reverse_digits,
    "reverse_digits_partial": reverse_digits_partial,
    "gsm8k_accuracy": gsm8k_accuracy,
    "final_answer": final_answer,
    **_environment_rewards(),
}


# Reward functions given as Python objects (the GRPOFlowTrainer API), by run: a config holds
# only names (`registered:<name>`), so these live in the process that runs the flow.
_REGISTERED: dict[str, dict[str, RewardFunc]] = {}
REGISTERED_PREFIX = "registered:"


def register_reward_funcs(run_id: str, funcs: dict[str, RewardFunc]) -> list[str]:
    """Make callables available to a run in this process; returns the names its config should list."""
    _REGISTERED[run_id] = dict(funcs)
    return [REGISTERED_PREFIX + name for name in funcs]


def resolve_reward_funcs(names: Sequence[str], run_id: str | None = None) -> dict[str, RewardFunc]:
    """Built-in names, `module:function` paths (a function or a reward environment object), or names
    registered for the run; resolved before anything loads."""
    from grpo_flow.workers.rewards.environments import as_reward_function, is_reward_environment

    check_distinct_reward_names(names)
    funcs: dict[str, RewardFunc] = {}
    for index, name in enumerate(names):
        if name in BUILTIN_REWARDS:
            funcs[name] = BUILTIN_REWARDS[name]
            continue
        if name.startswith(REGISTERED_PREFIX):
            registered = _REGISTERED.get(run_id or "", {})
            key = name.removeprefix(REGISTERED_PREFIX)
            if key not in registered:
                raise ValueError(
                    f"reward_funcs[{index}]: {name!r} was registered by the Python API in another process; "
                    "run it through GRPOFlowTrainer, or name the function as 'module:function'"
                )
            funcs[key] = registered[key]
            continue
        module_name, _, attr = name.partition(":")
        if not attr:
            raise ValueError(
                f"reward_funcs[{index}]: {name!r} is neither a built-in reward "
                f"({', '.join(sorted(BUILTIN_REWARDS))}) nor a 'module:function' path"
            )
        try:
            func = getattr(import_user_module(module_name), attr)
        except (ImportError, AttributeError) as error:
            where = where_it_looked(error, module_name)
            raise ValueError(f"reward_funcs[{index}]: cannot import {name!r}: {error}{where}") from error
        except (Exception, SystemExit) as error:  # the module itself failed: a syntax error, sys.exit()
            raise ValueError(
                f"reward_funcs[{index}]: importing {module_name!r} for {name!r} {what_it_did(error)}"
            ) from error
        if is_reward_environment(func):
            func = as_reward_function(func, attr)
        if not callable(func):
            raise ValueError(f"reward_funcs[{index}]: {name!r} is neither callable nor a reward environment")
        funcs[attr] = func
    return funcs


def columns_read(func: RewardFunc) -> list[str]:
    """The keyword parameters `func` requires (no default) beyond the ones every reward is called with
    (prompts, completions, ...): the data set columns it cannot run without."""
    from grpo_flow.schemas.records import REWARD_CALL_NAMES

    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature Python can read
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        parameter.name
        for parameter in parameters
        if parameter.kind in kinds
        and parameter.default is inspect.Parameter.empty
        and parameter.name not in REWARD_CALL_NAMES
    ]


def import_user_module(module_name: str) -> Any:
    """The module of a `module:function` reward or tool. The working directory is searched too, as
    `python -m` and `python script.py` do (`grpo` is an installed script, so it is not on sys.path
    otherwise); last, so that a file there never shadows an installed module."""
    here = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == here for entry in sys.path):
        sys.path.append(here)
    return importlib.import_module(module_name)


def where_it_looked(error: BaseException, module_name: str) -> str:
    """` (looked in ...)` when `module_name` itself was not found, else nothing."""
    if isinstance(error, ModuleNotFoundError) and error.name == module_name.partition(".")[0]:
        return (
            f" (looked in the installed packages and the working directory {os.getcwd()}; "
            "a module elsewhere needs PYTHONPATH)"
        )
    return ""


def check_distinct_reward_names(names: Sequence[str]) -> None:
    """Scores, columns and metrics are keyed by a function's own name (`reward_key`), so two entries
    that share one would leave a single function standing, silently: a ValueError naming both."""
    sources: dict[str, str] = {}
    for index, name in enumerate(names):
        key = reward_key(name)
        if key in sources:
            shown = name.removeprefix(REGISTERED_PREFIX)
            raise ValueError(
                f"reward_funcs[{index}]: {shown!r} and {sources[key]!r} share the name {key!r}, which names "
                f"their reward_{key} column and metrics; wrap one in a function of another name"
            )
        sources[key] = name.removeprefix(REGISTERED_PREFIX)


def reward_key(name: str) -> str:
    """What a reward_funcs entry is called in the log: a built-in's or registered object's name, or a
    path's function name (`module:function` -> `function`)."""
    return name.removeprefix(REGISTERED_PREFIX).rpartition(":")[2]


def what_it_did(error: BaseException) -> str:
    """`raised ValueError: why`, or `called sys.exit(3)`: SystemExit is no error to name by its type."""
    if isinstance(error, SystemExit):
        return f"called sys.exit({error.code!r})"
    return f"raised {type(error).__name__}: {one_line(error)}"


def one_line(error: BaseException) -> str:
    """An exception's message on one line (a SyntaxError's with its file and line)."""
    if isinstance(error, SyntaxError):
        return f"{error.msg} ({error.filename}, line {error.lineno})"
    return " ".join(str(error).split())


def check_scores(name: str, scores: Any, expected: int) -> list[float]:
    """Scores as floats (None becomes NaN); a wrong count, a non-number, NaN or infinity is an error.

    What TRL's `torch.tensor(scores)` takes is taken: a list or tuple, a 1-D numpy array or torch
    tensor, a generator, numbers of any numeric type, bools as 1.0 and 0.0. Stricter than TRL, which
    takes NaN silently: here None is the only way to say "does not apply".
    """
    if hasattr(scores, "tolist") and getattr(scores, "ndim", None) == 1:  # numpy array, torch tensor
        scores = scores.tolist()
    elif isinstance(scores, Iterator):
        scores = list(scores)
    if not isinstance(scores, (list, tuple)):
        raise RewardOutputError(
            f"reward function {name!r} returned {_kind(scores)}; expected a list of {expected} scores, one per completion"
        )
    if len(scores) != expected:
        raise RewardOutputError(f"reward function {name!r} returned {len(scores)} scores for {expected} completions")
    checked = []
    for index, score in enumerate(scores):
        if score is None:
            checked.append(math.nan)
            continue
        if hasattr(score, "item") and getattr(score, "ndim", 1) == 0:  # numpy / torch scalars
            score = score.item()
        try:  # an int too large for a float (10**400) raised OverflowError here, naming no function
            value = float(score) if isinstance(score, (int, float)) else math.nan
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):
            shown = repr(score) if len(repr(score)) <= 40 else f"{repr(score)[:20]}... ({len(repr(score))} characters)"
            raise RewardOutputError(
                f"reward function {name!r} returned {shown} for sample {index}; expected a finite number or None"
            )
        checked.append(value)
    return checked


def _kind(value: Any) -> str:
    shape = getattr(value, "shape", None)
    kind = f"a {type(value).__module__}.{type(value).__qualname__}".replace("builtins.", "")
    return f"{kind} of shape {tuple(shape)}" if shape is not None else kind


class RewardOutputError(ValueError):
    """A reward function returned what cannot be scores (a wrong count, a non-number, NaN): the same on
    every attempt, so `score` does not retry it."""


class RewardFunctionError(RuntimeError):
    """A reward function raised: names the function, the sample and the step, with the traceback."""


class RewardTimeoutError(RewardFunctionError):
    """A reward function did not return within reward_timeout_s: names the function and the step."""


class RewardRefusedError(RewardOutputError):
    """A reward function that cannot be sent to the process that runs it under reward_timeout_s (it holds
    a lock, a socket, a CUDA model): the same on every attempt, so `score` does not retry it."""


@dataclass(frozen=True)
class RewardTrainerState:
    """What reward functions get as `trainer_state` (TRL passes its TrainerState): the fields used for
    reward shaping over training."""

    global_step: int
    max_steps: int
    epoch: float


Logs = tuple[dict[str, list[Any]], dict[str, list[float]]]  # (log_extra's columns, log_metric's values)


def _call(func: RewardFunc, timeout: float | None, kwargs: dict[str, Any], logs: Logs) -> Any:
    """`func(**kwargs)`, awaited; with a timeout, in the process that holds the function (the module
    docstring), from which the scores and what it gave log_extra/log_metric come back into `logs`."""
    if timeout is None:
        return scores_and_logs(func, logs, **kwargs)[0]
    sent = {key: value for key, value in kwargs.items() if key not in ("log_extra", "log_metric")}
    worker = user_code([functools.partial(scores_and_logs, func)], key=same_function(func))
    scores, (extra, metrics) = worker.call(0, timeout, **sent)
    for column, values in extra.items():
        logs[0].setdefault(column, []).extend(values)
    for name, values in metrics.items():
        logs[1].setdefault(name, []).extend(values)
    return scores


def scores_and_logs(func: RewardFunc, logs: Logs | None = None, /, **kwargs: Any) -> tuple[Any, Logs]:
    """`func(**kwargs)` awaited, a generator made a list, with log_extra/log_metric writing to `logs` (new
    ones in the process that holds the function, which sends them back)."""
    extra, metrics = logs if logs is not None else ({}, {})
    kwargs["log_extra"] = lambda column, values: extra.setdefault(str(column), []).extend(values)
    kwargs["log_metric"] = lambda name, value: metrics.setdefault(str(name), []).append(float(value))
    result = func(**kwargs)
    result = run_coroutine(result) if inspect.isawaitable(result) else result
    return (list(result) if isinstance(result, Iterator) else result), (extra, metrics)


def same_function(func: RewardFunc) -> Hashable:
    """What stays the same for the same reward from call to call: a reward environment's wrapper and a bound
    method are made anew each time they are resolved. The process holding the function keeps what these
    ids name alive, so none is reused while it is a key."""
    environment = getattr(func, "environment", None)
    if environment is not None:
        return ("environment", id(environment))
    if inspect.ismethod(func):
        return ("method", id(func.__self__), id(func.__func__))
    return id(func)


def _failing_sample(
    func: RewardFunc, kwargs: dict[str, Any], n: int, timeout: float | None, logs: Logs
) -> tuple[int, str] | None:
    """Call the function one sample at a time to find the first sample it fails on."""
    for i in range(n):
        one = {k: fresh_copy([v[i]]) if isinstance(v, list) and len(v) == n else v for k, v in kwargs.items()}
        try:
            _call(func, timeout, one, logs)
        except DeadlineExceeded:
            return None
        except (Exception, SystemExit):
            return i, traceback.format_exc()
    return None


def fresh_copy(value: Any) -> Any:
    """A copy a reward function may change at will: lists and dicts copied all the way down (strings and
    numbers cannot change). Each call gets its own, so a function that edits its `completions` neither
    rewrites the log nor changes what the next function scores."""
    if isinstance(value, list):
        return [fresh_copy(item) for item in value]
    if isinstance(value, dict):
        return {key: fresh_copy(item) for key, item in value.items()}
    return value


def reward_inputs(batch: RolloutBatch) -> tuple[list[Any], list[Any]]:
    """Prompts and completions as TRL passes them: strings, or lists of messages for conversational data."""
    prompts = batch.raw_prompt or batch.prompt
    if batch.completion_messages:  # multi-turn episodes: every turn, tool messages included (TRL's completions)
        return prompts, batch.completion_messages
    return prompts, trl_completions(prompts, batch.completion)


def trl_completions(prompts: Sequence[Any], texts: list[str]) -> list[Any]:
    """Completions as TRL passes them to rewards: the texts, or assistant messages when the prompts
    are conversational (lists of messages)."""
    if prompts and isinstance(prompts[0], list):
        return [[{"role": "assistant", "content": text}] for text in texts]
    return texts


def check_logged_extra(func_name: str, logged: dict[str, list[Any]], rows: int, step: int) -> None:
    """TRL's `log_extra(column, values)` takes one value per sample; anything else names the function."""
    for column, values in logged.items():
        if len(values) != rows:
            raise RewardFunctionError(
                f"reward function {func_name!r} logged {len(values)} values for log_extra column {column!r} "
                f"in a batch of {rows} completions (step {step}); log_extra takes one value per completion"
            )


def logged_extra_rows(logged: dict[str, list[Any]], rows: int) -> list[str | None]:
    """Each row's `log_extra` values as a JSON object (values JSON cannot hold as they are, as text)."""
    if not logged:
        return [None] * rows
    return [json.dumps({column: values[i] for column, values in logged.items()}, default=str) for i in range(rows)]


def score_batch(
    batch: RolloutBatch,
    funcs: dict[str, RewardFunc],
    weights: Sequence[float] | None,
    state: RewardTrainerState | None = None,
    timeout_s: float | None = None,
) -> RolloutBatch:
    """Each function's scores and the weighted total (TRL's nansum rule), as new columns of the batch.

    Functions are called as TRL calls them: prompts, completions, completion_ids, every data
    set column, trainer_state, log_extra and log_metric; plain or async. `timeout_s` bounds each
    call (see the module docstring); past it a RewardTimeoutError names the function and the step.
    """
    started = time.perf_counter()
    weights = list(weights) if weights is not None else [1.0] * len(funcs)
    prompts, completions = reward_inputs(batch)
    logged_metrics: dict[str, list[float]] = {}
    logged_extra: dict[str, list[Any]] = {}
    kwargs: dict[str, Any] = {
        "prompts": prompts,
        "completions": completions,
        "completion_ids": batch.completion_token_ids,
        **batch.extra_columns,
        "trainer_state": state,
    }
    logs = (logged_extra, logged_metrics)
    if batch.environments:  # each rollout's environment instance, as TRL passes them (environment_factory)
        kwargs["environments"] = batch.environments
    per_func: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    for name, func in funcs.items():
        func_started = time.perf_counter()
        try:
            raw = _call(func, timeout_s, {key: fresh_copy(value) for key, value in kwargs.items()}, logs)
        except DeadlineExceeded:
            raise RewardTimeoutError(
                f"reward function {name!r} did not return within reward_timeout_s={timeout_s:g} s on step "
                f"{batch.step} ({len(batch)} completions); its process was killed"
            ) from None
        except Unsendable as refused:
            raise RewardRefusedError(
                f"reward function {name!r} cannot be sent to the process that runs it under reward_timeout_s "
                f"({refused.reason}); reward_timeout_s=None runs it in the flow's process"
            ) from None
        except (Exception, SystemExit) as error:  # sys.exit() in a reward ended the run with no word
            found = _failing_sample(func, kwargs, len(batch), timeout_s, logs)
            where = f"sample {found[0]} (prompt_id {batch.prompt_id[found[0]]!r})" if found else "the batch"
            trace = found[1] if found else traceback.format_exc()
            if isinstance(error, SystemExit):
                did = f"{what_it_did(error)} on {where} of step {batch.step}"
            else:
                did = f"raised on {where} of step {batch.step}: {type(error).__name__}: {error}"
            raise RewardFunctionError(f"reward function {name!r} {did}\n{trace}") from error
        seconds[name] = time.perf_counter() - func_started
        per_func[name] = check_scores(name, raw, len(batch))
        check_logged_extra(name, logged_extra, len(batch), batch.step)
    totals = []
    for i in range(len(batch)):
        applied = [
            w * per_func[name][i]
            for name, w in zip(per_func, weights, strict=True)
            if not math.isnan(per_func[name][i])
        ]
        totals.append(sum(applied) if applied else math.nan)
    return batch.replace(
        rewards={name: [None if math.isnan(s) else s for s in scores] for name, scores in per_func.items()},
        reward=totals,
        reward_error=[None] * len(batch),
        logged_extra=logged_extra_rows(logged_extra, len(batch)),
        score_s=time.perf_counter() - started,
        reward_seconds=seconds,
        logged_metrics=logged_metrics,
    )
