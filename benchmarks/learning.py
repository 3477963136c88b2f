"""Learning, side by side with TRL: held-out accuracy against step and against seconds.

    python -m benchmarks.learning [--tasks last_digit reverse_digits digit_lookup smol_math] [--seeds 3]
        [--first-seed 0]
        [--sides trl grpo_flow [trl_resampled]] [--steps N] [--eval-every K] [--eval-prompts 200]
        [--json FILE] [--png FILE] [--storage-root DIR]

For each task, TRL's GRPOTrainer and grpo-flow start from the same model (the task's preset's: the
project's tiny model after the task's format warm start, or for `smol_math` SmolLM2-135M-Instruct,
fetched once and converted; made once under the storage root and loaded by both with
`from_pretrained`) and train with the task's preset: the same reward functions, learning rate
and schedule, prompts per step, generations, completion length, temperature, loss, beta and
number of steps, once per seed (seeds 0, 1, ...; each side gets the same seed). TRL is handed
the training prompts in the order grpo-flow's run with that seed visits them
(`grpo_flow.tasks.rollout.step_prompt_indices`) and told not to shuffle, so at every step both sides
train on the same prompts.

`smol_math` (preset `smol-math`) trains LoRA adapters: TRL gets the peft LoraConfig grpo-flow's actor
builds from the preset, its chat prompts are rendered by the model's template on both sides, and
the weight copies are the adapters, merged into the base weights for scoring.

The tool task (`digit_lookup`, preset `tiny-tools`) plays multi-turn episodes: TRL is given the
environment class (and tools) that grpo-flow's run resolves from the preset's paths, the same
`max_tool_calling_iterations` and the same token budget (`max_completion_length`, model and tool
tokens alike, on both sides), and its held-out accuracy is that of greedy episodes with the tool.
Prompts are compared by `prompt_id` (chat prompts are lists of messages).

Held-out accuracy is measured the same way for both: every `--eval-every` steps the policy's
weights are copied in memory (a TRL callback; a hook after each grpo-flow step), with the
clock paused, and after the runs every copy is scored by the project's own held-out code
(`grpo_flow.workers.rollout.heldout.heldout_accuracy`: greedy, the first `--eval-prompts` held-out
prompts, the task's 0/1 accuracy reward). Scoring after the runs matters: the scoring engine
seeds torch's global RNG, which TRL's sampling draws from.

Every run is a process of its own, the sides alternating seed by seed. Seconds are wall-clock
from the start of a side's run (model load included; the libraries imported and Prefect's
ephemeral server started beforehand, as a long-lived server would be) to the end of each step,
less the paused copies. Gain is final held-out accuracy minus the start model's; gain
per minute divides it by the run's wall time. Mean and spread (sample standard deviation)
over seeds, and every seed's curve, go to the JSON. `--json` merges into an existing file: other
tasks are kept, and runs of the same task and set-up (steps, evaluation, start model) are pooled
by seed, so a long benchmark can be split into invocations (one task, or a few seeds, each) and
plotted together. The benchmark also checks, from TRL's reward calls and grpo-flow's rollout log,
that every side trained on the planned prompts at every step, and lists the GRPOConfig options
(TRL's defaults included) that differ between TRL's side and the objective grpo-flow's actor builds.

What is left to differ is the sampled completions: TRL draws them from torch's global generator,
seeded once with the run's seed; grpo-flow seeds each generation call from (seed, step, shard).
The `trl_resampled` side measures what that alone does: TRL again, with the same prompts at every
step, but its sampling seeded with seed + 1000. Its distance from `trl` (same seed) is the yardstick
for the distance between `trl` and `grpo_flow`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import in_fresh_process

harness.quiet()  # before Prefect is first imported
import grpo_flow.flows  # noqa: E402,F401  Prefect's recorder batched before its server starts (flows/__init__.py)

# The task's preset, the steps and the evaluation interval each runs by default.
TASKS: dict[str, dict[str, Any]] = {
    "last_digit": {"preset": "tiny", "steps": 60, "eval_every": 5},
    "reverse_digits": {"preset": "reverse", "steps": 600, "eval_every": 25},
    # Multi-turn episodes with a tool: TRL's GRPOTrainer gets the same environment_factory (and tools).
    "digit_lookup": {"preset": "tiny-tools", "steps": 120, "eval_every": 10},
    # The real pretrained chat model with LoRA (its held-out split has 100 prompts).
    "smol_math": {"preset": "smol-math", "steps": 30, "eval_every": 5},
}
# The GRPO fields both sides are given (grpo-flow's names; benchmarks/trl_side.py maps them to TRL's).
SHARED_FIELDS = (
    "prompts_per_step",
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_p",
    "learning_rate",
    "lr_scheduler_type",
    "loss_type",
    "beta",
    "max_tool_calling_iterations",
)
# trl_resampled is the control: TRL with the same prompts, step by step, as `trl` and `grpo_flow` at that
# seed, but drawing its samples from another seed (seed + RESAMPLE_OFFSET). How far it lands from `trl`
# is how much the sampled completions alone change what is learned.
# grpo_flow_vllm and grpo_flow_vllm_bf16 sample with the vLLM engine, in float32 and in bfloat16 (the actor
# trains in float32 on both, TRL's importance-sampling correction on): what bf16 sampling costs in learning.
SIDES = ("trl", "grpo_flow", "trl_resampled", "grpo_flow_vllm", "grpo_flow_vllm_bf16")
MAIN_SIDES = ("trl", "grpo_flow")
VLLM_DTYPES = {"grpo_flow_vllm": "float32", "grpo_flow_vllm_bf16": "bfloat16"}
RESAMPLE_OFFSET = 1000
LABELS = {
    "trl": "TRL GRPOTrainer",
    "grpo_flow": "grpo-flow",
    "trl_resampled": "TRL, other sampling seed",
    "grpo_flow_vllm": "grpo-flow, vLLM fp32",
    "grpo_flow_vllm_bf16": "grpo-flow, vLLM bf16",
}
COLORS = {
    "trl": "tab:orange",
    "grpo_flow": "tab:blue",
    "trl_resampled": "tab:green",
    "grpo_flow_vllm": "tab:purple",
    "grpo_flow_vllm_bf16": "tab:red",
}
STYLES = {"trl": "-", "grpo_flow": "-", "trl_resampled": "--", "grpo_flow_vllm": "-", "grpo_flow_vllm_bf16": "-."}


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the whole machine has been busy, CPU seconds this process and its descendants used:
    Prefect's ephemeral server, a subprocess, included), from /proc/stat and psutil; None where there is
    no /proc/stat."""
    import psutil

    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle and iowait
    busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is already in user
    own = 0.0
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            own += times.user + times.system + times.children_user + times.children_system
    return busy, own


