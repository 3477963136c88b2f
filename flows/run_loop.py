"""What the `grpo` flow's loop needs from Prefect and the terminal, kept out of its body.

- `RunLoop`: the loop's context. Inside it, step subflows run without Prefect's per-flow-run
  heartbeat (the run's own heartbeat reports them; Prefect 3.8 joins a heartbeat thread that sleeps
  in 1 s slices at the end of every flow run), artifacts wait while subflows start on a database
  where they would collide with Prefect's own writes (tasks/observability.py; not on the ephemeral
  server's in-memory database, flows/__init__.py), progress is shown, and the loop stops between
  steps on Ctrl-C or SIGTERM (flows/interrupt.py). Leaving it finishes the run one way, whatever
  the outcome (completed, interrupted, failed): summary.json, the summary artifact, the workers
  released (`tasks.run.finish_run`).
- `StepProgress`: a bar on a terminal; on a file or pipe (CI, a Prefect worker's log) a plain line
  every few steps with the recent seconds per step and an ETA, never carriage-return frames.
- `step_subflow(run_step)`: a step as its own subflow run, whose body writes the artifacts the
  loop held back while the subflow started.
- `as_is(values)` and `in_background(function, *args)`: Prefect task inputs passed through
  unwalked, and a function run beside the flow with its Prefect context.
"""

from __future__ import annotations

import collections
import contextvars
import functools
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, closing, nullcontext
from typing import Any, TextIO

from prefect import flow, get_run_logger
from prefect.exceptions import TerminationSignal
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from prefect.states import Cancelled
from prefect.utilities.annotations import quote

from grpo_flow.flows import ephemeral_database_in_memory, events
from grpo_flow.flows.interrupt import (
    cancelled_by,
    interrupted_summary,
    resume_command,
    stop_requested,
    stop_signal_name,
)
from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.schemas.records import RunPlan
from grpo_flow.tasks.observability import (
    USER_FACING,
    artifact_writes_allowed,
    artifact_writes_paused,
    create_run_progress,
    flush_artifacts,
    publish,
    update_run_progress,
)
from grpo_flow.tasks.run import finish_run
from grpo_flow.workers.rewards import deadline
from grpo_flow.workers.state.location import absolute_root
from grpo_flow.workers.state.storage import RunStorage


def step_subflow(run_step: Callable[..., Any]) -> Any:
    """`run_step` as the `grpo-step` subflow (`<run>-step-N` in the UI). persist_result=False: a retried
    parent flow run must run a step again, never reuse an old step's result (Prefect reuses a finished
    subflow run only when its result was persisted)."""

    @functools.wraps(run_step)
    def step_body(*args: Any, **kwargs: Any) -> Any:
        with artifact_writes_allowed():
            return run_step(*args, **kwargs)

    return flow(
        name="grpo-step", flow_run_name="{plan.run_id}-step-{step}", validate_parameters=False, persist_result=False
    )(step_body)


def as_is(values: list) -> list:
    """Task inputs that Prefect passes through as they are: otherwise it walks every element of every
    per-row list before each task, which grows with the shard."""
    return [quote(value) for value in values]


def in_background(function: Any, *args: Any) -> Future:
    """Run `function` on a thread that shares this flow run's Prefect context, so the tasks it calls
    are recorded as this flow run's task runs."""
    context = contextvars.copy_context()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-flow-next-step")
    future = executor.submit(context.run, function, *args)
    executor.shutdown(wait=False)
    return future


def no_signal_warning(rows: Sequence[Mapping[str, Any]], steps: int) -> str | None:
    """The warning when in each of the first `steps` rows a run trained every group's rewards tied (TRL's
    `frac_reward_zero_std` 1.0: zero advantages, no learning signal), given once, as the `steps`-th row
    comes; None otherwise (and always for `steps` 0)."""
    if steps == 0 or len(rows) != steps:
        return None
    if not all(float(row.get("frac_reward_zero_std", math.nan)) >= 1.0 for row in rows):
        return None
    first, last = rows[0]["step"], rows[-1]["step"]
    where = f"steps {first}-{last}" if last > first else f"step {first}"
    return (
        f"{where}: no learning signal: 0 % of groups had rewards that differ (frac_reward_zero_std 1.0), so every "
        "advantage is 0 and the policy does not move; try more completions per prompt (--num-generations), a "
        "softer reward that gives partial credit, or a higher --temperature"
    )


