"""The records that pass between stages and land in Parquet, with their explicit Arrow schemas.

A rollout shard travels as one `RolloutBatch` (columns, one entry per completion) from
generation through scoring to the Parquet writer; every writer goes through `to_table`,
which enforces `rollout_schema`. Anyone can read a run back with pandas, pyarrow or DuckDB
without this project installed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

REWARD_PREFIX = "reward_"

ROLLOUT_BASE_FIELDS: list[pa.Field] = [
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("step", pa.int32(), nullable=False),
    pa.field("policy_version", pa.int32(), nullable=False),
    # Steps between the weights that sampled the row and those the actor trains it with (step - 1).
    pa.field("staleness", pa.int32(), nullable=False),
    pa.field("worker_id", pa.string(), nullable=False),
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("group_index", pa.int32(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),
    pa.field("prompt", pa.string(), nullable=False),
    pa.field("completion", pa.string(), nullable=False),
    pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("completion_token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("sampling_logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("prompt_tokens", pa.int32(), nullable=False),
    pa.field("completion_tokens", pa.int32(), nullable=False),
    pa.field("reward", pa.float64(), nullable=False),
    pa.field("advantage", pa.float64(), nullable=False),
    pa.field("reward_error", pa.string(), nullable=True),
    # What reward functions logged for the row with TRL's `log_extra(column, values)`, as a JSON
    # object (null if nothing was): one column whatever they log, so every step has one schema.
    pa.field("logged_extra", pa.string(), nullable=True),
    # Multi-turn episodes (tools, environments); null on single-turn rows. completion_token_ids then
    # holds every turn: the model's tokens and, between them, the tool and environment messages as
    # the chat template renders them. tool_mask is TRL's: 1 on the model's own tokens (the only ones
    # in the loss), 0 on the others (their sampling_logprobs are 0.0). messages: the completion as
    # messages (assistant turns with their tool calls, tool results), JSON, as reward functions get it.
    pa.field("tool_mask", pa.list_(pa.int8()), nullable=True),
    pa.field("messages", pa.string(), nullable=True),
    pa.field("tool_calls", pa.int32(), nullable=True),
    pa.field("tool_failures", pa.int32(), nullable=True),
    pa.field("generate_s", pa.float64(), nullable=False),
    pa.field("score_s", pa.float64(), nullable=False),
]
ROLLOUT_BASE_NAMES = frozenset(f.name for f in ROLLOUT_BASE_FIELDS)
# What reward functions are called with besides the data set's columns (TRL's keyword arguments): a
# column of one of these names would be passed in its place, or dropped.
REWARD_CALL_NAMES = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
)


def rollout_schema(reward_names: list[str], extra_columns: dict[str, pa.DataType]) -> pa.Schema:
    """Base fields, then one nullable float column per reward function, then the data set's extra columns."""
    reward_fields = [pa.field(REWARD_PREFIX + name, pa.float64(), nullable=True) for name in reward_names]
    extra_fields = [pa.field(name, dtype, nullable=True) for name, dtype in extra_columns.items()]
    clashes = sorted(ROLLOUT_BASE_NAMES.intersection(extra_columns))
    if clashes:
        raise ValueError(f"data set columns {clashes} clash with rollout fields of the same name")
    return pa.schema(ROLLOUT_BASE_FIELDS + reward_fields + extra_fields)