@contextlib.contextmanager
def other_cpu(run: SideRun) -> Iterator[None]:
    """Record in `run` the CPU seconds other processes used while the block ran."""
    before = cpu_seconds()
    try:
        yield
    finally:
        after = cpu_seconds()
        if before is not None and after is not None:
            run.other_cpu_s = max(0.0, (after[0] - before[0]) - (after[1] - before[1]))


class PausableClock:
    """Seconds since start, less the time spent inside `paused()` (copying weights for evaluation)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.paused_s = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.started - self.paused_s

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - began


@dataclass
class SideRun:
    """One side's run with one seed: weight copies by step (with the seconds at that step), and the
    mean training reward of every step."""

    seed: int
    snapshots: dict[int, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)
    prompts: list[list[str]] = field(default_factory=list)  # each step's distinct prompts, sorted
    wall_s: float = 0.0
    # CPU seconds other processes used while this run ran: well above zero, the machine was not quiet.
    other_cpu_s: float | None = None


def eval_steps(steps: int, every: int) -> list[int]:
    """Steps after which the policy is copied: every `every` steps, and the last step."""
    return sorted({*range(every, steps + 1, every), steps})


def clone(weights: dict[str, Any]) -> dict[str, Any]:
    return {name: tensor.detach().clone() for name, tensor in weights.items()}


def policy_copy(model: Any, lora: bool) -> dict[str, Any]:
    """A copy of the policy's weights for scoring later: with LoRA the adapters alone (a few MB, where
    a full copy of SmolLM2 is 540 MB per evaluation), merged by `LoraMerge` when scored."""
    if not lora:
        return clone(model.state_dict())
    from peft import get_peft_model_state_dict

    return clone(get_peft_model_state_dict(model))


class LoraMerge:
    """Full weights from an adapter copy: the preset's LoRA actor, its adapters set to the copy, merged
    by the actor's own `policy_state_dict` (what grpo-flow's rollout engines get)."""

    def __init__(self, config: Any, model_path: str) -> None:
        from grpo_flow.workers.actor.actor import Actor

        self.actor = Actor(config, model_path)
        self.actor.load()

    def __call__(self, adapter: dict[str, Any]) -> dict[str, Any]:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.actor.model, adapter)
        if result.unexpected_keys:
            raise ValueError(f"adapter keys the preset's LoRA model has no place for: {result.unexpected_keys[:3]}")
        return self.actor.policy_state_dict()


def planned_order(task: Any, seed: int, steps: int, prompts_per_step: int) -> list[int]:
    """Train rows in the order a grpo-flow run with `seed` visits them, one step's prompts after another."""
    from grpo_flow.tasks.rollout import step_prompt_indices

    size = len(task.train)
    return [i for step in range(1, steps + 1) for i in step_prompt_indices(seed, step, prompts_per_step, size)]


