"""The README's quick start, `grpo train --preset tiny`, timed from this checkout and from another one
(an older commit: `git worktree add /tmp/before <commit>`), run after run in turn on a local folder.

    python -m benchmarks.quickstart --baseline /tmp/before [--repeats 3] [--max-steps 50] [--json FILE]

Each run is a fresh `python -m grpo_flow train` process with its checkout first on PYTHONPATH, its own
storage folder per checkout and a new run id; one untimed run per checkout first builds the tiny model
and warms the disk cache. Figures: each run's wall seconds, each side's median, and this checkout's
median over the baseline's (issue 35's target: the storage layer costs a local run at most 5 %).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness


def timed_run(checkout: Path, storage_root: Path, run_id: str, max_steps: int) -> float:
    env = {**os.environ, **harness.QUIET_ENV, "PYTHONPATH": str(checkout)}
    args = ["train", "--preset", "tiny", "--max-steps", str(max_steps), "--no-progress"]
    args += ["--storage-root", str(storage_root), "--run-id", run_id]
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "grpo_flow", *args], cwd=checkout, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{checkout}: grpo train exited {done.returncode}: {done.stderr[-2000:]}")
    return time.perf_counter() - started


def measure(args: argparse.Namespace) -> dict[str, Any]:
    sides = {"this checkout": harness.ROOT, "baseline": args.baseline.resolve()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory(prefix="grpo-quickstart-") as tmp:
        roots = {name: Path(tmp) / name.replace(" ", "-") for name in sides}
        for name, checkout in sides.items():
            timed_run(checkout, roots[name], "warm-up", args.max_steps)
        for repeat in range(args.repeats):
            for name, checkout in sides.items():
                times[name].append(timed_run(checkout, roots[name], f"run-{repeat}", args.max_steps))
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "baseline": str(sides["baseline"]),
        "max_steps": args.max_steps,
        "runs_s": times,
        "median_s": medians,
        "ratio": medians["this checkout"] / medians["baseline"],
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    rows = [[name, *values, result["median_s"][name]] for name, values in result["runs_s"].items()]
    header = ["side", *(f"run {i + 1} s" for i in range(args.repeats)), "median s"]
    print(harness.table(header, rows, digits=1))
    print(f"\nthis checkout / baseline: {result['ratio']:.3f} (target <= 1.05)")


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", type=Path, required=True, help="the other checkout (a git worktree)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side (default 3)")
    parser.add_argument("--max-steps", type=int, default=50, help="the quick start's steps (default 50)")


def check(args: argparse.Namespace) -> str | None:
    if not (args.baseline / "grpo_flow").is_dir():
        return f"--baseline: {args.baseline} is not a grpo-flow checkout (no grpo_flow folder)"
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return harness.main(__doc__, measure, report, argv, options=options, check=check)


if __name__ == "__main__":
    main()
