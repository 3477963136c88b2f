"""Rollout tasks of one step: sample prompts, generate (per shard), score (per shard),
advantages (whole batch), write the Parquet log (per shard, then committed as one step).

Retry counts come from the config (`generate_retries`, ...), applied with `with_options` by
the step flow; the defaults here are the config's defaults.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
import threading
import time
from typing import Any

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.schemas.records import REWARD_PREFIX, PromptShard, RolloutBatch, RunPlan, rollout_schema
from grpo_flow.tasks.observability import USER_FACING
from grpo_flow.workers import backends
from grpo_flow.workers.state.faults import maybe_fail, maybe_kill_engine
from grpo_flow.workers.rewards.task import run_task
from grpo_flow.workers.rewards.functions import (
    RewardOutputError,
    RewardTimeoutError,
    RewardTrainerState,
    resolve_reward_funcs,
    score_batch,
)
from grpo_flow.workers.rollout.base import SamplingParams
from grpo_flow.workers.state.storage import RunStorage


def step_seed(seed: int, step: int, shard: int = 0, refill_round: int = 0) -> int:
    """A distinct, reproducible seed for every (run seed, step, shard[, dynamic-sampling round])."""
    entropy = [seed, step, shard] + ([refill_round] if refill_round else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def epoch_order(seed: int, epoch: int, size: int) -> np.ndarray:
    """The order in which epoch `epoch` visits the training prompts."""
    return np.random.default_rng([seed, epoch]).permutation(size)


def step_prompt_indices(seed: int, step: int, prompts_per_step: int, size: int) -> list[int]:
    """The train rows step `step` (from 1) trains on: consecutive slices of the epoch-wise permutations.

    A pure function of its arguments, so anyone (benchmarks/learning.py hands TRL the same order)
    can know a run's prompts without running it.
    """
    start = (step - 1) * prompts_per_step
    positions = range(start, start + prompts_per_step)
    orders = {e: epoch_order(seed, e, size) for e in {p // size for p in positions}}
    return [int(orders[p // size][p % size]) for p in positions]


@task(name="sample-batch", cache_policy=NO_CACHE)
def sample_batch(config: GRPOFlowConfig, plan: RunPlan, step: int, refill_round: int = 0) -> list[PromptShard]:
    """The step's prompts, a deterministic function of (seed, step): epoch-wise permutations.

    Refill rounds of dynamic sampling draw from their own stream, a function of (seed, step,
    round), so the data order of later steps does not depend on how many refills happened.
    """
    train = run_task(config).train
    indices: Sequence[int]
    if refill_round:
        rng = np.random.default_rng([config.seed, step, refill_round, 0xD5])
        indices = rng.choice(
            len(train), size=config.prompts_per_step, replace=len(train) < config.prompts_per_step
        ).tolist()
    else:
        indices = step_prompt_indices(config.seed, step, config.prompts_per_step, len(train))
    # The rows by index, not `train.select(...)`: select fingerprints its index list on every call.
    columns = train[[int(i) for i in indices]]
    rows = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
    per_shard = config.prompts_per_step // config.num_rollout_workers
    return [
        PromptShard(
            step=step,
            shard=s,
            group_offset=s * per_shard,
            rows=tuple(rows[s * per_shard : (s + 1) * per_shard]),
            refill_round=refill_round,
        )
        for s in range(config.num_rollout_workers)
    ]


@task(name="generate", retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE)
def generate(config: GRPOFlowConfig, plan: RunPlan, shard: PromptShard, policy_version: int) -> RolloutBatch:
    """num_generations completions per prompt on rollout worker `shard.shard`, at policy `policy_version`."""
    maybe_fail("generate", shard.step)
    workers = backends.run_workers(config)
    maybe_kill_engine(shard.step, shard.shard, workers.engine_pid(shard.shard))
    params = SamplingParams(
        n=config.num_generations,
        max_tokens=config.max_completion_length,
        temperature=config.temperature,
        top_p=config.top_p,
        seed=step_seed(config.seed, shard.step, shard.shard, shard.refill_round),
    )
    if config.tools or config.environment_factory:  # multi-turn: one engine call per turn, at this version

        def turn(ids: list[list[int]], turn_params: SamplingParams) -> Any:
            return workers.generate(shard.shard, policy_version, ids, turn_params, None)

        return generate_episodes(config, plan, shard, params, turn)
    prompts = [row["prompt"] for row in shard.rows]
    result = workers.generate(shard.shard, policy_version, prompts, params, config.max_prompt_length)
    return RolloutBatch.from_generation(
        shard.rows,
        result,
        run_id=plan.run_id,
        step=shard.step,
        columns=plan.extra_columns,
        group_offset=shard.group_offset,
    )


def generate_episodes(
    config: GRPOFlowConfig, plan: RunPlan, shard: PromptShard, params: SamplingParams, generate_turn: Any
) -> RolloutBatch:
    """`generate`'s multi-turn form (tools, environments): num_generations episodes per prompt, each turn
    generated by `generate_turn(token_id_prompts, params)` (the shard's rollout worker), tool calls run in
    this process or the sandbox (workers/rollout/episodes.py, workers/tools/)."""
    from grpo_flow.workers.rollout.episodes import EpisodeRunner

    runner = EpisodeRunner.from_config(config, plan.model_path)
    return runner.batch(
        generate_turn,
        shard.rows,
        config.num_generations,
        params,
        run_id=plan.run_id,
        step=shard.step,
        columns=plan.extra_columns,
        group_offset=shard.group_offset,
    )


def worth_retrying(task: object, task_run: object, state: object) -> bool:
    """Retry condition of `score`: a reward call past reward_timeout_s is not retried (each attempt
    would wait as long again, and could leave another thread behind), nor scores of the wrong shape
    or kind (the same on every attempt)."""
    error = getattr(state, "data", None)
    return not isinstance(error, (RewardTimeoutError, RewardOutputError))


def not_a_missing_reward(task: object, task_run: object, state: object) -> bool:
    """Retry condition of `log_rollouts`: steps without any reward fail the same way on every attempt."""
    return not isinstance(getattr(state, "data", None), NoRewardError)


@task(name="score", retries=2, retry_delay_seconds=1, retry_condition_fn=worth_retrying, cache_policy=NO_CACHE)
def score(config: GRPOFlowConfig, plan: RunPlan, batch: RolloutBatch) -> RolloutBatch:
    """Every reward function on every completion of the shard, and the weighted total."""
    maybe_fail("score", batch.step)
    defaults = [name for name in plan.reward_names if name not in plan.environment_rewards]
    funcs = resolve_reward_funcs(config.reward_funcs or defaults, plan.run_id)
    weights = config.reward_weights
    if plan.environment_rewards:  # environments that own a reward: TRL's extra reward sources, weight 1 each
        from grpo_flow.workers.tools.toolbox import environment_reward_funcs, toolbox_for

        toolbox = toolbox_for(config.tools, config.environment_factory, plan.run_id)
        weights = [*(weights or [1.0] * len(funcs)), *[1.0] * len(plan.environment_rewards)]
        funcs = {**funcs, **environment_reward_funcs(toolbox)}
    state = RewardTrainerState(
        global_step=batch.step - 1,
        max_steps=plan.total_steps,
        epoch=(batch.step - 1) * config.prompts_per_step / plan.num_train_prompts,
    )
    with reward_slots(plan.run_id, config.reward_concurrency):
        return score_batch(batch, funcs, weights, state, config.reward_timeout_s)


_REWARD_SLOTS: dict[str, threading.BoundedSemaphore] = {}
_REWARD_SLOTS_LOCK = threading.Lock()


def reward_slots(run_id: str, limit: int) -> threading.BoundedSemaphore:
    """The bound on shards scored at once in this process: Prefect maps every shard at once, and
    reward code (sandboxes, judges) is often the scarce resource."""
    with _REWARD_SLOTS_LOCK:
        return _REWARD_SLOTS.setdefault(f"{run_id}/{limit}", threading.BoundedSemaphore(limit))


class NoRewardError(RuntimeError):
    """Steps in a row in which no completion got a reward: the reward functions do not fit the data."""


_WARNED_NO_REWARD: set[tuple[str, str, int]] = set()  # (run, session, step): log_rollouts is retried


def check_rewards_given(config: GRPOFlowConfig, plan: RunPlan, step: int, stats: dict[str, float]) -> None:
    """A step whose every completion got no reward (every function returned None for every sample)
    trains on nothing: warn at the first such step, naming the functions; fail at the
    `max_no_reward_steps`-th in a row (the earlier ones are counted from their logged metrics)."""
    if not math.isnan(stats["reward"]):
        return
    storage = RunStorage.of(plan)
    streak = 1
    while (
        streak < config.max_no_reward_steps
        and storage.metrics_path(step - streak).exists()
        and math.isnan(storage.read_step_metrics(step - streak)["reward"])
    ):
        streak += 1
    names = ", ".join(plan.reward_names)
    if streak >= config.max_no_reward_steps:
        first = f"steps {step - streak + 1}-{step}" if streak > 1 else f"step {step}"
        raise NoRewardError(
            f"{first}: no completion got a reward: every reward function ({names}) returned None for every "
            f"sample (max_no_reward_steps={config.max_no_reward_steps}); check that they fit the data set's columns"
        )
    if streak == 1 and (plan.run_id, plan.session, step) not in _WARNED_NO_REWARD:  # once, not at each retry
        _WARNED_NO_REWARD.add((plan.run_id, plan.session, step))
        get_run_logger().warning(
            f"step {step}: no completion got a reward: every reward function ({names}) returned None for every "
            f"sample; the run fails after {config.max_no_reward_steps} such steps in a row",
            extra={USER_FACING: True},
        )


def informative_groups(batch: RolloutBatch, group_size: int) -> list[list[int]]:
    """Row indices of each group whose rewards do not all tie (a tie has zero advantage: no signal)."""
    groups = []
    for start in range(0, len(batch), group_size):
        rows = list(range(start, start + group_size))
        rewards = [batch.reward[i] for i in rows if not np.isnan(batch.reward[i])]
        if len(rewards) > 1 and max(rewards) > min(rewards):
            groups.append(rows)
    return groups


@task(name="keep-informative-groups", cache_policy=NO_CACHE)
def keep_informative_groups(
    config: GRPOFlowConfig, kept: list[RolloutBatch] | list[None], new: list[RolloutBatch]
) -> tuple[list[RolloutBatch], int]:
    """Dynamic sampling: add each shard's groups with a reward spread from a new round, up to the
    shard's quota; returns the shards so far and how many groups were dropped."""
    quota = config.prompts_per_step // config.num_rollout_workers
    g = config.num_generations
    out, dropped = [], 0
    for shard, (have, batch) in enumerate(zip(kept, new, strict=True)):
        groups = informative_groups(batch, g)
        dropped += len(batch) // g - len(groups)
        room = quota - (len(have) // g if have is not None else 0)
        take = [row for rows in groups[:room] for row in rows]
        chosen = batch.take(take)
        merged = chosen if have is None else have.extend(chosen)
        offset = shard * quota
        out.append(merged.replace(group_index=[offset + i // g for i in range(len(merged))]))
    return out, dropped


# The logged columns a step's statistics are computed from, besides each function's reward_<name>.
STATS_COLUMNS = ("reward", "completion_tokens", "tool_mask", "finish_reason", "tool_calls", "tool_failures")


def compute_advantages(config: GRPOFlowConfig, batches: list[RolloutBatch]) -> tuple[list[RolloutBatch], dict]:
    """Group-relative advantages over the whole step (batch scaling needs every shard), plus reward stats."""
    names = list(batches[0].rewards)
    per_batch = [batch.columns() for batch in batches]
    needed = [*STATS_COLUMNS, *(REWARD_PREFIX + name for name in names)]
    advantages, stats = step_reward_stats(config, names, {c: [v for b in per_batch for v in b[c]] for c in needed})
    out, offset = [], 0
    for batch in batches:
        out.append(batch.replace(advantage=advantages[offset : offset + len(batch)].tolist()))
        offset += len(batch)
    for name in batches[0].reward_seconds:  # functions run per shard: their time summed over shards
        stats[f"time/reward/{name}_s"] = sum(b.reward_seconds.get(name, 0.0) for b in batches)
    stats.update(logged_metric_means(batches, reserved=stats))
    return out, stats


def step_reward_stats(
    config: GRPOFlowConfig, reward_names: Sequence[str], columns: dict[str, list[Any]]
) -> tuple[Any, dict[str, float]]:
    """A step's advantages (a tensor) and TRL's reward, length and tool statistics, from its rollout columns
    by their logged names: the batches about to be logged, or a replayed step's logged rows."""
    import torch

    from grpo_flow.workers.actor.advantages import reward_stats, step_advantages

    per_function = {name: columns[REWARD_PREFIX + name] for name in reward_names}
    advantages, std_is_zero = step_advantages(config, per_function)
    masks = columns.get("tool_mask") or [None] * len(columns["reward"])  # runs logged before tools had none
    # A completion's length as TRL counts it: the model's own tokens (tool messages left out).
    lengths = [n if mask is None else sum(mask) for n, mask in zip(columns["completion_tokens"], masks, strict=True)]
    rewards = torch.tensor(columns["reward"], dtype=torch.float32)
    stats = reward_stats(rewards, std_is_zero, per_function, lengths, columns["finish_reason"])
    if any(mask is not None for mask in masks):
        stats.update(tool_stats(columns["tool_calls"], columns["tool_failures"]))
    return advantages, stats


def tool_stats(calls: list[int | None], failures: list[int | None]) -> dict[str, float]:
    """TRL's tool metrics: calls per completion, and the share of calls that failed."""
    made, failed = sum(n or 0 for n in calls), sum(n or 0 for n in failures)
    return {
        "tools/call_frequency": made / max(1, len(calls)),
        "tools/failure_frequency": failed / made if made else 0.0,
    }


def logged_metric_means(batches: list[RolloutBatch], reserved: Collection[str]) -> dict[str, float]:
    """What reward functions logged with `log_metric`: each name's mean over every call in every shard
    (TRL averages the values it collects likewise). A name grpo-flow's own metrics use is an error."""
    values: dict[str, list[float]] = {}
    for batch in batches:
        for name, logged in batch.logged_metrics.items():
            values.setdefault(name, []).extend(logged)
    refuse_metric_clashes(values, reserved, "grpo-flow's own metrics")
    return {name: sum(logged) / len(logged) for name, logged in values.items() if logged}


def check_metric_names(rollout_stats: dict[str, float], train_metrics: dict[str, float]) -> None:
    """The actor's metrics and the step's rollout statistics share one row: a name in both can only be
    one that a reward function logged with `log_metric` (the actor's names vary with the loss)."""
    refuse_metric_clashes(rollout_stats, train_metrics, "the actor's own metrics")


def refuse_metric_clashes(logged: Collection[str], taken: Collection[str], whose: str) -> None:
    clashes = sorted(set(logged) & set(taken))
    if clashes:
        raise RewardOutputError(
            f"reward functions logged {clashes} with log_metric, which {whose} are called; log them under other names"
        )


@task(name="read-logged-rollouts", cache_policy=NO_CACHE)
def logged_reward_stats(config: GRPOFlowConfig, plan: RunPlan, step: int) -> tuple[int, dict[str, float]]:
    """A replayed step's completion count and reward statistics, from its logged rollouts."""
    table = RunStorage.of(plan).read_rollouts(step)
    needed = [*STATS_COLUMNS, *(REWARD_PREFIX + name for name in plan.reward_names)]
    columns = table.select([c for c in needed if c in table.column_names]).to_pydict()
    return table.num_rows, step_reward_stats(config, plan.reward_names, columns)[1]


def write_rollouts(config: GRPOFlowConfig, plan: RunPlan, batch: RolloutBatch, shard: int) -> str:
    """One Parquet file per shard, staged atomically; the Arrow schema is enforced."""
    # Types from the data set, not the values: a shard that dynamic sampling emptied has none.
    extra_types = {}
    if plan.extra_columns:  # the data set's Arrow schema is built on each call: only when needed
        features = run_task(config).train.features.arrow_schema
        extra_types = {c: features.field(c).type for c in plan.extra_columns}
    table = batch.to_table(rollout_schema(list(plan.reward_names), extra_types))
    return str(RunStorage.of(plan).write_rollouts(batch.step, shard, table))


def commit_rollouts(config: GRPOFlowConfig, plan: RunPlan, step: int) -> str:
    """Publish the step's staged shards as one logged step (a step already committed is left as it is)."""
    return str(RunStorage.of(plan).commit_rollouts(step, config.num_rollout_workers))


# One task run for three stages of the design: none of them has a reason to be retried or shown
# apart, and every task run costs Prefect time and events on each step. The stages are in the task
# run's name and in its log line, with their times.
@task(
    name="log-rollouts",
    task_run_name="log-rollouts-step-{step}: compute-advantages, write-rollouts, commit-rollouts",
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=not_a_missing_reward,
    cache_policy=NO_CACHE,
)
def log_rollouts(
    config: GRPOFlowConfig, plan: RunPlan, step: int, batches: list[RolloutBatch]
) -> tuple[dict[str, float], list[dict]]:
    """compute-advantages over the whole step, then write-rollouts (one Parquet file per shard,
    staged) and commit-rollouts (the step's shards renamed into place together). Returns the
    step's reward statistics and the three completions its artifact shows (best, middle, worst).

    A retry after the commit finds the step logged and leaves it as it is (nothing logged is
    ever rewritten); the statistics are computed again from the same batches."""
    from grpo_flow.tasks.observability import pick_samples, rollout_rows

    started = time.perf_counter()
    scored, stats = compute_advantages(config, batches)
    check_rewards_given(config, plan, step, stats)  # before the step is logged: a fixed function re-scores it
    advantages_done = time.perf_counter()
    storage = RunStorage.of(plan)
    if not storage.rollouts_committed(step):
        for shard, batch in enumerate(scored):
            write_rollouts(config, plan, batch, shard)
        written = time.perf_counter()
        commit_rollouts(config, plan, step)
        note = ""
    else:
        written, note = advantages_done, " (already committed: left as logged)"
    done = time.perf_counter()
    get_run_logger().info(
        "step %d: compute-advantages %.1f ms, write-rollouts x%d %.1f ms, commit-rollouts %.1f ms%s",
        step, 1000 * (advantages_done - started), len(scored), 1000 * (written - advantages_done),
        1000 * (done - written), note,
    )  # fmt: skip
    return stats, [dict(row) for row in pick_samples(rollout_rows(plan, step, scored))]