@dataclass
class RolloutBatch:
    """One shard of a step: whole groups of completions, column by column.

    Generation fills the token columns; scoring fills `rewards` (one list per reward
    function, None where a function does not apply), `reward`, `reward_error` and
    `logged_extra`; the advantage stage fills `advantage`.
    """

    run_id: str
    step: int
    policy_version: int
    worker_id: str
    prompt_id: list[str]
    group_index: list[int]
    sample_index: list[int]
    prompt: list[str]
    completion: list[str]
    prompt_token_ids: list[list[int]]
    completion_token_ids: list[list[int]]
    sampling_logprobs: list[list[float]]
    finish_reason: list[str]
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)
    rewards: dict[str, list[float | None]] = field(default_factory=dict)
    reward: list[float] = field(default_factory=list)
    reward_error: list[str | None] = field(default_factory=list)
    logged_extra: list[str | None] = field(default_factory=list)
    advantage: list[float] = field(default_factory=list)
    # Episodes only (empty lists on single-turn batches; see the Arrow fields of the same names).
    tool_mask: list[list[int] | None] = field(default_factory=list)
    messages: list[str | None] = field(default_factory=list)
    tool_calls: list[int | None] = field(default_factory=list)
    tool_failures: list[int | None] = field(default_factory=list)
    generate_s: float = 0.0
    score_s: float = 0.0
    # In memory only: the prompts as the data set has them (conversational ones as messages),
    # each reward function's seconds, and every value reward functions logged through log_metric
    # (the step's metric is their mean over every call of every shard, as TRL averages them).
    raw_prompt: list[Any] = field(default_factory=list)
    reward_seconds: dict[str, float] = field(default_factory=dict)
    logged_metrics: dict[str, list[float]] = field(default_factory=dict)
    # Episodes, in memory only: each completion as messages (what reward functions get as
    # `completions`), and each rollout's environment instance (TRL's `environments` argument).
    completion_messages: list[Any] = field(default_factory=list)
    environments: list[Any] = field(default_factory=list)

    @classmethod
    def from_generation(
        cls,
        rows: Sequence[dict[str, Any]],
        result: Any,
        *,
        run_id: str,
        step: int,
        columns: Iterable[str] = (),
        group_offset: int = 0,
        **fields: Any,
    ) -> RolloutBatch:
        """Whole groups from a generation: `result`'s completions (a GenerationResult, workers/rollout/base.py),
        the same number of each of `rows` (data set rows: prompt_id, prompt and the extra `columns` the batch
        carries), prompt-major. Prompt texts and token ids are one per row (repeated over its group) or one
        per completion (episodes, each with its own start); the worker id, policy version and prompt texts
        come from `result.extra`, as a rollout worker's answer carries them. `fields` set any other field
        (the episodes' tool columns)."""
        n = len(result.texts) // max(1, len(rows))

        def each(given: Iterable[Any]) -> list[Any]:
            values = list(given)
            return values if len(values) == len(result.texts) else [v for v in values for _ in range(n)]

        generated: dict[str, Any] = {
            "run_id": run_id,
            "step": step,
            "policy_version": result.extra["policy_version"],
            "worker_id": result.extra["worker_id"],
            "prompt_id": each(row["prompt_id"] for row in rows),
            "group_index": [group_offset + i // n for i in range(len(result.texts))],
            "sample_index": [i % n for i in range(len(result.texts))],
            "prompt": each(result.extra["prompt_texts"]),
            "completion": result.texts,
            "prompt_token_ids": each(result.prompt_token_ids),
            "completion_token_ids": result.completion_token_ids,
            "sampling_logprobs": result.sampling_logprobs,
            "finish_reason": result.finish_reasons,
            "extra_columns": {c: each(row[c] for row in rows) for c in columns},
            "generate_s": result.seconds,
            "raw_prompt": each(row["prompt"] for row in rows),
        }
        return cls(**{**generated, **fields})

    def __len__(self) -> int:
        return len(self.completion)

    def replace(self, **changes: Any) -> RolloutBatch:
        return dataclasses.replace(self, **changes)

    def take(self, rows: list[int]) -> RolloutBatch:
        """The batch restricted to `rows`, in that order (per-row lists and dicts of lists are sliced)."""
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list) and len(value) == len(self):
                changes[f.name] = [value[i] for i in rows]
            elif f.name in ("extra_columns", "rewards"):
                changes[f.name] = {k: [v[i] for i in rows] for k, v in value.items()}
        return self.replace(**changes)

    def extend(self, other: RolloutBatch) -> RolloutBatch:
        """This batch followed by `other` (same worker and columns); timings add up."""
        changes: dict[str, Any] = {
            "generate_s": self.generate_s + other.generate_s,
            "score_s": self.score_s + other.score_s,
        }
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list) and len(value) == len(self):
                changes[f.name] = value + getattr(other, f.name)
            elif f.name in ("extra_columns", "rewards"):
                changes[f.name] = {k: v + getattr(other, f.name)[k] for k, v in value.items()}
        return self.replace(**changes)

    def columns(self) -> dict[str, list[Any]]:
        """The batch's logged columns by name, one value per row: what `to_table` writes."""
        n = len(self)
        columns: dict[str, Any] = {
            "run_id": [self.run_id] * n,
            "step": [self.step] * n,
            "policy_version": [self.policy_version] * n,
            "staleness": [self.step - 1 - self.policy_version] * n,
            "worker_id": [self.worker_id] * n,
            "prompt_id": self.prompt_id,
            "group_index": self.group_index,
            "sample_index": self.sample_index,
            "prompt": self.prompt,
            "completion": self.completion,
            "prompt_token_ids": self.prompt_token_ids,
            "completion_token_ids": self.completion_token_ids,
            "sampling_logprobs": self.sampling_logprobs,
            "finish_reason": self.finish_reason,
            "prompt_tokens": [len(ids) for ids in self.prompt_token_ids],
            "completion_tokens": [len(ids) for ids in self.completion_token_ids],
            "reward": self.reward,
            "advantage": self.advantage,
            "reward_error": self.reward_error or [None] * n,
            "logged_extra": self.logged_extra or [None] * n,
            "tool_mask": self.tool_mask or [None] * n,
            "messages": self.messages or [None] * n,
            "tool_calls": self.tool_calls or [None] * n,
            "tool_failures": self.tool_failures or [None] * n,
            "generate_s": [self.generate_s] * n,
            "score_s": [self.score_s] * n,
        }
        columns.update({REWARD_PREFIX + name: scores for name, scores in self.rewards.items()})
        columns.update(self.extra_columns)
        return columns

    def to_table(self, schema: pa.Schema) -> pa.Table:
        """The batch as an Arrow table that conforms to `schema` (raises naming a missing column)."""
        n = len(self)
        columns = self.columns()
        missing = [name for name in schema.names if name not in columns]
        if missing:
            raise ValueError(f"rollout batch of step {self.step} lacks columns {missing}")
        wrong_length = [name for name in schema.names if len(columns[name]) != n]
        if wrong_length:
            raise ValueError(f"rollout batch of step {self.step}: columns {wrong_length} do not have {n} rows")
        return pa.Table.from_pydict({name: columns[name] for name in schema.names}, schema=schema)


