"""What a run shows in the Prefect UI while it trains: a markdown artifact per step, a progress bar.

    step_artifact(plan, step, row)                 metrics of the step + three sample completions
    progress_id = create_run_progress(plan, total_steps, completed_steps)
    update_run_progress(progress_id, step, total_steps)
    publish(step_artifact, plan, step, row)        the same, on the artifact thread: the step goes on
    with artifact_writes_paused(): ...             published artifacts wait (around a step subflow call)
    with artifact_writes_allowed(): ...            ... and are written (inside the step's body)
    flush_artifacts()                              wait until everything published is written

Plain functions, not tasks: each is one API call, and a task run around it would add its own
state writes to every step (the SQLite-backed server is where step time stalls; see README).
Called inside a flow run, Prefect links the artifact to that flow run. They never raise: an
artifact is a view of what the Parquet files already hold, so a server hiccup must not fail a
training step; a failure is logged as a warning and the call returns None.

The grpo flow publishes its per-step artifacts through `publish`: one background thread, in
submission order, with the caller's Prefect context (so each artifact still links to the flow
run that asked for it). A step's two API calls cost ~40 ms on the SQLite-backed server (2 CPU
cores), which the step would otherwise wait for; the flow calls `flush_artifacts()` before it
ends, so a finished run has every artifact. The thread writes only while a step body runs (the
flow pauses it around each subflow call; see `_WriteGate`), so the UI shows a step's artifact
during the next step.

Keys: one artifact key per run and kind (`grpo-step-<run>`, `grpo-progress-<run>`), so the
Artifacts page lists one entry per run whose versions are the steps, instead of one entry per
step. Prefect keys allow lowercase letters, digits and dashes only (`artifact_key`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import logging
import math
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any
from uuid import UUID

import pyarrow as pa

from grpo_flow.schemas.records import REWARD_PREFIX, RolloutBatch, RunPlan

logger = logging.getLogger("grpo_flow.observability")

# A log record with extra={USER_FACING: True} is shown on the terminal even when Prefect's console
# logs go to the log file (flows/quiet.py), as `grpo-flow: warning: ...`.
USER_FACING = "grpo_flow_user"

# Shown first, in this order, when the row has them; every other numeric metric follows.
HEADLINE_METRICS = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "loss",
    "kl",
    "grad_norm",
    "learning_rate",
    "entropy",
    "completions/mean_length",
    "completions/clipped_ratio",
    "clip_ratio/region_mean",
    "step_s",
)
SAMPLE_COUNT = 3
MAX_PROMPT_CHARS = 300
MAX_COMPLETION_CHARS = 600
# Rollout columns a sample shows (besides one reward_<function> column per function).
SHOWN_COLUMNS = ("step", "group_index", "sample_index", "prompt", "completion", "reward", "advantage")


def artifact_key(*parts: str) -> str:
    """A valid Prefect artifact key from free text: lowercase letters, digits and single dashes."""
    key = re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")
    return key or "grpo"


def run_id_of(plan_or_run_id: RunPlan | str) -> str:
    return plan_or_run_id.run_id if isinstance(plan_or_run_id, RunPlan) else str(plan_or_run_id)


# -- step artifact -------------------------------------------------------------------------------------
def rollout_rows(
    plan_or_run_id: RunPlan | str,
    step: int,
    rollouts: pa.Table | Sequence[RolloutBatch] | Sequence[Mapping[str, Any]] | Any | None,
) -> list[dict[str, Any]]:
    """The step's completions as dicts (prompt, completion, reward, advantage, reward_<function>).

    Takes what the caller has at hand: an Arrow table (as RunStorage.read_rollouts returns), the
    step's RolloutBatch shards, a pandas DataFrame, a list of row dicts, or None to read the
    logged step back from the run's storage (needs a RunPlan).
    """
    if rollouts is None:
        if not isinstance(plan_or_run_id, RunPlan):
            return []
        from grpo_flow.workers.state.storage import RunStorage, parquet_schema

        storage = RunStorage.of(plan_or_run_id)
        # Only what the artifact shows: token ids and logprobs are most of a step's bytes.
        names = parquet_schema(storage.rollout_path(step, 0)).names
        wanted = [n for n in names if n in SHOWN_COLUMNS or n.startswith(REWARD_PREFIX)]
        rollouts = storage.read_rollouts(step, columns=wanted)
    if isinstance(rollouts, pa.Table):
        return rollouts.to_pylist()
    if hasattr(rollouts, "to_dict") and hasattr(rollouts, "columns"):  # a pandas DataFrame
        return rollouts.to_dict("records")
    rows: list[dict[str, Any]] = []
    for item in rollouts:
        if isinstance(item, RolloutBatch):
            for i in range(len(item)):
                row = {
                    "prompt": item.prompt[i],
                    "completion": item.completion[i],
                    "reward": item.reward[i] if item.reward else None,
                    "advantage": item.advantage[i] if item.advantage else None,
                }
                row.update({REWARD_PREFIX + name: scores[i] for name, scores in item.rewards.items()})
                rows.append(row)
        else:
            rows.append(dict(item))
    return rows


def _reward_key(row: Mapping[str, Any]) -> float:
    reward = row.get("reward")
    return -math.inf if reward is None or (isinstance(reward, float) and math.isnan(reward)) else float(reward)


def pick_samples(rows: Sequence[Mapping[str, Any]], count: int = SAMPLE_COUNT) -> list[Mapping[str, Any]]:
    """The best, a middle and the worst completion by reward: one look shows what the policy gets
    right and wrong. Ties keep log order, so the choice is the same every time for the same rows."""
    ranked = sorted(rows, key=_reward_key, reverse=True)
    if len(ranked) <= count:
        return ranked
    positions = sorted({round(i * (len(ranked) - 1) / (count - 1)) for i in range(count)})
    return [ranked[p] for p in positions]


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def _clip(text: Any, limit: int) -> str:
    text = str(text)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


def _fenced(text: str) -> str:
    """A code block that no backtick run inside `text` can close early."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{text}\n{fence}"


