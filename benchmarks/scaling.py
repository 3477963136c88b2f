"""Costs that stay flat as a run grows, with instant workers, in one invocation.

    python -m benchmarks.scaling [--steps 500] [--window 10] [--resumes 3] [--json FILE]

One run of `--steps` steps on the tiny preset's config (32 prompts x 8 generations, 2 shards),
a checkpoint every step (`--save-steps`), workers that answer at once
(benchmarks/instant_workers.py), so what is measured is Prefect, serialization and storage:

- logging, early vs late: the time spent in the step's logging stages (the bodies of the
  `write-rollouts`, `commit-rollouts`, `log-metrics` and `save-checkpoint` tasks: Parquet
  rollouts, the staged-step rename, the metrics row, the checkpoint with its manifest and
  checksums, pruning), summed per step; median over steps 1..W against steps N-W+1..N.
  `late_over_early` (target <= 1.2). The whole step (start of its subflow to the next's) is
  compared the same way (`step_late_over_early`).
- resuming: a 10-step run and the N-step run are each resumed `--resumes` times, alternately, for
  one more step; the time from calling the flow to the start of the first new step (finding the
  newest valid checkpoint, checking the logged steps, restoring the workers) is compared.
  `resume_500_over_10` (target <= 1.2; the key keeps its name for other --steps).
- reading: `grpo runs` and `grpo rollouts RUN --step N/2` on the N-step run, as a user types them
  (a fresh interpreter each time) and as the command's own time in this process. Target < 1 s.
  `grpo runs` checks every step's shard sizes against its manifest, `grpo rollouts` that step's
  sha256. `grpo verify RUN` (every byte of every step and checkpoint) is timed too, no target.

Steps 1..W and N-W+1..N run through the real `grpo` flow. By default the steps between are written
by the same task functions called directly, without Prefect (`--fill direct`): the run's folders
then hold exactly what an N-step run holds, in seconds rather than minutes. `--fill flow` runs
every step through the flow instead (which also grows Prefect's database by N step subflows).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from benchmarks import harness
from benchmarks.steps import StepClock, median_of, run_steps_directly

LOGGING_TASKS = ("write_rollouts", "commit_rollouts", "log_metrics", "save_checkpoint")


class LoggingClock:
    """Seconds spent in the bodies of the logging tasks, summed per step."""

    def __init__(self) -> None:
        self.per_step: dict[int, float] = {}

    @contextlib.contextmanager
    def watch(self) -> Iterator[LoggingClock]:
        from grpo_flow.tasks import rollout, train

        originals = []
        for name in LOGGING_TASKS:
            module = rollout if hasattr(rollout, name) else train
            owner, attribute = getattr(module, name), "fn"  # a Prefect task: its body
            if not hasattr(owner, "fn"):  # a plain function, which its task looks up in the module
                owner, attribute = module, name
            originals.append((owner, attribute, getattr(owner, attribute)))
            setattr(owner, attribute, self._timed(getattr(owner, attribute)))
        try:
            yield self
        finally:
            for owner, attribute, original in originals:
                setattr(owner, attribute, original)

    def _timed(self, fn: Any) -> Any:
        signature = inspect.signature(fn)
        clock = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            step = bound["step"] if "step" in bound else bound["batch"].step
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.per_step[step] = clock.per_step.get(step, 0.0) + time.perf_counter() - started

        timed.__wrapped__ = fn  # type: ignore[attr-defined]  # Prefect's TASK_SOURCE cache key reads the source through it
        timed.__name__, timed.__qualname__, timed.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
        return timed


def scaling_config(storage_root: str, model: str, run_id: str, steps: int, save_steps: int) -> Any:
    from grpo_flow.schemas.presets import preset_config

    return preset_config(
        "tiny",
        model=model,
        storage_root=storage_root,
        run_id=run_id,
        max_steps=steps,
        eval_prompts=0,
        save_steps=save_steps,
    )


def run_flow(config: Any, clock: StepClock) -> dict[str, Any]:
    from grpo_flow.flows.grpo import grpo

    with clock.watch():
        summary = grpo(config)
    if summary.get("status") != "completed":
        raise RuntimeError(f"run {config.run_id} did not complete: {summary.get('error')}")
    return summary


def build_run(
    workdir: Path, model: str, run_id: str, steps: int, window: int, save_steps: int, fill: str
) -> dict[str, Any]:
    """The run, with its first and last `window` steps through the flow; the logging and step times of those."""
    from grpo_flow.workers import backends

    storage_root = str(workdir / "storage")
    logging_clock, clock = LoggingClock(), StepClock()
    with logging_clock.watch():
        if fill == "flow" or steps <= 2 * window:
            run_flow(scaling_config(storage_root, model, run_id, steps, save_steps), clock)
            fill_s = None
        else:
            run_flow(scaling_config(storage_root, model, run_id, window, save_steps), clock)
            config = scaling_config(storage_root, model, run_id, steps - window, save_steps)
            backends.release(run_id)
            fill_s = sum(run_steps_directly(config, clock.plan, window + 1, steps - window).values())
            backends.release(run_id)  # the flow below resumes as a new process would
            run_flow(scaling_config(storage_root, model, run_id, steps, save_steps), clock)
    early, late = range(1, window + 1), range(steps - window + 1, steps + 1)
    per_step = clock.intervals()
    early_per_step = [
        s for s in early if s + 1 in clock.starts
    ]  # start-to-start: the step after it ran in the flow too
    late_per_step = [s for s in late if s + 1 in clock.starts] or [steps]
    return {
        "logging_early_ms": 1000 * median_of(logging_clock.per_step, early),
        "logging_late_ms": 1000 * median_of(logging_clock.per_step, late),
        "step_early_ms": 1000 * median_of(per_step, early_per_step),
        "step_late_ms": 1000 * median_of(per_step, late_per_step),
        "fill_s": fill_s,
        "logging_per_step_ms": {
            str(s): 1000 * v for s, v in sorted(logging_clock.per_step.items()) if s in early or s in late
        },
    }


def resume_once(workdir: Path, model: str, run_id: str, to_step: int, save_steps: int) -> dict[str, float]:
    from grpo_flow.workers import backends

    config = scaling_config(str(workdir / "storage"), model, run_id, to_step, save_steps)
    clock = StepClock()
    started = time.perf_counter()
    run_flow(config, clock)
    backends.release(run_id)
    return {"to_first_step_s": clock.starts[to_step] - started, "whole_s": time.perf_counter() - started}


def cli_latency(storage_root: str, argv: list[str], repeats: int) -> dict[str, float]:
    """`grpo ARGV` as typed (a fresh interpreter: what a user waits for) and as main(ARGV) in this process."""
    from grpo_flow.flows.cli import main

    grpo = Path(sys.executable).with_name("grpo")
    command = [str(grpo)] if grpo.exists() else [sys.executable, "-m", "grpo_flow.flows.cli"]
    full = argv + ["--storage-root", storage_root]
    walls, inproc = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        done = subprocess.run(command + full, capture_output=True, text=True)
        walls.append(time.perf_counter() - started)
        if done.returncode != 0:
            raise RuntimeError(f"grpo {' '.join(full)} failed: {done.stderr.strip()}")
        with contextlib.redirect_stdout(io.StringIO()):
            started = time.perf_counter()
            main(full)
            inproc.append(time.perf_counter() - started)
    return {"command_s": statistics.median(walls), "in_process_s": statistics.median(inproc)}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=500, help="length of the long run (default 500)")
    parser.add_argument("--window", type=int, default=10, help="steps compared at each end (default 10)")
    parser.add_argument(
        "--short-steps", type=int, default=10, help="length of the short run that is resumed (default 10)"
    )
    parser.add_argument("--resumes", type=int, default=3, help="resumes of each run (default 3)")
    parser.add_argument("--cli-repeats", type=int, default=3, help="runs of each grpo command (default 3)")
    parser.add_argument("--save-steps", type=int, default=1, help="checkpoint every N steps (default 1: every step)")
    parser.add_argument(
        "--fill",
        choices=("direct", "flow"),
        default="direct",
        help="how the steps between the two windows are written (default direct)",
    )


def check(args: argparse.Namespace) -> str | None:
    if args.window < 2 or args.steps < 2 * args.window or args.short_steps < 2:
        return "need --window >= 2, --steps >= 2 x --window and --short-steps >= 2"
    return None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.instant_workers import instant_model_dir, instant_workers

    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="grpo-flow-scaling-"))
    storage_root = str(workdir / "storage")
    try:
        model = instant_model_dir(workdir / "instant-model")
        with instant_workers():
            long_run = build_run(workdir, model, "long", args.steps, args.window, args.save_steps, args.fill)
            run_flow(scaling_config(storage_root, model, "short", args.short_steps, args.save_steps), StepClock())
            resumes: dict[str, list[dict[str, float]]] = {"short": [], "long": []}
            for i in range(1, args.resumes + 1):
                resumes["short"].append(resume_once(workdir, model, "short", args.short_steps + i, args.save_steps))
                resumes["long"].append(resume_once(workdir, model, "long", args.steps + i, args.save_steps))
        runs_latency = cli_latency(storage_root, ["runs"], args.cli_repeats)
        rollouts_latency = cli_latency(
            storage_root, ["rollouts", "long", "--step", str(args.steps // 2)], args.cli_repeats
        )
        verify_latency = cli_latency(storage_root, ["verify", "long"], 1)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    resume_short = statistics.median(r["to_first_step_s"] for r in resumes["short"])
    resume_long = statistics.median(r["to_first_step_s"] for r in resumes["long"])
    return {
        "late_over_early": long_run["logging_late_ms"] / long_run["logging_early_ms"],
        "step_late_over_early": long_run["step_late_ms"] / long_run["step_early_ms"],
        "resume_500_over_10": resume_long / resume_short,
        "grpo_runs_s": runs_latency["command_s"],
        "grpo_rollouts_s": rollouts_latency["command_s"],
        "grpo_runs_in_process_s": runs_latency["in_process_s"],
        "grpo_rollouts_in_process_s": rollouts_latency["in_process_s"],
        "grpo_verify_s": verify_latency["command_s"],
        "grpo_verify_in_process_s": verify_latency["in_process_s"],
        "resume_short_s": resume_short,
        "resume_long_s": resume_long,
        "resume_short_whole_s": statistics.median(r["whole_s"] for r in resumes["short"]),
        "resume_long_whole_s": statistics.median(r["whole_s"] for r in resumes["long"]),
        "steps": args.steps,
        "short_steps": args.short_steps,
        "window": args.window,
        "save_steps": args.save_steps,
        "fill": args.fill,
        "targets": {"late_over_early": 1.2, "resume_500_over_10": 1.2, "grpo_runs_s": 1.0, "grpo_rollouts_s": 1.0},
        **long_run,
        "wall_s": time.perf_counter() - started,
    }


def print_report(r: dict[str, Any], args: argparse.Namespace) -> None:
    n, w = args.steps, args.window
    print(
        f"\nCosts as a run grows: instant workers, tiny preset's shapes, a checkpoint every {args.save_steps} step(s); "
        f"{r['wall_s']:.0f} s in all"
    )
    fill = (
        f"steps {w + 1}..{n - w} written directly in {r['fill_s']:.1f} s"
        if r["fill_s"] is not None
        else "every step through the flow"
    )
    print(f"(long run: {n} steps, {fill}; short run: {args.short_steps} steps)\n")
    print(f"{'':<58}{'early':>10}{'late':>10}{'late/early':>12}")
    print(
        f"{f'logging per step, ms (steps 1-{w} vs {n - w + 1}-{n})':<58}{r['logging_early_ms']:>10.1f}"
        f"{r['logging_late_ms']:>10.1f}{r['late_over_early']:>12.2f}   [late_over_early, target <= 1.2]"
    )
    print(
        f"{'whole step, ms (start to next start)':<58}{r['step_early_ms']:>10.1f}{r['step_late_ms']:>10.1f}"
        f"{r['step_late_over_early']:>12.2f}"
    )
    print(f"\n{'':<58}{f'{args.short_steps} steps':>10}{f'{n} steps':>10}{'ratio':>12}")
    print(
        f"{'resume: flow start to first new step, s':<58}{r['resume_short_s']:>10.2f}{r['resume_long_s']:>10.2f}"
        f"{r['resume_500_over_10']:>12.2f}   [resume_500_over_10, target <= 1.2]"
    )
    print(
        f"{'resume: whole call (one more step), s':<58}{r['resume_short_whole_s']:>10.2f}{r['resume_long_whole_s']:>10.2f}"
    )
    print(f"\n{f'on the {n}-step run':<58}{'command':>10}{'in-proc':>10}")
    print(f"{'grpo runs, s':<58}{r['grpo_runs_s']:>10.2f}{r['grpo_runs_in_process_s']:>10.3f}   [target < 1 s]")
    print(
        f"{f'grpo rollouts long --step {n // 2}, s':<58}{r['grpo_rollouts_s']:>10.2f}"
        f"{r['grpo_rollouts_in_process_s']:>10.3f}   [target < 1 s]"
    )
    print(f"{'grpo verify long (every byte), s':<58}{r['grpo_verify_s']:>10.2f}{r['grpo_verify_in_process_s']:>10.3f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return harness.main(__doc__, measure, print_report, argv, options=options, check=check)


if __name__ == "__main__":
    main()
