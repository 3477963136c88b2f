"""`grpo` in a subprocess, and what `grpo train` prints after its run line: the summary's row names, in order
(flows/cli.py print_summary)."""

import os
import subprocess
import sys

SUMMARY_ROWS = [
    "run",
    "status",
    "steps",
    "held-out accuracy, random init",
    "held-out accuracy, after warm start",
    "held-out accuracy, before RL",
    "held-out accuracy, after RL",
    "mean reward, last 5 steps",
    "wall time from the workers' start",
    "storage",
]
# Simple mode (TRL's loop) evaluates nothing held out before and after RL.
SIMPLE_MODE_SUMMARY_ROWS = [row for row in SUMMARY_ROWS if not row.endswith(" RL")]


def summary_lines(stdout: str) -> list[str]:
    """The summary's lines of `grpo train`'s output: what is left once the `grpo-flow: ...` lines before it
    (the run line, the settings line) are taken out."""
    return [line for line in stdout.splitlines() if not line.startswith("grpo-flow: ")]


def run_cli(*args, env_extra=None, timeout=600, cwd=None):
    """`grpo ARGS` in a process of its own, its output captured as text."""
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **(env_extra or {})}
    env.pop("WANDB_MODE", None)  # conftest's; with it transformers prints "Running in WANDB offline mode"
    return subprocess.run(
        [sys.executable, "-m", "grpo_flow.flows.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=cwd,
    )