def step_markdown(run_id: str, step: int, metrics_row: Mapping[str, Any], samples: Sequence[Mapping[str, Any]]) -> str:
    """The artifact's text: headline metrics, the other metrics, then the sample completions."""
    numbers = {
        k: v
        for k, v in metrics_row.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step",)
    }
    headline = [k for k in HEADLINE_METRICS if k in numbers]
    rest = sorted(k for k in numbers if k not in headline)
    lines = [f"## Run `{run_id}`, step {step}", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_format_value(numbers[k])} |" for k in headline + rest]
    lines += ["", f"### {len(samples)} sample completions (best, middle, worst by reward)"]
    for number, row in enumerate(samples, start=1):
        rewards = ", ".join(
            f"{k.removeprefix(REWARD_PREFIX)} {_format_value(v)}"
            for k, v in row.items()
            # per-function scores only (reward_error is text)
            if k.startswith(REWARD_PREFIX) and isinstance(v, (int, float)) and not isinstance(v, bool)
        )
        advantage = row.get("advantage")
        lines += [
            "",
            f"**{number}. reward {_format_value(row.get('reward'))}**"
            + (f" ({rewards})" if rewards else "")
            + (f", advantage {_format_value(advantage)}" if advantage is not None else ""),
            "",
            "Prompt:",
            "",
            _fenced(_clip(row.get("prompt", ""), MAX_PROMPT_CHARS)),
            "",
            "Completion:",
            "",
            _fenced(_clip(row.get("completion", ""), MAX_COMPLETION_CHARS)),
        ]
    return "\n".join(lines) + "\n"


def step_artifact(
    plan_or_run_id: RunPlan | str,
    step: int,
    metrics_row: Mapping[str, Any],
    rollouts_table: pa.Table | Sequence[RolloutBatch] | Sequence[Mapping[str, Any]] | Any | None = None,
) -> UUID | None:
    """A markdown artifact (key `grpo-step-<run>`, a new version per step) with the step's metrics
    and three sample completions with their rewards; returns its id, or None if it could not be made.

    `rollouts_table`: see `rollout_rows`; None reads the logged step back (pass the RunPlan).
    """
    from prefect.artifacts import create_markdown_artifact

    run_id = run_id_of(plan_or_run_id)
    try:
        samples = pick_samples(rollout_rows(plan_or_run_id, step, rollouts_table))
        return create_markdown_artifact(  # type: ignore[return-value]  # Prefect's sync call returns the id
            key=artifact_key("grpo-step", run_id),
            markdown=step_markdown(run_id, step, metrics_row, samples),
            description=f"Run {run_id}, step {step}: metrics and sample completions",
        )
    except Exception as error:  # an artifact is a view of the Parquet logs; never fail a step over it
        logger.warning("run %s: no step artifact for step %d: %s: %s", run_id, step, type(error).__name__, error)
        return None


# -- progress --------------------------------------------------------------------------------------------
def _percent(completed_steps: int, total_steps: int) -> float:
    return 100.0 * min(max(completed_steps, 0), total_steps) / total_steps if total_steps > 0 else 0.0


