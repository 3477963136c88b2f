"""How fast `grpo train` refuses bad input and stops on a signal, as a user sees it (real processes).

    python -m benchmarks.stopping [--storage-root DIR] [--repeats 3] [--json FILE]

Figures (seconds, median over --repeats):
- `checks_s`: from start to exit 2 for each kind of bad input (a reward path, reward_weights, a data
  set path, a model path, a storage root that cannot be written);
- `ctrl_c_s`: from a Ctrl-C (SIGINT to the process group) during a tiny-preset run to the exit, which
  comes after the step under way;
- `overrun_s`: the same while a step is stuck in a reward function (it sleeps for a minute): the
  run stops at once after flows/interrupt.GRACE_S;
- `second_ctrl_c_s`: from a second Ctrl-C (0.5 s after the first, during that stuck step) to the exit;
- `help_lines`: lines of `grpo train --help`.
Each run starts its own ephemeral Prefect server, as a user's does.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

REWARDS = Path(__file__).resolve().parents[1] / "tests" / "flows"  # fault_rewards.slow_last_digit
BAD_INPUT = {
    "reward path": ["--reward-funcs", "no_such_module:score"],
    "reward_weights": ["--reward-weights", "1", "2"],
    "data set path": ["--dataset", "hf:./no/such.jsonl", "--reward-funcs", "last_digit"],
    "model path": ["--model", "./no-such-model"],
    "storage root": ["--storage-root", "/sys/grpo-flow-check"],
}
STOPS = ("ctrl_c_s", "overrun_s", "second_ctrl_c_s")


def grpo(*args: str) -> list[str]:
    return [sys.executable, "-m", "grpo_flow.flows.cli", *args]


def timed_refusal(args: list[str], root: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run(grpo("train", "--storage-root", str(root), *args), capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    return time.perf_counter() - started


def timed_stop(root: Path, run_id: str, sleep_s: float, second: bool, env: dict[str, str]) -> float:
    """Seconds from the (last) Ctrl-C to the exit of a tiny-preset run."""
    started_marker = root / f"{run_id}.reward-started"
    args = ["train", "--preset", "tiny", "--max-steps", "500", "--eval-prompts", "8", "--no-progress"]
    args += ["--storage-root", str(root), "--run-id", run_id]
    if sleep_s:
        args += ["--reward-funcs", "fault_rewards:slow_last_digit"]
    run_env = {**env, "GRPO_TEST_REWARD_SLEEP": str(sleep_s), "GRPO_TEST_REWARD_STARTED": str(started_marker)}
    run = subprocess.Popen(grpo(*args), env=run_env, start_new_session=True, stdout=subprocess.PIPE, text=True)
    metrics = root / "runs" / run_id / "metrics" / "step-000002.parquet"
    ready = started_marker if sleep_s else metrics
    while not ready.exists() and run.poll() is None:
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGINT)
    if second:
        time.sleep(0.5)
        os.killpg(run.pid, signal.SIGINT)
    sent = time.perf_counter()
    run.communicate(timeout=300)
    assert run.returncode in (130, -2), run.returncode
    return time.perf_counter() - sent


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage-root", default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--repeats", type=int, default=3)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.storage_root or tempfile.mkdtemp(prefix="grpo-stopping-"))
    home = root / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REWARDS), os.environ.get("PYTHONPATH", "")])}
    env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(home)}

    checks = {
        name: statistics.median(timed_refusal(a, root) for _ in range(args.repeats)) for name, a in BAD_INPUT.items()
    }
    stops: dict[str, list[float]] = {name: [] for name in STOPS}
    for i in range(args.repeats):
        stops["ctrl_c_s"].append(timed_stop(root, f"stop-{i}", 0, False, env))
        stops["overrun_s"].append(timed_stop(root, f"overrun-{i}", 60, False, env))
        stops["second_ctrl_c_s"].append(timed_stop(root, f"twice-{i}", 60, True, env))
    help_text = subprocess.run(grpo("train", "--help"), capture_output=True, text=True).stdout
    return {
        "checks_s": {name: round(s, 2) for name, s in checks.items()},
        **{name: round(statistics.median(values), 2) for name, values in stops.items()},
        **{name.replace("_s", "_max_s"): round(max(values), 2) for name, values in stops.items()},
        "help_lines": len(help_text.splitlines()),
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    rows = [[f"refused bad {name}", seconds, ""] for name, seconds in result["checks_s"].items()]
    rows += [[name, result[name], result[name.replace("_s", "_max_s")]] for name in STOPS]
    print(harness.table(("seconds", "median", "max"), rows, 2))
    print(f"grpo train --help: {result['help_lines']} lines")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return harness.main(__doc__, measure, report, argv, options=options)


if __name__ == "__main__":
    main()
