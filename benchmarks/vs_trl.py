"""grpo-flow against TRL's GRPOTrainer on the same work, in one invocation.

    python -m benchmarks.vs_trl [--steps 8] [--hidden-size 384] [--layers 4] [--json FILE]

Same work means: the same initial weights (one randomly initialised Qwen2 model of at least
5M parameters, saved once and loaded by both sides with `from_pretrained`), the same
tokenizer, prompts (the `last_digit` training split), reward function, GRPO
hyperparameters (group size, prompts per step, completion length, temperature, learning
rate, loss type, beta) and number of steps, fp32 on CPU on both sides. Generated tokens
per step are counted on both sides and printed, so a difference in work shows.

Each side's first step is a warm-up and is left out of its median. grpo-flow's step time
is measured around each step (its `grpo-step` subflow call, or with `step_subflows` off the step in
the run's own flow run; grpo-flow runs both shapes), so it includes Prefect's orchestration;
its phases come from the run's Parquet metrics; TRL's phases come from timing wrappers put
on the trainer instance's `_generate`, `_calculate_rewards` and
`_generate_and_score_completions` methods.
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

WORK = {  # identical for both sides
    "num_generations": 8,
    "prompts_per_step": 8,
    "max_completion_length": 8,
    "temperature": 1.0,
    "top_p": 1.0,
    "learning_rate": 1e-4,
    "loss_type": "dapo",
    "beta": 0.0,
    "seed": 7,
}


def build_shared_model(folder: Path, hidden_size: int, layers: int) -> tuple[str, int]:
    from workers.data.tiny_model import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, hidden_size=hidden_size, layers=layers, seed=1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder), sum(p.numel() for p in model.parameters())


def timed_method(obj: Any, name: str, sink: list[float]) -> None:
    """Replace obj.name with a wrapper that appends each call's seconds to sink."""
    original = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - started)

    setattr(obj, name, wrapper)


def run_trl(model_path: str, steps: int, workdir: Path) -> dict[str, Any]:
    from transformers import TrainerCallback

    from benchmarks.trl_side import grpo_config, grpo_trainer
    from workers.data.loaders import load_task
    from workers.rewards.functions import last_digit

    completion_tokens: list[int] = []

    def counted_last_digit(completions: list, completion_ids: list, **kwargs: Any) -> list[float]:
        completion_tokens.append(sum(len(ids) for ids in completion_ids))
        return last_digit(completions=completions, **kwargs)

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.seconds.append(time.perf_counter() - self.started)

    task = load_task("last_digit")
    args = grpo_config(workdir / "trl", steps=steps, **WORK)
    timer = StepTimer()
    trainer = grpo_trainer(model_path, counted_last_digit, args, task.train, callbacks=[timer])
    phases: dict[str, list[float]] = {"generate": [], "score": [], "prepare": []}
    timed_method(trainer, "_generate", phases["generate"])
    timed_method(trainer, "_calculate_rewards", phases["score"])
    timed_method(trainer, "_generate_and_score_completions", phases["prepare"])
    trainer.train()
    steady = slice(1, None)
    generate = statistics.median(phases["generate"][steady])
    score = statistics.median(phases["score"][steady])
    prepare = statistics.median(phases["prepare"][steady])
    step = statistics.median(timer.seconds[steady])
    return {
        "step_s": step,
        "first_step_s": timer.seconds[0],
        "steps": len(timer.seconds),
        "tokens_per_step": statistics.mean(completion_tokens),
        "phases": {
            "generate": generate,
            "score": score,
            "other generation-side work (tokenize, logprobs, advantages)": prepare - generate - score,
            "train (loss, backward, optimizer) and loop": step - prepare,
        },
    }


