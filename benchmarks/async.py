"""One-step-off pipelining (max_staleness 1) against synchronous training, in one invocation.

    python -m benchmarks.async [--steps 8] [--completion-length 48] [--json FILE]

The same run twice on a generation-bound config (a randomly initialised Qwen2 that rarely
stops, so every completion runs to full length): the same model, data, reward, seed, steps
and completion length, so the same number of generated tokens, one rollout worker.
Pipelined: step t+1's rollouts are generated in a rollout process while the actor takes step t
in this one, one core each (the cores shared out between the two processes). Synchronous, twice:
rollouts then actor step with the same one core for each (the issue's comparison: what the
overlap alone buys, `speedup`), and with every core for each in turn (`speedup_vs_all_cores`:
what it buys over a synchronous run that uses the whole machine). Each side's first step
(process start-up, warm caches) is left out; steps per second come from the remaining steps.
JSON keys: `sync_steps_per_s`, `async_steps_per_s`, `speedup`, `sync_all_cores_steps_per_s`,
`speedup_vs_all_cores`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.steps import save_random_model


def run(
    storage_root: str,
    model_path: str,
    run_id: str,
    steps: int,
    completion_length: int,
    max_staleness: int,
    threads: int | None = None,
) -> dict[str, Any]:
    """One run; `threads`: torch threads for this process's generation and actor step (the
    pipelined side shares the cores out itself)."""
    import torch

    from grpo_flow.flows.grpo import grpo
    from grpo_flow.schemas.presets import preset_config
    from grpo_flow.workers.backends import release
    from grpo_flow.workers.state.storage import RunStorage

    config = preset_config(
        "tiny",
        model=model_path,
        run_id=run_id,
        storage_root=storage_root,
        max_steps=steps,
        save_steps=steps,
        eval_prompts=0,
        prompts_per_step=4,
        num_generations=8,
        max_completion_length=completion_length,
        max_staleness=max_staleness,
        num_rollout_workers=1,
    )
    if threads is not None:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    summary = grpo(config)
    wall = time.perf_counter() - started
    release(run_id)
    rows = RunStorage(storage_root, run_id).read_metrics().to_pylist()
    timed = [r["step_s"] for r in rows[1:]]  # the first step starts processes and warms caches
    tokens = RunStorage(storage_root, run_id).read_rollouts(columns=["completion_tokens"]).column(0).to_pylist()
    return {
        "status": summary["status"],
        "steps_per_s": len(timed) / sum(timed),
        "median_step_s": statistics.median(timed),
        "wall_s": wall,
        "tokens_per_step": sum(tokens) / len(rows),
        "final_reward": summary["final_reward"],
    }


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=48, help="tokens per completion (generation-bound)")
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)


def check(args: argparse.Namespace) -> str | None:
    return "--steps: at least 2 (the first step is left out)" if args.steps < 2 else None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from prefect.testing.utilities import prefect_test_harness

    root = tempfile.mkdtemp(prefix="grpo-flow-async-bench-")
    model_path = str(Path(root) / "model")
    # A randomly initialised model rarely samples EOS, so every completion runs to full length:
    # generation-bound, and both sides generate the same number of tokens.
    params = save_random_model(Path(model_path), args.hidden_size, args.layers)
    cores = os.cpu_count() or 1
    with prefect_test_harness(server_startup_timeout=120):
        sync_all_cores = run(root, model_path, "sync-all-cores", args.steps, args.completion_length, 0, threads=cores)
        sync = run(root, model_path, "sync", args.steps, args.completion_length, 0, threads=max(1, cores // 2))
        pipelined = run(root, model_path, "async", args.steps, args.completion_length, 1)
    return {
        "cores": cores,
        "parameters": params,
        "steps": args.steps,
        "completion_length": args.completion_length,
        "sync": sync,
        "sync_all_cores": sync_all_cores,
        "async": pipelined,
        "sync_steps_per_s": sync["steps_per_s"],
        "async_steps_per_s": pipelined["steps_per_s"],
        "speedup": pipelined["steps_per_s"] / sync["steps_per_s"],
        "sync_all_cores_steps_per_s": sync_all_cores["steps_per_s"],
        "speedup_vs_all_cores": pipelined["steps_per_s"] / sync_all_cores["steps_per_s"],
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    cores, half = result["cores"], max(1, result["cores"] // 2)
    print(
        f"random Qwen2, {result['parameters'] / 1e6:.1f}M parameters, 4 prompts x 8 generations, up to "
        f"{args.completion_length} tokens, {args.steps} steps (first left out), {cores} cores\n"
    )
    sides = (
        (f"synchronous, {half} core(s) each", result["sync"]),
        (f"synchronous, {cores} cores each in turn", result["sync_all_cores"]),
        (f"one-step-off (max_staleness 1), {half} each", result["async"]),
    )
    keys = ("steps_per_s", "median_step_s", "tokens_per_step", "final_reward")
    header = ("side", "steps/s", "median step (s)", "tokens/step", "final reward")
    print(harness.table(header, [[name, *(side[k] for k in keys)] for name, side in sides], [3, 3, 1, 3]))
    print(f"\nspeedup (steps/s, async / sync with the same cores each): {result['speedup']:.2f}   (target >= 1.5)")
    print(f"speedup over a synchronous run using every core:       {result['speedup_vs_all_cores']:.2f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return harness.main(__doc__, measure, report, argv, options=options, check=check)


if __name__ == "__main__":
    main()
