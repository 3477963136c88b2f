"""One-step-off pipelining (max_staleness 1) against synchronous training, in one invocation.

    python -m grpo_flow.benchmarks.async [--steps 8] [--completion-length 48] [--json FILE]

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
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


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
    release(config, run_id)
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=48, help="tokens per completion (generation-bound)")
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps: at least 2 (the first step is left out)")

    from prefect.testing.utilities import prefect_test_harness

    from grpo_flow.benchmarks.vs_trl import build_shared_model

    root = tempfile.mkdtemp(prefix="grpo-flow-async-bench-")
    # A randomly initialised model rarely samples EOS, so every completion runs to full length:
    # generation-bound, and both sides generate the same number of tokens.
    model_path, params = build_shared_model(Path(root) / "model", args.hidden_size, args.layers)
    with prefect_test_harness(server_startup_timeout=120):
        cores = os.cpu_count() or 1
        sync_all_cores = run(root, model_path, "sync-all-cores", args.steps, args.completion_length, 0, threads=cores)
        sync = run(root, model_path, "sync", args.steps, args.completion_length, 0, threads=max(1, cores // 2))
        pipelined = run(root, model_path, "async", args.steps, args.completion_length, 1)
    result = {
        "cores": os.cpu_count(),
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
    print(
        f"random Qwen2, {params / 1e6:.1f}M parameters, 4 prompts x 8 generations, up to {args.completion_length} tokens, {args.steps} steps "
        f"(first left out), {os.cpu_count()} cores\n"
    )
    print(f"{'side':<40}{'steps/s':>9}{'median step (s)':>17}{'tokens/step':>13}{'final reward':>14}")
    half = max(1, (os.cpu_count() or 1) // 2)
    sides = (
        (f"synchronous, {half} core(s) each", sync),
        (f"synchronous, {os.cpu_count()} cores each in turn", sync_all_cores),
        (f"one-step-off (max_staleness 1), {half} each", pipelined),
    )
    for name, side in sides:
        print(
            f"{name:<40}{side['steps_per_s']:>9.3f}{side['median_step_s']:>17.3f}{side['tokens_per_step']:>13.1f}"
            f"{side['final_reward']:>14.3f}"
        )
    print(f"\nspeedup (steps/s, async / sync with the same cores each): {result['speedup']:.2f}   (target >= 1.5)")
    print(f"speedup over a synchronous run using every core:       {result['speedup_vs_all_cores']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