def run_grpo_flow(model_path: str, steps: int, workdir: Path, step_subflows: bool = True) -> dict[str, Any]:
    from flows.grpo import grpo
    from schemas.config import GRPOFlowConfig
    from workers.state.storage import RunStorage

    config = GRPOFlowConfig(
        run_id="vs-trl" if step_subflows else "vs-trl-no-subflows",
        storage_root=str(workdir / "grpo-flow"),
        model=model_path,
        dataset="last_digit",
        reward_funcs=["last_digit"],
        max_steps=steps,
        lr_scheduler_type="constant",
        num_rollout_workers=1,
        save_steps=10**6,  # only the last step writes a checkpoint
        eval_prompts=0,
        bf16=False,
        step_subflows=step_subflows,
        **WORK,
    )
    summary = grpo(config)
    metrics = RunStorage(config.storage_root, config.run_id).read_metrics().to_pandas().iloc[1:]
    phase_columns = {
        "generate": "time/generate_s",
        "score": "time/score_s",
        "actor (TRL loss, backward, optimizer)": "time/actor_s",
        "sync weights": "time/sync_s",
    }
    phases = {name: float(metrics[col].fillna(0).median()) for name, col in phase_columns.items() if col in metrics}
    step = float(summary["median_step_seconds"])
    phases["logging + orchestration (the rest)"] = step - sum(phases.values())
    return {
        "step_s": step,
        "in_subflow_step_s": float(metrics["step_s"].median()),
        "steps": int(summary["steps_completed"]),
        "tokens_per_step": float((metrics["completions/mean_length"] * metrics["num_completions"]).mean()),
        "phases": phases,
    }


def print_report(params: int, hidden: int, layers: int, steps: int, trl: dict, ours: dict, flat: dict) -> None:
    ratio = ours["step_s"] / trl["step_s"]
    work = WORK
    print(
        f"\nSame work: Qwen2, {params / 1e6:.1f}M parameters (hidden {hidden}, {layers} layers), fp32 on CPU; "
        f"{work['prompts_per_step']} prompts x {work['num_generations']} generations = "
        f"{work['prompts_per_step'] * work['num_generations']} completions per step, at most "
        f"{work['max_completion_length']} new tokens, loss {work['loss_type']}, lr {work['learning_rate']}, "
        f"{steps} steps (first step left out of medians).\n"
    )
    print(f"{'side':<12}{'median step (s)':>17}{'tokens generated/step':>24}{'steps':>7}")
    print(f"{'TRL':<12}{trl['step_s']:>17.3f}{trl['tokens_per_step']:>24.1f}{trl['steps']:>7}")
    print(f"{'grpo-flow':<12}{ours['step_s']:>17.3f}{ours['tokens_per_step']:>24.1f}{ours['steps']:>7}")
    print(f"{'  no subflows':<12}{flat['step_s']:>17.3f}{flat['tokens_per_step']:>24.1f}{flat['steps']:>7}")
    print(
        f"\nratio grpo-flow / TRL: {ratio:.2f} with step subflows (target <= 1.2; inside its step subflow: "
        f"{ours['in_subflow_step_s']:.3f} s), {flat['step_s'] / trl['step_s']:.2f} without (target <= 1.0)"
    )
    for side, result in (("grpo-flow", ours), ("grpo-flow, step_subflows off", flat), ("TRL", trl)):
        print(f"\n{side} phases, median seconds per step:")
        for name, seconds in result["phases"].items():
            print(f"  {name:<58}{seconds:>8.3f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first step of each side is a warm-up)")

    with tempfile.TemporaryDirectory(prefix="grpo-flow-vs-trl-") as tmp:
        workdir = Path(tmp)
        model_path, params = build_shared_model(workdir / "model", args.hidden_size, args.layers)
        if params < 5_000_000:
            parser.error(f"the model has {params} parameters; the comparison needs at least 5M")
        trl = run_trl(model_path, args.steps, workdir)
        ours = run_grpo_flow(model_path, args.steps, workdir)
        flat = run_grpo_flow(model_path, args.steps, workdir, step_subflows=False)
    print_report(params, args.hidden_size, args.layers, args.steps, trl, ours, flat)
    result = {
        "grpo_flow_step_s": ours["step_s"],
        "trl_step_s": trl["step_s"],
        "ratio": ours["step_s"] / trl["step_s"],
        "grpo_flow_no_subflows_step_s": flat["step_s"],
        "ratio_no_subflows": flat["step_s"] / trl["step_s"],
        "parameters": params,
        "steps": args.steps,
        "work": WORK,
        "grpo_flow": ours,
        "grpo_flow_no_subflows": flat,
        "trl": trl,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
