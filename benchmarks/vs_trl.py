"""grpo-flow against TRL's GRPOTrainer on the same work, in one invocation.

    python -m grpo_flow.benchmarks.vs_trl [--steps 8] [--hidden-size 384] [--layers 4] [--json FILE]
    python -m grpo_flow.benchmarks.vs_trl --engine vllm [--steps 8] [...]

With `--engine vllm` both sides generate with vLLM as well: grpo-flow with
`rollout_engine="vllm"` (its engine in the vLLM environment, `grpo setup-vllm`), TRL with
`use_vllm=True, vllm_mode="colocate"` run inside the vLLM environment (TRL needs no Prefect, so
it can live there: `<vllm env>/bin/pip install trl==1.16.0`). Each side's transformers-engine
run is measured in the same invocation for reference. Where TRL's vLLM run fails, its error is
reported in place of its figures. Set-up is TRL's trainer construction (its colocated engine's
start included) and, for grpo-flow, the run's wall time outside its steps (Prefect's server, model
loads, engine starts).

Same work means: the same initial weights (one randomly initialised Qwen2 model of at least
5M parameters, saved once and loaded by both sides with `from_pretrained`), the same
tokenizer, prompts (the `last_digit` training split), reward function, GRPO
hyperparameters (group size, prompts per step, completion length, temperature, learning
rate, loss type, beta) and number of steps, fp32 on CPU on both sides, neither checkpointing
activations. Generated tokens per step are counted on both sides and printed, so a difference
in work shows.

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
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

# TRL's colocated vLLM, sized for a CPU (its KV cache through vLLM's own variable; no sleep mode there).
VLLM_COLOCATE = {
    "use_vllm": True,
    "vllm_mode": "colocate",
    "vllm_max_model_length": 64,  # the model's max_position_embeddings
    "vllm_gpu_memory_utilization": 0.1,
    "vllm_enable_sleep_mode": False,
}

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
    from grpo_flow.workers.data.tiny_model import build_model, build_tokenizer

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


def run_trl(
    model_path: str, steps: int, workdir: Path, use_vllm: bool = False, partial: dict[str, Any] | None = None
) -> dict[str, Any]:
    """TRL's side; `partial` receives what is measured before training starts (kept if training fails)."""
    from transformers import TrainerCallback

    from grpo_flow.benchmarks.trl_side import grpo_config, grpo_trainer
    from grpo_flow.workers.data.loaders import load_task
    from grpo_flow.workers.rewards.functions import last_digit

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

    # TRL calls transformers' renamed gradient-checkpointing methods (FutureWarning): TRL's to fix, not this report's.
    warnings.filterwarnings("ignore", message=".*is deprecated and will be removed in v6", category=FutureWarning)
    task = load_task("last_digit")
    args = grpo_config(workdir / "trl", steps=steps, **WORK, **(VLLM_COLOCATE if use_vllm else {}))
    timer = StepTimer()
    started = time.perf_counter()
    trainer = grpo_trainer(model_path, counted_last_digit, args, task.train, callbacks=[timer])
    start_s = time.perf_counter() - started  # with vLLM: the colocated engine's start
    if partial is not None:
        partial["start_s"] = start_s
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
        "start_s": start_s,
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