def create_run_progress(plan_or_run_id: RunPlan | str, total_steps: int, completed_steps: int = 0) -> UUID | None:
    """A progress artifact (key `grpo-progress-<run>`) at `completed_steps` of `total_steps`; returns
    its id for `update_run_progress`. Create it once per flow run (a resumed run starts at its
    resume point), then update it after each step."""
    from prefect.artifacts import create_progress_artifact

    run_id = run_id_of(plan_or_run_id)
    try:
        return create_progress_artifact(  # type: ignore[return-value]  # Prefect's sync call returns the id
            progress=_percent(completed_steps, total_steps),
            key=artifact_key("grpo-progress", run_id),
            description=f"step {completed_steps} / {total_steps}",  # the key names the run
        )
    except Exception as error:  # see step_artifact
        logger.warning("run %s: no progress artifact: %s: %s", run_id, type(error).__name__, error)
        return None


def update_run_progress(artifact_id: UUID | None, completed_steps: int, total_steps: int) -> None:
    """Move the progress artifact to `completed_steps` of `total_steps`; nothing when `artifact_id` is None."""
    from prefect.artifacts import update_progress_artifact

    if artifact_id is None:
        return
    try:
        update_progress_artifact(
            artifact_id=artifact_id,
            progress=_percent(completed_steps, total_steps),
            description=f"step {completed_steps} / {total_steps}",
        )
    except Exception as error:  # see step_artifact
        logger.warning("progress artifact %s not updated: %s: %s", artifact_id, type(error).__name__, error)


# -- the artifact thread ---------------------------------------------------------------------------------
class _WriteGate:
    """Lets the artifact thread call the API only while the gate is open.

    Prefect's SQLite-backed server answers a write that collides with another one with 503
    ("database is locked": the task-run insert reads before it writes, so SQLite fails it at once
    rather than waiting), and the client retries after a fixed 2 s. An artifact written while the
    grpo flow starts or ends a step subflow made the subflow's own task-run insert collide on
    nearly every step (benchmarks/orchestration.py: 2.4 s per instant step, 0.32 s without).
    So the flow closes the gate around each subflow call and the step body opens it: artifacts
    are written while the step works, never beside Prefect's own writes.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._open = True
        self._busy = False

    def run(self, context: contextvars.Context, function: Callable[..., Any], *args: Any) -> Any:
        with self._condition:
            self._condition.wait_for(lambda: self._open)
            self._busy = True
        try:
            return context.run(function, *args)
        finally:
            with self._condition:
                self._busy = False
                self._condition.notify_all()

    @contextlib.contextmanager
    def set_open(self, is_open: bool) -> Iterator[None]:
        """Open or close the gate for the block, then put it back as it was. Closing waits
        (briefly) for a call already under way, so none overlaps the block."""
        previous = self._swap(is_open)
        try:
            yield
        finally:
            self._swap(previous)

    def _swap(self, is_open: bool) -> bool:
        with self._condition:
            previous, self._open = self._open, is_open
            self._condition.notify_all()
            if not is_open:
                self._condition.wait_for(lambda: not self._busy, timeout=GATE_WAIT_S)
            return previous


GATE_WAIT_S = 30.0  # an artifact call stuck longer than this no longer holds the flow back
_gate = _WriteGate()
_publisher_lock = threading.Lock()
_publisher: concurrent.futures.ThreadPoolExecutor | None = None
_pending: set[concurrent.futures.Future] = set()


def publish(function: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """Run `function(*args)` (step_artifact, update_run_progress) on the artifact thread, after
    everything published before it, in the caller's context, once artifact writes are allowed;
    returns at once."""
    global _publisher
    context = contextvars.copy_context()  # the Prefect run context: the artifact's flow run
    with _publisher_lock:
        if _publisher is None:
            _publisher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-flow-artifacts")
        future = _publisher.submit(_gate.run, context, function, *args)
        _pending.add(future)
    future.add_done_callback(_forget)
    return future


def artifact_writes_paused() -> contextlib.AbstractContextManager[None]:
    """Hold published artifacts back for the block (the grpo flow, around a step subflow call)."""
    return _gate.set_open(False)


def artifact_writes_allowed() -> contextlib.AbstractContextManager[None]:
    """Let published artifacts be written during the block (a step subflow's body)."""
    return _gate.set_open(True)


def _forget(future: concurrent.futures.Future) -> None:
    with _publisher_lock:
        _pending.discard(future)


def flush_artifacts(timeout: float | None = 120.0) -> None:
    """Wait until everything published so far is written (the functions never raise)."""
    with _publisher_lock:
        pending = list(_pending)
    with artifact_writes_allowed():
        concurrent.futures.wait(pending, timeout=timeout)