def step_numbers(plan: RunPlan, row: Mapping[str, Any]) -> str:
    """`RUN: step 3/10  reward 0.250  last_digit 0.250  kl 0.0012  loss 0.0100`: a step's headline numbers,
    each reward function's mean (its accuracy, for a 0/1 reward) named after it; kl when it is logged."""
    parts = [f"{plan.run_id}: step {row['step']}/{plan.total_steps}", f"reward {row['reward']:.3f}"]
    parts += [f"{name[8:-5]} {value:.3f}" for name, value in row.items() if re.fullmatch(r"rewards/.+/mean", name)]
    if "kl" in row:
        parts.append(f"kl {row['kl']:.4f}")
    parts.append(f"loss {row['loss']:.4f}")
    return "  ".join(parts)


RECENT_STEPS = 5  # the ETA is the steps left times the mean of this many recent steps


def duration_text(seconds: float) -> str:
    """`42 s`, `3 min 05 s`, `2 h 07 min`: a duration as a person reads it."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class StepProgress:
    """Progress over a run's steps: a tqdm bar on a terminal, else a line every `every` steps (0: about
    ten lines a run) and at the last step."""

    def __init__(
        self,
        plan: RunPlan,
        show: bool,
        every: int = 0,
        stream: TextIO | None = None,
        terminal: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.plan, self.show = plan, show
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        remaining = plan.total_steps - plan.first_step + 1
        self.every = every or max(1, math.ceil(remaining / 10))
        self.bar: Any = None
        self.clock = clock
        self.last = clock()
        self.recent: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)  # seconds of the last steps
        if show and self.terminal:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=plan.total_steps, initial=plan.first_step - 1, desc=plan.run_id, unit="step", file=self.stream
            )

    def update(self, step: int, row: dict[str, Any]) -> None:
        if not self.show:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{row['reward']:.3f}", loss=f"{row['loss']:.4f}")
            return
        now = self.clock()
        self.recent.append(now - self.last)
        self.last = now
        done = step - self.plan.first_step + 1
        if done % self.every == 0 or step == self.plan.total_steps:
            per_step = statistics.fmean(self.recent)
            left = self.plan.total_steps - step
            eta = f"  ETA {duration_text(left * per_step)}" if left else ""
            print(
                f"{step_numbers(self.plan, row)}  {per_step:.2f} s/step{eta}",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RunLoop:
    """One run's loop over its steps, and its end; see the module docstring.

    `result` after the block: the summary of a completed run, or a Cancelled state for one stopped
    by a signal. A failure is recorded (summary.json says `failed` at its step) and raised on.
    """

    def __init__(self, config: GRPOFlowConfig, plan: RunPlan, show_progress: bool, progress_every: int = 0) -> None:
        self.config, self.plan = config, plan
        self.show_progress, self.progress_every = show_progress, progress_every
        self.rows: list[dict[str, Any]] = []
        self.step_walls: list[float] = []  # around each step: its work plus Prefect's orchestration
        self.initial_accuracy = math.nan
        self.final_accuracy = math.nan
        self.result: Any = None
        self._stack = ExitStack()

    def __enter__(self) -> RunLoop:
        self.started = time.perf_counter()
        self._stack.enter_context(temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}))
        collide = self.config.step_subflows and not ephemeral_database_in_memory()
        self._stack.enter_context(artifact_writes_paused() if collide else nullcontext())
        self._stack.callback(deadline.close_all)  # user code's processes end with its run, not with the session
        plan = self.plan
        started = {"first_step": plan.first_step, "total_steps": plan.total_steps, "resumes": plan.resumes}
        events.emit(events.RUN_STARTED, plan.run_id, {**started, "model": self.config.model})
        return self

    @property
    def next_step(self) -> int:
        return self.plan.first_step + len(self.rows)

    @property
    def finished(self) -> bool:
        """Every step trained (not stopped by a signal)."""
        return self.next_step > self.plan.total_steps

    def steps(self) -> Iterator[int]:
        """The steps left, until a Ctrl-C or SIGTERM asks the loop to stop between two of them."""
        plan = self.plan
        self.progress_artifact = create_run_progress(plan, plan.total_steps, plan.first_step - 1)  # never raises
        self.progress = self._stack.enter_context(closing(StepProgress(plan, self.show_progress, self.progress_every)))
        for step in range(plan.first_step, plan.total_steps + 1):
            if stop_requested():
                return
            self._step_started = time.perf_counter()
            yield step

    def record(self, row: dict[str, Any]) -> None:
        """A step's metrics row: kept, logged, shown and announced."""
        self.rows.append(row)
        warning = no_signal_warning(self.rows, self.config.no_signal_warning_steps)
        if warning is not None:
            get_run_logger().warning(warning, extra={USER_FACING: True})
        self.step_walls.append(time.perf_counter() - self._step_started)
        get_run_logger().info("%s  %.2f s", step_numbers(self.plan, row), row["step_s"])  # the UI's log tab
        self._emit_step_events(row)
        publish(update_run_progress, self.progress_artifact, row["step"], self.plan.total_steps)
        self.progress.update(row["step"], row)

    def _emit_step_events(self, row: dict[str, Any]) -> None:
        """grpo.step.completed, and grpo.checkpoint.saved when the step saved one (run_step's rule)."""
        plan, step = self.plan, row["step"]
        events.step_completed(plan.run_id, row, self.config.guard_max_kl)
        if step % self.config.save_steps == 0 or step == plan.total_steps:
            path = RunStorage.of(plan).checkpoint_dir(step)
            payload = {"step": step, "path": str(path), "policy_version": row["policy_version"]}
            payload |= {
                "run_id": plan.run_id,
                "storage_root": absolute_root(plan.storage_root),
            }  # for evaluate/checkpoint
            events.emit(events.CHECKPOINT_SAVED, plan.run_id, payload)

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> None:
        self._stack.close()
        plan = self.plan
        summary: dict[str, Any] = {
            "run_id": plan.run_id,
            "total_steps": plan.total_steps,
            "initial_eval_accuracy": self.initial_accuracy,
        }
        if error is not None:
            failed_step = self.next_step
            summary.update(
                status="failed",
                error=f"step {failed_step}: {type(error).__name__}: {error}",
                failed_step=failed_step,
                steps_completed=failed_step - 1,
            )
            if isinstance(error, KeyboardInterrupt):  # Ctrl-C in a Python session (the API)
                summary = interrupted_summary(summary, plan.run_id, failed_step - 1, plan.total_steps)
            elif isinstance(error, TerminationSignal):  # a served run cancelled (its runner's SIGTERM): not failed
                summary = interrupted_summary(summary, plan.run_id, failed_step - 1, plan.total_steps)
                summary["interrupted_by"] = "SIGTERM"
            self._finish(summary)
            return
        if not self.finished:  # stopped by a signal, or cancelled, between two steps
            last_step = self.next_step - 1
            summary = interrupted_summary(summary, plan.run_id, last_step, plan.total_steps)
            summary.update(initial_eval_accuracy=self.initial_accuracy, storage=str(plan.storage_root))
            summary.update(self.guard_tripped())
            self._finish(summary)
            why = f"cancelled ({cancelled_by()})" if cancelled_by() else f"interrupted by {stop_signal_name()}"
            guard = f"; step {summary['guard_step']}: {summary['guard']}" if "guard" in summary else ""
            message = f"{why} after step {last_step} of {plan.total_steps}{guard}"
            get_run_logger().info(message)  # the UI's log tab; `grpo train` prints its own line
            self.result = Cancelled(message=f"{message}; resume with: {resume_command(plan.run_id, plan.storage_root)}")
            return
        storage = RunStorage.of(plan)
        recent = [storage.read_step_metrics(s) for s in range(max(1, plan.total_steps - 4), plan.total_steps + 1)]
        summary.update(
            status="completed",
            steps_completed=plan.total_steps,
            resumed_from_step=plan.first_step - 1 if plan.resumes else None,
            final_eval_accuracy=self.final_accuracy,
            eval_accuracy_gain=self.final_accuracy - self.initial_accuracy,
            final_reward=sum(r["reward"] for r in recent) / len(recent),
            wall_seconds=time.perf_counter() - self.started,
            median_step_seconds=statistics.median(self.step_walls) if self.step_walls else None,
            storage=str(plan.storage_root),
        )
        self.result = self._finish(summary)

    def guard_tripped(self) -> dict[str, Any]:
        """The first of this process's steps a guard would stop the run for (flows/events.py), if any."""
        for row in self.rows:
            if (verdict := events.guard_verdict(row, self.config.guard_max_kl)) != "ok":
                return {"guard": verdict, "guard_step": row["step"]}
        return {}

    def _finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        flush_artifacts()  # every step's artifacts written before the run reports its outcome
        summary = finish_run(self.config, self.plan, summary)
        events.emit(
            events.RUN_FAILED if summary["status"] == "failed" else events.RUN_FINISHED, self.plan.run_id, summary
        )
        return summary