def run_grpo_flow(
    model_path: str, steps: int, workdir: Path, step_subflows: bool = True, rollout_engine: str = "transformers"
) -> dict[str, Any]:
    from grpo_flow.flows.grpo import grpo
    from grpo_flow.schemas.config import GRPOFlowConfig
    from grpo_flow.workers.state.storage import RunStorage

    config = GRPOFlowConfig(
        run_id=("vs-trl" if step_subflows else "vs-trl-no-subflows") + f"-{rollout_engine}",
        rollout_engine=rollout_engine,  # transformers unless --engine vllm (TRL's side matches it)
        vllm_max_model_length=64,  # the model's max_position_embeddings (vLLM refuses more)
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
    metrics_all = RunStorage(config.storage_root, config.run_id).read_metrics().to_pandas()
    metrics = metrics_all.iloc[1:]
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
        "wall_s": float(summary["wall_seconds"]),
        "first_step_s": float(metrics_all["step_s"].iloc[0]),
        # everything outside the steps: Prefect's server, model loads, engine starts (vLLM's included)
        "start_s": float(summary["wall_seconds"]) - float(metrics_all["step_s"].sum()),
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
        f"{steps} steps (first step left out of medians); both sides generate with transformers.\n"
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


def run_trl_in_vllm_env(model_path: str, steps: int, workdir: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer with colocated vLLM, in a process of the vLLM environment; its figures or its error."""
    import subprocess

    from grpo_flow.workers.backends.vllm_env import vllm_python

    python = vllm_python()
    if subprocess.run([python, "-c", "import trl"], capture_output=True).returncode != 0:
        return {"error": f"TRL is not installed in the vLLM environment: {python} -m pip install trl==1.16.0"}
    out = workdir / "trl-vllm.json"
    root = str(Path(__file__).resolve().parents[1])
    # vLLM's CPU build reserves its KV cache as a fraction of RAM unless told a size (GiB)
    env = {**os.environ, "PYTHONPATH": root, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    argv = [python, "-m", "grpo_flow.benchmarks.vs_trl", "--trl-side", model_path, str(out), "--steps", str(steps)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=root)
    if out.exists():
        return json.loads(out.read_text())
    lines = [line for line in (done.stderr or "").splitlines() if "Error" in line]
    return {"error": (lines[-1] if lines else f"exit {done.returncode}").replace("[rank0]: ", "")}


def print_engine_report(params: int, steps: int, sides: dict[str, dict[str, Any]]) -> None:
    work = WORK
    print(
        f"\nSame work with each engine: Qwen2 {params / 1e6:.1f}M parameters, fp32 training on CPU; "
        f"{work['prompts_per_step']} prompts x {work['num_generations']} generations, at most "
        f"{work['max_completion_length']} new tokens, {steps} steps (first step left out of medians).\n"
    )
    print(f"{'side':<26}{'median step (s)':>17}{'first step (s)':>16}{'set-up (s)':>11}{'tokens/step':>13}")
    for name, result in sides.items():
        if "error" in result:
            started = f" after a {result['start_s']:.1f} s start" if "start_s" in result else ""
            print(f"{name:<26}  failed{started}: {result['error']}")
            continue
        print(
            f"{name:<26}{result['step_s']:>17.3f}{result['first_step_s']:>16.1f}{result['start_s']:>11.1f}"
            f"{result['tokens_per_step']:>13.1f}"
        )
    ours, trl = sides["grpo-flow, vLLM"], sides["TRL, vLLM colocate"]
    print()
    if "error" not in trl:
        print(f"ratio grpo-flow / TRL, both with vLLM: {ours['step_s'] / trl['step_s']:.2f}")
    for with_vllm, plain in (
        ("grpo-flow, vLLM", "grpo-flow, transformers"),
        ("TRL, vLLM colocate", "TRL, transformers"),
    ):
        if "error" not in sides[with_vllm]:
            print(f"ratio {with_vllm} / {plain}: {sides[with_vllm]['step_s'] / sides[plain]['step_s']:.2f}")
    for name, result in sides.items():
        if "error" not in result:
            print(f"\n{name} phases, median seconds per step:")
            for phase, seconds in result["phases"].items():
                print(f"  {phase:<58}{seconds:>8.3f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    parser.add_argument("--trl-side", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_side:  # the TRL + vLLM side, run by run_trl_in_vllm_env inside the vLLM environment
        model_path, out = args.trl_side
        partial: dict[str, Any] = {}
        try:
            side = run_trl(model_path, args.steps, Path(out).parent, use_vllm=True, partial=partial)
        except Exception as error:  # reported in place of TRL's figures, with what was measured before it
            side = {"error": f"{type(error).__name__}: {error}", **partial}
        Path(out).write_text(json.dumps(side))
        return side
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first step of each side is a warm-up)")

    with tempfile.TemporaryDirectory(prefix="grpo-flow-vs-trl-") as tmp:
        workdir = Path(tmp)
        model_path, params = build_shared_model(workdir / "model", args.hidden_size, args.layers)
        if params < 5_000_000:
            parser.error(f"the model has {params} parameters; the comparison needs at least 5M")
        trl = run_trl(model_path, args.steps, workdir)
        ours = run_grpo_flow(model_path, args.steps, workdir)
        if args.engine == "vllm":
            sides = {
                "TRL, transformers": trl,
                "grpo-flow, transformers": ours,
                "TRL, vLLM colocate": run_trl_in_vllm_env(model_path, args.steps, workdir),
                "grpo-flow, vLLM": run_grpo_flow(model_path, args.steps, workdir, rollout_engine="vllm"),
            }
        else:
            flat = run_grpo_flow(model_path, args.steps, workdir, step_subflows=False)
    if args.engine == "vllm":
        print_engine_report(params, args.steps, sides)
        result = {"parameters": params, "steps": args.steps, "work": WORK, "sides": sides}
        if "error" not in sides["TRL, vLLM colocate"]:
            result["ratio_vllm"] = sides["grpo-flow, vLLM"]["step_s"] / sides["TRL, vLLM colocate"]["step_s"]
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return result
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