def planned_prompts(task: Any, seed: int, steps: int, prompts_per_step: int) -> list[list[str]]:
    """Each step's distinct prompts (by prompt_id: chat prompts are lists), sorted: what a side's observed
    prompts are checked against."""
    order = planned_order(task, seed, steps, prompts_per_step)
    prompts = task.train.select(order)["prompt_id"]
    return [sorted(set(prompts[i : i + prompts_per_step])) for i in range(0, len(order), prompts_per_step)]


def reward_funcs(task: Any) -> dict[str, Any]:
    from grpo_flow.workers.rewards.functions import resolve_reward_funcs

    return resolve_reward_funcs(task.default_rewards)


def run_trl(
    model_path: str,
    task: Any,
    work: dict[str, Any],
    steps: int,
    seed: int,
    at: list[int],
    workdir: Path,
    sampling_seed: int | None = None,
    peft_config: Any = None,
) -> SideRun:
    """TRL's GRPOTrainer on the prompts of grpo-flow's run with `seed`, in that order; its own seed (which
    its sampling draws from) is `sampling_seed`, `seed` unless given."""
    from transformers import TrainerCallback

    from benchmarks.trl_side import grpo_config, grpo_trainer

    run = SideRun(seed)
    per_call: list[float] = []

    def recorded(func: Any, first: bool) -> Any:
        # TRL calls each reward function once per step with the whole batch: its mean score, and the
        # step's prompts (from the first function), to be compared with grpo-flow's rollout log.
        @functools.wraps(func)
        def reward(**kwargs: Any) -> list[float]:
            scores = func(**kwargs)
            per_call.append(sum(scores) / len(scores))
            if first:
                run.prompts.append(sorted(set(kwargs["prompt_id"])))
            return scores

        return reward

    funcs = reward_funcs(task)
    tools = trl_tools(work)

    class CopyWeights(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step in at:
                seconds = clock.elapsed()
                with clock.paused():
                    run.snapshots[state.global_step] = (seconds, policy_copy(kwargs["model"], peft_config is not None))

    clock = PausableClock()
    args = grpo_config(
        workdir / f"trl-{task.name}-{seed}",
        steps=steps,
        seed=seed if sampling_seed is None else sampling_seed,
        shuffle_dataset=False,  # the prompts come in grpo-flow's order (planned_order)
        **{k: v for k, v in work.items() if k in SHARED_FIELDS},
    )
    dataset = task.train.select(planned_order(task, seed, steps, work["prompts_per_step"]))
    recorded_funcs = [recorded(f, i == 0) for i, f in enumerate(funcs.values())]
    with other_cpu(run):
        trainer = grpo_trainer(
            model_path, recorded_funcs, args, dataset, callbacks=[CopyWeights()], peft_config=peft_config, **tools
        )
        trainer.train()
    run.wall_s = clock.elapsed()
    # One mean per function per step: the step's total reward is their sum (weights 1, as both sides use).
    per_step = len(funcs)
    run.rewards = [sum(per_call[i : i + per_step]) for i in range(0, len(per_call), per_step)]
    return run


def trl_tools(work: dict[str, Any]) -> dict[str, Any]:
    """The preset's tools and environment factories as TRL's GRPOTrainer takes them (the objects grpo-flow's
    run resolves from the same paths); nothing for a task without tools."""
    from grpo_flow.workers.tools.toolbox import build_toolbox, trl_tool_arguments

    if not (work["tools"] or work["environment_factory"]):
        return {}
    return trl_tool_arguments(build_toolbox(work["tools"], work["environment_factory"], None))


def run_grpo_flow(
    model_path: str, preset: str, steps: int, seed: int, at: list[int], workdir: Path, vllm_dtype: str | None = None
) -> SideRun:
    from benchmarks.steps import StepClock
    from grpo_flow.flows.grpo import grpo
    from grpo_flow.schemas.presets import preset_config
    from grpo_flow.workers import backends
    from grpo_flow.workers.state.storage import RunStorage

    run = SideRun(seed)
    config = preset_config(
        preset,
        model=model_path,
        storage_root=str(workdir / "grpo-flow"),
        run_id=f"learning-{preset}-seed{seed}" + (f"-vllm-{vllm_dtype}" if vllm_dtype else ""),
        seed=seed,
        **({"rollout_engine": "vllm", "vllm_dtype": vllm_dtype} if vllm_dtype else {}),
        max_steps=steps,
        eval_prompts=0,  # evaluated here, from the copies, with the same code as TRL's copies
        save_steps=10**6,  # like TRL's side, no checkpoints but the one a run always ends with
    )

    def copy_weights(step_config: Any, plan: Any, step: int) -> None:
        if step in at:
            seconds = clock.elapsed()
            with clock.paused():
                actor = backends.run_workers(step_config).actor.server.actor  # the local backend's, in this process
                run.snapshots[step] = (seconds, policy_copy(actor.model, step_config.use_lora))

    clock = PausableClock()
    with other_cpu(run), StepClock(after_step=copy_weights).watch():
        summary = grpo(config)
    run.wall_s = clock.elapsed()
    if summary["status"] != "completed":
        raise RuntimeError(f"grpo-flow run {config.run_id}: {summary.get('error')}")
    storage = RunStorage(config.storage_root, config.run_id)
    run.rewards = [float(r) for r in storage.read_metrics().column("reward").to_pylist()]
    run.prompts = [
        sorted(set(storage.read_rollouts(step).column("prompt_id").to_pylist())) for step in range(1, steps + 1)
    ]
    return run


def side_run(
    side: str,
    task_name: str,
    model_path: str,
    preset: str,
    work: dict[str, Any],
    steps: int,
    seed: int,
    at: list[int],
    workdir: Path,
    peft_config: Any,
) -> dict[str, Any]:
    """One side's run with one seed, as SideRun's fields; benchmark_task runs each in a process of its own,
    so none inherits what the runs before it left behind. The libraries are imported, and for grpo-flow
    Prefect's server started, before the run's clock starts."""
    import trl  # noqa: F401

    from grpo_flow.flows.grpo import grpo  # noqa: F401
    from grpo_flow.workers.data.loaders import load_task

    # transformers' deprecation notices about TrainingArguments fields TRL sets: noise here.
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    if side.startswith("grpo_flow"):
        start_prefect()
        run = run_grpo_flow(model_path, preset, steps, seed, at, workdir, VLLM_DTYPES.get(side))
    else:
        resample = RESAMPLE_OFFSET if side == "trl_resampled" else 0
        run = run_trl(model_path, load_task(task_name), work, steps, seed, at, workdir, seed + resample, peft_config)
    return vars(run)


def start_prefect() -> None:
    """Prefect's ephemeral server starts with the first flow run of a process (seconds); started here so
    no run's clock counts it."""
    from prefect import flow

    @flow(name="learning-benchmark-start")
    def start() -> None:
        return None

    start()


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


# GRPOConfig options that differ between the two sides by design and do not touch what is learned:
# grpo-flow's actor counts its own steps (its scheduler is made for config.max_steps), logs its own
# metrics, and TRL gets the prompts in grpo-flow's order instead of shuffling them itself.
NOT_LEARNING = {"output_dir", "logging_dir", "logging_strategy", "disable_tqdm", "max_steps", "shuffle_dataset"}


def config_differences(config: Any, trl_args: Any) -> dict[str, list[str]]:
    """Every GRPOConfig option (TRL's defaults included) whose value differs between TRL's side and the
    GRPOConfig grpo-flow's actor builds TRL's objective from (workers/actor/trl_objective.grpo_args),
    but for NOT_LEARNING: what could make the two sides learn differently."""
    import dataclasses

    from grpo_flow.workers.actor.trl_objective import grpo_args

    with tempfile.TemporaryDirectory() as tmp:
        ours = grpo_args(config, tmp)
    differ = {}
    for option in dataclasses.fields(trl_args):
        if option.name in NOT_LEARNING:
            continue
        theirs, mine = getattr(trl_args, option.name), getattr(ours, option.name, None)
        if mine != theirs:
            differ[option.name] = [str(mine), str(theirs)]
    return differ


def benchmark_task(
    name: str,
    steps: int,
    every: int,
    seeds: list[int],
    sides: list[str],
    eval_prompts: int,
    storage_root: Path,
    workdir: Path,
) -> dict[str, Any]:
    """The sides' runs of one task, each seed's curve scored; `summarize` adds the figures."""
    from grpo_flow.schemas.presets import PRESETS, preset_config
    from grpo_flow.workers.data.loaders import load_task
    from grpo_flow.workers.data.models import ensure_builtin_model
    from grpo_flow.workers.rollout.episodes import EpisodeRunner
    from grpo_flow.workers.rollout.heldout import heldout_accuracy
    from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine

    preset = TASKS[name]["preset"]
    work = preset_config(preset).model_dump()
    model_path = str(ensure_builtin_model(storage_root, PRESETS[preset]["model"]))
    task = load_task(name)
    at = eval_steps(steps, every)
    config = preset_config(preset)
    peft_config = None
    if config.use_lora:
        from grpo_flow.workers.actor.trl_objective import lora_config

        peft_config = lora_config(config)  # the LoraConfig grpo-flow's actor builds from the preset
    runs: dict[str, list[SideRun]] = {side: [] for side in sides}
    for seed in seeds:  # the sides alternate, so a slower minute of the machine hits each
        for side in sides:
            print(f"[{name}] seed {seed}: {LABELS[side]} ...", flush=True)
            args = (side, name, model_path, preset, work, steps, seed, at, workdir, peft_config)
            runs[side].append(SideRun(**in_fresh_process(side_run, *args)))

    engine = TransformersRolloutEngine(model_path)
    engine.load()
    merged: Any = LoraMerge(config, model_path) if config.use_lora else (lambda weights: weights)
    episodes = EpisodeRunner.from_config(config, model_path) if config.tools or config.environment_factory else None

    def accuracy() -> float:
        return heldout_accuracy(
            engine, task, eval_prompts, work["max_completion_length"], work["max_prompt_length"], episodes=episodes
        )

    start = accuracy()
    result: dict[str, Any] = {
        "preset": preset,
        "steps": steps,
        "eval_every": every,
        "eval_prompts": min(eval_prompts, len(task.heldout)),
        "start_model_sha256": hashlib.sha256((Path(model_path) / "model.safetensors").read_bytes()).hexdigest(),
        "start_accuracy": start,
        "work": {k: work[k] for k in SHARED_FIELDS},
        "config_differences": config_differences(preset_config(preset), trl_args_for(work, steps)),
        "runs": {},
    }
    for side, side_runs in runs.items():
        result["runs"][side] = []
        for run in side_runs:
            curve = [[0, 0.0, start]]
            for step in sorted(run.snapshots):
                seconds, weights = run.snapshots[step]
                engine.load_state_dict(merged(weights), step)
                curve.append([step, seconds, accuracy()])
            planned = planned_prompts(task, run.seed, steps, work["prompts_per_step"])
            result["runs"][side].append(
                {
                    "seed": run.seed,
                    "sampling_seed": run.seed + (RESAMPLE_OFFSET if side == "trl_resampled" else 0),
                    "wall_s": run.wall_s,
                    "curve": curve,
                    "train_reward": run.rewards,
                    "prompts_as_planned": run.prompts == planned,
                    "other_cpu_s": run.other_cpu_s,
                }
            )
    return summarize(result)


# What must match for runs of two invocations to be pooled as seeds of one experiment.
SETUP_KEYS = ("preset", "steps", "eval_every", "eval_prompts", "start_model_sha256", "work")


def merge(earlier: dict[str, Any] | None, result: dict[str, Any]) -> dict[str, Any]:
    """An earlier invocation's runs of the same set-up join this one's, side by side and seed by seed (a
    seed run again replaces its earlier run), so a long benchmark can be split into several; another
    set-up is replaced."""
    if earlier is None or any(earlier.get(k) != result[k] for k in SETUP_KEYS):
        return result
    merged = dict(result, runs={})
    for side in SIDES:
        by_seed = {r["seed"]: r for r in earlier.get("runs", {}).get(side, [])}
        by_seed |= {r["seed"]: r for r in result["runs"].get(side, [])}
        if by_seed:
            merged["runs"][side] = [by_seed[seed] for seed in sorted(by_seed)]
    return summarize(merged)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Per side, over seeds: final held-out accuracy, gain over the start model, wall time, gain per minute;
    and per seed, how far apart the sides' final accuracies are."""
    start = result["start_accuracy"]
    runs = result["runs"]
    result["seeds"] = sorted({r["seed"] for side_runs in runs.values() for r in side_runs})
    for side, side_runs in runs.items():
        finals = [r["curve"][-1][2] for r in side_runs]
        walls = [r["wall_s"] for r in side_runs]
        gains = [f - start for f in finals]
        per_minute = [g / (w / 60) for g, w in zip(gains, walls, strict=True)]
        for key, values in (("final", finals), ("gain", gains), ("wall_s", walls), ("gain_per_min", per_minute)):
            result[f"{side}_{key}"], result[f"{side}_{key}_sd"] = mean_sd(values)
        result[f"{side}_final_min"], result[f"{side}_final_max"] = min(finals), max(finals)
    result["same_prompts_every_step"] = all(r["prompts_as_planned"] for side_runs in runs.values() for r in side_runs)
    finals = {side: {r["seed"]: r["curve"][-1][2] for r in side_runs} for side, side_runs in runs.items()}
    for other in ("grpo_flow", "trl_resampled"):
        shared = sorted(set(finals.get("trl", {})) & set(finals.get(other, {})))
        if shared:
            # The mean over seeds of |final(trl) - final(other)|, same seed, same prompts.
            gaps = [abs(finals["trl"][seed] - finals[other][seed]) for seed in shared]
            result[f"trl_vs_{other}_final_gap"] = statistics.mean(gaps)
    return result


def trl_args_for(work: dict[str, Any], steps: int) -> Any:
    from benchmarks.trl_side import grpo_config

    with tempfile.TemporaryDirectory() as tmp:
        shared = {k: v for k, v in work.items() if k in SHARED_FIELDS}
        return grpo_config(tmp, steps=steps, seed=work["seed"], shuffle_dataset=False, **shared)


def training_reward(result: dict[str, Any], side: str, part: slice) -> float:
    """Mean training reward over a slice of the steps, averaged over seeds."""
    return statistics.mean(statistics.mean(r["train_reward"][part]) for r in result["runs"][side])


def side_name(side: str) -> str:
    return {"trl": "TRL", "grpo_flow": "grpo-flow", "trl_resampled": "TRL resampled"}.get(side, LABELS[side])


def print_report(name: str, result: dict[str, Any]) -> None:
    sides = [side for side in SIDES if side in result["runs"]]
    print(
        f"\n{name}: preset {result['preset']}, {result['steps']} steps, seeds {result['seeds']}; held-out "
        f"accuracy (greedy, {result['eval_prompts']} prompts) of the start model {result['start_accuracy']:.3f}"
    )
    print(f"{'side':<22}{'seeds':>6}{'final':>16}{'gain':>16}{'wall s':>16}{'gain/min':>10}{'final min-max':>15}")
    for side in sides:
        cells = [f"{result[f'{side}_{k}']:.3f} ± {result[f'{side}_{k}_sd']:.3f}" for k in ("final", "gain")]
        cells.append(f"{result[f'{side}_wall_s']:.1f} ± {result[f'{side}_wall_s_sd']:.1f}")
        span = f"{result[f'{side}_final_min']:.3f}-{result[f'{side}_final_max']:.3f}"
        print(
            f"{side_name(side):<22}{len(result['runs'][side]):>6}"
            + "".join(f"{c:>16}" for c in cells)
            + f"{result[f'{side}_gain_per_min']:>10.3f}{span:>15}"
        )
    if all(side in sides for side in MAIN_SIDES):
        ratio = {
            k: result[f"grpo_flow_{k}"] / result[f"trl_{k}"] if result[f"trl_{k}"] else float("nan")
            for k in ("gain", "wall_s", "gain_per_min")
        }
        print(
            f"grpo-flow / TRL: gain {ratio['gain']:.2f}, wall time {ratio['wall_s']:.2f}, "
            f"gain per minute {ratio['gain_per_min']:.2f}"
        )
    for other in ("grpo_flow", "trl_resampled"):
        if f"trl_vs_{other}_final_gap" in result:
            print(
                f"mean |final accuracy of TRL - of {side_name(other)}|, same seed and prompts: "
                f"{result[f'trl_vs_{other}_final_gap']:.3f}"
            )
    tenth = max(1, result["steps"] // 10)
    for label, part in (("first", slice(0, tenth)), ("last", slice(-tenth, None))):
        rewards = ", ".join(f"{side_name(side)} {training_reward(result, side, part):.3f}" for side in sides)
        print(f"mean training reward, {label} {tenth} steps: {rewards}")
    others = [r["other_cpu_s"] for side in sides for r in result["runs"][side] if r.get("other_cpu_s") is not None]
    if others:
        print(f"CPU seconds other processes used during a run: at most {max(others):.1f}")
    print(f"same prompts on every side at every step: {'yes' if result['same_prompts_every_step'] else 'NO'}")
    differences = result["config_differences"]
    print(f"GRPOConfig options that differ (grpo-flow's objective, TRL's side): {differences or 'none'}")


def plot(results: dict[str, Any], path: Path) -> None:
    """Held-out accuracy against step (left) and seconds (right), one row per task: each seed thin,
    the mean over seeds bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name, result in results.items() if isinstance(result, dict) and "runs" in result]  # tasks
    figure, axes = plt.subplots(len(names), 2, figsize=(10, 3.4 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        result = results[name]
        for side in [side for side in SIDES if side in result["runs"]]:
            curves = [run["curve"] for run in result["runs"][side]]
            for column, x in ((0, 0), (1, 1)):
                axis = axes[row][column]
                for curve in curves:
                    xs, ys = [p[x] for p in curve], [p[2] for p in curve]
                    axis.plot(xs, ys, color=COLORS[side], ls=STYLES[side], alpha=0.3, lw=0.8)
                mean_x = [statistics.mean(c[i][x] for c in curves) for i in range(len(curves[0]))]
                mean_y = [statistics.mean(c[i][2] for c in curves) for i in range(len(curves[0]))]
                label = f"{LABELS[side]} (mean of {len(curves)})"
                axis.plot(mean_x, mean_y, color=COLORS[side], ls=STYLES[side], lw=2, label=label)
        for column, label in ((0, "step"), (1, "seconds (wall clock)")):
            axis = axes[row][column]
            axis.set_xlabel(label)
            axis.set_ylabel("held-out accuracy")
            axis.set_title(f"{name} ({result['preset']} preset)")
            axis.grid(alpha=0.3)
            axis.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), help=f"any of: {', '.join(TASKS)}")
    parser.add_argument("--seeds", type=int, default=3, help="runs per side: seeds F .. F+N-1 (F: --first-seed)")
    parser.add_argument("--first-seed", type=int, default=0, help="first seed (to split the seeds over invocations)")
    parser.add_argument(
        "--sides",
        nargs="+",
        default=list(MAIN_SIDES),
        help=f"any of: {', '.join(SIDES)} (trl_resampled: TRL with the same prompts, sampling from seed + "
        f"{RESAMPLE_OFFSET}, the control for what sampling alone changes)",
    )
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the task's, see TASKS)")
    parser.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations")
    parser.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts per evaluation")
    parser.add_argument("--png", type=Path, default=None, help="plot every task in the JSON (or this run) here")
    parser.add_argument(
        "--storage-root",
        type=Path,
        default=None,
        help="where the models are found or made (models/: the tiny ones built, smollm2-135m fetched and "
        "converted); default: a fresh temporary folder",
    )


def check(args: argparse.Namespace) -> str | None:
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        return f"--tasks: unknown task {unknown[0]!r}; known: {', '.join(TASKS)}"
    unknown = [side for side in args.sides if side not in SIDES]
    if unknown:
        return f"--sides: unknown side {unknown[0]!r}; known: {', '.join(SIDES)}"
    if args.first_seed < 0:
        return f"--first-seed: must be 0 or more, got {args.first_seed}"
    for option in ("seeds", "steps", "eval_every", "eval_prompts"):
        value = getattr(args, option)
        if value is not None and value < 1:
            return f"--{option.replace('_', '-')}: must be at least 1, got {value}"
    return None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """This invocation's tasks, merged into the earlier figures of `--json` (other tasks kept)."""
    # transformers' deprecation notices about TrainingArguments fields TRL sets, once per run: noise here.
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is experimental in TRL 1.16
    everything: dict[str, Any] = json.loads(args.json.read_text()) if args.json and args.json.exists() else {}
    with tempfile.TemporaryDirectory(prefix="grpo-flow-learning-") as tmp:
        workdir = Path(tmp)
        storage_root = args.storage_root or workdir / "storage"
        for name in args.tasks:
            steps = args.steps or TASKS[name]["steps"]
            every = min(args.eval_every or TASKS[name]["eval_every"], steps)
            seeds = list(range(args.first_seed, args.first_seed + args.seeds))
            sides = [side for side in SIDES if side in args.sides]
            result = benchmark_task(name, steps, every, seeds, sides, args.eval_prompts, storage_root, workdir)
            everything[name] = merge(everything.get(name), result)
    return everything


def report(everything: dict[str, Any], args: argparse.Namespace) -> None:
    for name in args.tasks:
        print_report(name, everything[name])
    if args.png:
        plot(everything, args.png)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return harness.main(__doc__, measure, report, argv, options=options, check=check)


if __name__ == "__main__":
    main()