# One row per step. Known fields are typed here; any further metric (TRL's names, such as
# `clip_ratio/high_mean` or `rewards/<name>/mean`) is appended as float64.
METRICS_BASE_FIELDS: list[pa.Field] = [
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("step", pa.int32(), nullable=False),
    pa.field("policy_version", pa.int32(), nullable=False),
    pa.field("num_completions", pa.int32(), nullable=False),
    pa.field("loss", pa.float64()),
    pa.field("grad_norm", pa.float64()),
    pa.field("learning_rate", pa.float64()),
    pa.field("reward", pa.float64()),
    pa.field("reward_std", pa.float64()),
    pa.field("frac_reward_zero_std", pa.float64()),
    pa.field("completions/mean_length", pa.float64()),
    pa.field("completions/clipped_ratio", pa.float64()),
    pa.field("sync/bytes", pa.float64()),  # what the weight sync after the step moved to the engines; 0: none
    pa.field("step_s", pa.float64()),
]


def metrics_table(row: dict[str, Any]) -> pa.Table:
    """A one-row metrics table: the base fields typed, every other key as float64 in sorted order."""
    base_names = [f.name for f in METRICS_BASE_FIELDS]
    missing = [name for name in ("run_id", "step", "policy_version", "num_completions") if name not in row]
    if missing:
        raise ValueError(f"metrics row lacks {missing}")
    extra = sorted(k for k in row if k not in base_names)
    schema = pa.schema(METRICS_BASE_FIELDS + [pa.field(k, pa.float64()) for k in extra])
    return pa.Table.from_pylist([{name: row.get(name) for name in schema.names}], schema=schema)


@dataclass(frozen=True)
class RunPlan:
    """What `prepare_run` resolved once, before anything loads: passed by reference to every task."""

    run_id: str
    storage_root: str
    model_path: str
    total_steps: int
    reward_names: tuple[str, ...]  # the reward_<name> columns: reward functions, then environments' rewards
    extra_columns: tuple[str, ...]
    num_train_prompts: int
    run_uid: str = ""  # written once when the run is created; part of every cache key
    # Resuming: restore this checkpoint (None: the initial model), then replay these logged steps.
    resume_checkpoint: int | None = None
    replay_steps: tuple[int, ...] = ()
    first_step: int = 1
    resumes: int = 0  # how many times the run was resumed, this time included
    # Fresh for every start of the run (new or resumed). A resume count repeats when a run folder is
    # restored from a backup, and a cache key built on it would hand back a step that is not on disk.
    session: str = ""
    # The names in reward_names that environments' get_reward give (TRL names each after its class).
    environment_rewards: tuple[str, ...] = ()

    @property
    def cache_scope(self) -> str:
        return f"{self.run_uid}-{self.session or f'r{self.resumes}'}"


@dataclass(frozen=True)
class PromptShard:
    """The prompts one rollout worker gets in a step: whole groups, in order."""

    step: int
    shard: int
    group_offset: int
    rows: tuple[dict[str, Any], ...]
    refill_round: int = 0  # dynamic sampling: 0 is the step's own prompts, 1.. are refills
