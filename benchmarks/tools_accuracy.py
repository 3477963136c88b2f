"""Held-out accuracy of a run with tools, with its tools and with them disabled, before and after RL.

    python -m benchmarks.tools_accuracy RUN_ID [--storage-root DIR] [--prompts 200] [--json FILE]

For the run's start model and each of its checkpoints: greedy multi-turn episodes on the first
`--prompts` held-out prompts, scored by the run's accuracy reward, once with the tools called as in
training and once with every call answered by an error (`the tools are disabled`), the tools never run.
The second figure is what the policy does when its tools cannot help: for a task that needs its tool
it stays near a guess's.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from benchmarks import harness


def tools_accuracy(storage_root: str, run_id: str, prompts: int) -> dict[str, Any]:
    from grpo_flow.schemas.config import GRPOFlowConfig
    from grpo_flow.workers.data.loaders import load_task
    from grpo_flow.workers.data.models import resolve_model_path
    from grpo_flow.workers.rollout.episodes import EpisodeRunner
    from grpo_flow.workers.rollout.heldout import heldout_accuracy
    from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine
    from grpo_flow.workers.state.storage import RunStorage

    storage = RunStorage(storage_root, run_id)
    config = GRPOFlowConfig(**storage.read_config())
    if not (config.tools or config.environment_factory):
        raise SystemExit(f"run {run_id!r} has no tools or environment_factory")
    task = load_task(config.dataset)
    models = {"start": resolve_model_path(config.model, storage_root)}
    models |= {f"step {step}": str(storage.checkpoint_dir(step) / "model") for step in storage.complete_checkpoints()}
    result: dict[str, Any] = {"run_id": run_id, "prompts": min(prompts, len(task.heldout)), "models": {}}
    for name, path in models.items():
        engine = TransformersRolloutEngine(path)
        engine.load()
        started = time.perf_counter()
        figures = {}
        for label, disabled in (("with_tools", False), ("tools_disabled", True)):
            runner = EpisodeRunner.from_config(config, path, tools_disabled=disabled)
            figures[label] = heldout_accuracy(
                engine, task, prompts, config.max_completion_length, config.max_prompt_length, episodes=runner
            )
        result["models"][name] = {**figures, "seconds": time.perf_counter() - started}
    return result


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_id", metavar="RUN_ID")
    parser.add_argument("--storage-root", default="grpo-storage")
    parser.add_argument("--prompts", type=int, default=200, help="held-out prompts (default: 200)")


def check(args: argparse.Namespace) -> str | None:
    return f"--prompts: must be at least 1, got {args.prompts}" if args.prompts < 1 else None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    return tools_accuracy(args.storage_root, args.run_id, args.prompts)


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    print(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return harness.main(__doc__, measure, report, argv, options=options, check=check)


if __name__ == "__main__":
    main()
