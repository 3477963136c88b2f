"""Peak resident memory of the actor process for one step, CPU, with and without gradient
checkpointing, each measurement in a fresh process.

    python -m benchmarks.memory [--models tiny,qwen0.5b] [--rows 8] [--prompt-tokens 64]
                         [--completion-tokens 32] [--json FILE]
    python -m benchmarks.memory --models smollm2-135m [--storage-root DIR] [--json FILE]
    python -m benchmarks.memory --models smollm2-135m --completions 32,64,128,256
    python -m benchmarks.memory --models smollm2-135m --vllm-step 64x4
    python -m benchmarks.memory --models smollm2-135m --actor-processes 1,2

Models:
- `tiny`: the tiny preset's model (the built one under the default storage root or
  `--tiny-model`, else the same architecture randomly initialised) on the tiny preset's own
  batch shape: 32 prompts x 8 generations of ~7 prompt and 2 completion tokens.
- `qwen0.5b`: a randomly initialised model of Qwen2.5-0.5B's shape (transformers' Qwen2Config
  with its published sizes: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864,
  vocab 151936, tied embeddings; 494M parameters), saved once to a temporary folder by its own
  process; a batch of `--rows` completions of `--completion-tokens` tokens after prompts of
  `--prompt-tokens` tokens, random token ids.
- `smollm2-135m`: the real pretrained model (SmolLM2-135M-Instruct, `resolve_model_path`: fetched once
  and converted under `--storage-root`) with the smol-math preset's actor (LoRA r16 on q/k/v/o and
  the MLP projections, AdamW over the adapters only) on the preset's batch: 4 prompts x 8
  completions of 16 tokens after prompts as long as smol_math's longest chat-rendered prompt. Beside
  the actor step, one smol-math step through the `grpo` flow in a fresh process (`run`): the flow's
  process then holds the actor, the transformers rollout engine's own copy of the weights and Prefect's
  client (the ephemeral Prefect server is a process of its own and not counted).

With `--completions`, the smol-math actor step at each of those numbers of completions per step instead,
with the default micro-batch budget, and beside each peak the estimate `grpo train` states before
loading (workers/actor/memory.py; the actor's part, as the rollout engine is not in the process).

With `--vllm-step PxG`, `grpo train --preset smol-math --rollout-engine vllm` for two steps of P prompts x G
completions instead, as a user runs it: the peak of the whole process tree's resident memory (the flow's
process with the actor, the vLLM engine's process and the Prefect server), sampled twice a second.

With `--actor-processes 1,2`, smol-math's step as a full fine-tune (no LoRA) under each number of actor ranks
instead: N = 1 is the one-process actor; N > 1 the ranks `actor_num_processes` starts (FSDP2 over gloo), each
one's peak read when the group has ended (`RUSAGE_CHILDREN`: the largest of the reaped ranks'). Beside each
peak, the parameters, gradients and AdamW states a rank holds: FSDP2 shards each tensor evenly over the ranks,
so 16 bytes a parameter over N. Target (issue 37): the per-rank peak at N = 2 within 0.6 x the one process's.
`--max-tokens-per-microbatch` sets both sides' micro-batch budget. glibc keeps freed blocks under its mmap
threshold in a fragmented heap, which FSDP2's per-layer gathers leave a rank with; run it under
`MALLOC_MMAP_THRESHOLD_=1048576` to measure what the ranks hold rather than the heap (docs/benchmarks.md).

Each measurement is a fresh Python process that loads the project's `Actor` (fp32, AdamW from
TRL's trainer, TRL's loss) from the folder, as the local backend does, and applies one step
(`Actor.step`) to a rollouts table; it reports `ru_maxrss` before and after the step. The peak
is the process's whole life: import, load, forward, backward and the optimizer's first step,
which allocates AdamW's two moments: with weights and gradients that is 16 bytes a parameter
(7.4 GiB at 0.5B), so with short completions the optimizer step sets the peak and gradient
checkpointing (which saves activations) changes little; longer completions
(`--completion-tokens 512`) show what it saves. Target (issue 8): the 0.5B-shape step fits in
16 GiB.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import REAL_MODEL
from benchmarks.steps import default_tiny_model, save_random_model

QWEN_05B_SHAPE = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
GIB = 1024**3
MODELS = ("tiny", "qwen0.5b", REAL_MODEL)
LIMIT_GIB = 16


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def supports_gradient_checkpointing() -> bool:
    from grpo_flow.schemas.config import GRPOFlowConfig

    return "gradient_checkpointing" in GRPOFlowConfig.model_fields


def rollouts_table(rows: int, prompt_tokens: int, completion_tokens: int, vocab: int, seed: int = 0) -> Any:
    """A step's logged rows as the actor reads them (the columns `Actor.step` uses)."""
    import pyarrow as pa
    import torch

    generator = torch.Generator().manual_seed(seed)
    high = min(vocab, 256)  # byte tokens: valid for the tiny tokenizer and any larger vocabulary
    prompt = torch.randint(0, high, (rows, prompt_tokens), generator=generator).tolist()
    completion = torch.randint(0, high, (rows, completion_tokens), generator=generator).tolist()
    return pa.table(
        {
            "prompt_token_ids": prompt,
            "completion_token_ids": completion,
            "sampling_logprobs": [[-2.0] * completion_tokens for _ in range(rows)],
            "advantage": torch.randn(rows, generator=generator).tolist(),
            "finish_reason": ["length"] * rows,
            "policy_version": [0] * rows,
        }
    )


def measure_step(
    model_path: str, rows: int, prompt_tokens: int, completion_tokens: int, checkpointing: bool, preset: str = "tiny"
) -> dict[str, Any]:
    import torch

    from grpo_flow.schemas.presets import preset_config
    from grpo_flow.workers.actor.actor import Actor

    started = time.perf_counter()
    overrides: dict[str, Any] = {
        "model": model_path,
        "run_id": "memory",
        "max_completion_length": completion_tokens,
        "max_prompt_length": prompt_tokens,
    }
    if preset == "tiny":  # the tiny preset's model on other shapes: a small step (smol-math: the preset's own)
        overrides["learning_rate"] = 1e-6
    if supports_gradient_checkpointing():
        overrides["gradient_checkpointing"] = checkpointing
    elif checkpointing:
        return {"skipped": "this grpo-flow has no gradient_checkpointing config field"}
    actor = Actor(preset_config(preset, **overrides), model_path)
    actor.load()
    actor.sampling_matches_actor = True  # as the local backend's fp32 engine: no IS correction pass
    before_step = peak_rss_bytes()  # weights loaded (safetensors pages are mapped in as they are first read)
    parameters = sum(p.numel() for n, p in actor.model.named_parameters() if "lora_" not in n)
    trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
    table = rollouts_table(rows, prompt_tokens, completion_tokens, actor.model.config.vocab_size)
    step_started = time.perf_counter()
    metrics = actor.step(0, table)
    step_s = time.perf_counter() - step_started
    return {
        "parameters": parameters,
        "trainable_parameters": trainable,
        "rows": rows,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "gradient_checkpointing": bool(checkpointing),
        "gradient_checkpointing_on": bool(
            getattr(actor.model, "is_activation_checkpointing", None)
            or getattr(actor.model, "is_gradient_checkpointing", False)
        ),
        "threads": torch.get_num_threads(),
        "peak_before_step_bytes": before_step,
        "peak_bytes": peak_rss_bytes(),
        "micro_batches": metrics["actor/micro_batches"],
        "max_tokens_per_microbatch": metrics["actor/max_tokens_per_microbatch"],
        "estimate_bytes": actor_estimate(actor.config),
        "step_s": step_s,
        "process_s": time.perf_counter() - started,
        "loss": metrics["loss"],
    }


def actor_estimate(config: Any) -> int:
    """workers/actor/memory.py's estimate of the actor's part of a step (the rollout engine is not in this
    process): what `grpo train` states before loading, less the engine."""
    from grpo_flow.workers.actor import memory

    info = memory.read_model_info(config.model, config.storage_root)
    if info is None:
        raise RuntimeError(f"{config.model}: no config.json to estimate from")
    parts = memory.estimate_step_memory(config, info, memory.machine_memory()[0])
    return parts["total"] - parts["engine"]


def measure_run(model_path: str, workdir: str) -> dict[str, Any]:
    """One smol-math step through the `grpo` flow (transformers engine), as `grpo train --preset smol-math
    --max-steps 1` runs it: the flow process's peak, with the actor and the rollout engine in it."""
    from grpo_flow.flows.grpo import grpo
    from grpo_flow.schemas.presets import preset_config

    started = time.perf_counter()
    config = preset_config(
        "smol-math", model=model_path, storage_root=workdir, run_id="memory-run", max_steps=1, eval_prompts=0
    )
    summary = grpo(config)
    if summary.get("status") != "completed":
        raise RuntimeError(f"the smol-math run did not complete: {summary.get('error')}")
    return {"peak_bytes": peak_rss_bytes(), "process_s": time.perf_counter() - started, "steps": 1}


def peak_rss_of(pid: int) -> int:
    """A process's peak resident memory so far (Linux: VmHWM)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


def measure_ranks(
    model_path: str, processes: int, rows: int, prompt_tokens: int, completion_tokens: int, microbatch_tokens: int
) -> dict[str, Any]:
    """smol-math's step as a full fine-tune by `processes` actor ranks (1: the one-process actor, in this
    process); the largest rank's peak resident memory once loaded and sharded, and after the step."""
    from transformers import AutoConfig

    from grpo_flow.schemas.presets import preset_config
    from grpo_flow.workers.actor.actor import Actor
    from grpo_flow.workers.actor.sharded import ActorGroup

    config = preset_config(
        "smol-math",
        model=model_path,
        run_id="memory-ranks",
        use_lora=False,
        actor_num_processes=processes,
        max_completion_length=completion_tokens,
        max_prompt_length=prompt_tokens,
        num_generations=rows // preset_config("smol-math").prompts_per_step,
        max_tokens_per_microbatch=microbatch_tokens or None,
    )
    actor = Actor(config, model_path) if processes == 1 else ActorGroup(config, model_path)
    started = time.perf_counter()
    actor.load()
    pids = [process.pid for process in actor.processes] if isinstance(actor, ActorGroup) else [os.getpid()]
    loaded = max(peak_rss_of(pid) for pid in pids)
    table = rollouts_table(rows, prompt_tokens, completion_tokens, AutoConfig.from_pretrained(model_path).vocab_size)
    metrics = actor.step(0, table)
    peak = max(peak_rss_of(pid) for pid in pids)
    step_s = time.perf_counter() - started
    if isinstance(actor, ActorGroup):
        actor.close()
    from safetensors import safe_open

    with safe_open(str(Path(model_path) / "model.safetensors"), "pt") as weights:
        parameters = sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    return {
        "processes": processes,
        "rows": rows,
        "parameters": parameters,
        "states_bytes_per_rank": 16 * parameters // processes,  # fp32 weights and gradients, AdamW's two moments
        "micro_batches": metrics["actor/micro_batches"],
        "max_tokens_per_microbatch": metrics["actor/max_tokens_per_microbatch"],
        "loaded_peak_bytes": loaded,
        "peak_bytes": peak,
        "process_s": step_s,
        "loss": metrics["loss"],
    }


def build_qwen_shape(path: str) -> dict[str, Any]:
    """Qwen2.5-0.5B's shape with random weights (token ids are random anyway), saved to `path`."""
    return {"parameters": save_random_model(Path(path), shape=QWEN_05B_SHAPE, seed=0)}


def tree_rss_bytes(process: Any) -> int:
    """Resident memory of a process and all its descendants (psutil), those that exit meanwhile left out."""
    import psutil

    total = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            total += member.memory_info().rss
        except psutil.Error:
            pass
    return total


def vllm_step(storage_root: str, prompts: int, generations: int, timeout: float) -> dict[str, Any]:
    """Two smol-math steps of `prompts` x `generations` with the vLLM engine through `grpo train`; the process
    tree's peak resident memory, sampled twice a second."""
    import psutil

    argv = ["train", "--preset", "smol-math", "--rollout-engine", "vllm", "--max-steps", "2", "--eval-prompts", "0"]
    argv += ["--prompts-per-step", str(prompts), "--num-generations", str(generations), "--no-progress"]
    run_id = f"memory-{prompts}x{generations}-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="grpo-flow-vllm-step-") as runs:
        argv += ["--storage-root", storage_root, "--run-id", run_id]
        started, peak = time.perf_counter(), 0
        child = subprocess.Popen(
            [sys.executable, "-m", "grpo_flow", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **harness.QUIET_ENV, "PREFECT_HOME": runs},
        )
        tree = psutil.Process(child.pid)
        while child.poll() is None and time.perf_counter() - started < timeout:
            peak = max(peak, tree_rss_bytes(tree))
            time.sleep(0.5)
        if child.poll() is None:
            child.kill()
        output = child.communicate()[0]
    # The run is a measurement, not the user's: it leaves nothing among their runs (the model stays cached).
    shutil.rmtree(Path(storage_root) / "runs" / run_id, ignore_errors=True)
    result = {"prompts": prompts, "generations": generations, "peak_bytes": peak}
    result |= {"process_s": time.perf_counter() - started, "exit_status": child.returncode}
    if child.returncode != 0:
        result["error"] = output.strip()[-2000:]
    return result


def real_model_shape(model_path: str) -> tuple[int, int, int]:
    """The smol-math preset's step (rows, prompt tokens, completion tokens): 4 prompts x 8 completions of 16
    tokens after smol_math's longest chat-rendered prompt."""
    from transformers import AutoTokenizer

    from grpo_flow.schemas.presets import preset_config
    from grpo_flow.workers.data.loaders import load_task

    config = preset_config("smol-math")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = load_task(config.dataset).train["prompt"]
    longest = max(
        len(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
        for p in prompts
    )
    return config.prompts_per_step * config.num_generations, longest, config.max_completion_length


def completions_sweep(path: str, counts: list[int], timeout: float) -> dict[str, Any]:
    """The smol-math preset's actor step (LoRA, the default micro-batch budget) at each number of completions
    per step, each in a fresh process: the peak flattens once a step is more than one micro-batch."""
    _, prompt_tokens, completion_tokens = real_model_shape(path)
    return {
        str(count): harness.side_or_error(
            measure_step, path, count, prompt_tokens, completion_tokens, False, "smol-math", timeout=timeout
        )
        for count in counts
    }


def actor_ranks(path: str, counts: list[int], microbatch_tokens: int, timeout: float) -> dict[str, Any]:
    """smol-math's step as a full fine-tune under each number of actor ranks, each in a fresh process."""
    shape = real_model_shape(path)
    return {
        str(count): harness.side_or_error(measure_ranks, path, count, *shape, microbatch_tokens, timeout=timeout)
        for count in counts
    }


def tiny_model(workdir: Path, given: str | None) -> str:
    model = given or default_tiny_model()
    if model is None:
        model = str(workdir / "tiny-architecture")
        save_random_model(Path(model))
    return model


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models", default="tiny,qwen0.5b", help=f"comma-separated: {', '.join(MODELS)} (default: tiny,qwen0.5b)"
    )
    harness.storage_root_option(parser)
    parser.add_argument("--rows", type=int, default=8, help="qwen0.5b: completions in the step (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="qwen0.5b: prompt tokens per row (default 64)")
    parser.add_argument("--completion-tokens", type=int, default=32, help="qwen0.5b: completion tokens (default 32)")
    parser.add_argument("--tiny-model", default=None, help="the tiny preset's built model folder")
    parser.add_argument(
        "--completions",
        default="",
        help=f"{REAL_MODEL} only: instead of the preset's step with and without gradient checkpointing and the "
        "flow's step, its actor step at each of these numbers of completions per step (e.g. 32,64,128,256)",
    )
    parser.add_argument(
        "--vllm-step",
        default="",
        help=f"{REAL_MODEL} only: instead, two smol-math steps of PxG (e.g. 64x4) with the vLLM engine through "
        "grpo train, the whole process tree's peak",
    )
    parser.add_argument(
        "--actor-processes",
        default="",
        help=f"{REAL_MODEL} only: instead, smol-math's step as a full fine-tune under each of these numbers of "
        "actor ranks (e.g. 1,2), the peak of a rank",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed each measurement's process")
    parser.add_argument(
        "--max-tokens-per-microbatch",
        dest="microbatch_tokens",
        type=int,
        default=0,
        help="with --actor-processes: the micro-batch budget of every side (default: the config's default)",
    )


def check(args: argparse.Namespace) -> str | None:
    unknown = set(models_of(args)) - set(MODELS)
    if unknown:
        return f"--models: unknown {sorted(unknown)}; known: {', '.join(MODELS)}"
    if args.vllm_step and not re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", args.vllm_step):
        return f"--vllm-step: {args.vllm_step!r} is not PROMPTSxGENERATIONS, e.g. 64x4"
    if args.actor_processes and not re.fullmatch(r"[1-9][0-9]*(,[1-9][0-9]*)*", args.actor_processes):
        return f"--actor-processes: {args.actor_processes!r} is not a list of rank counts, e.g. 1,2"
    return None


def models_of(args: argparse.Namespace) -> list[str]:
    return [m.strip() for m in args.models.split(",") if m.strip()]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"gradient_checkpointing_supported": supports_gradient_checkpointing(), "models": {}}
    with tempfile.TemporaryDirectory(prefix="grpo-flow-memory-") as tmp:
        for name in models_of(args):
            results["models"][name] = measure_model(name, args, Path(tmp))
    qwen = results["models"].get("qwen0.5b", {})
    peaks = [r["peak_bytes"] for k, r in qwen.items() if k.endswith("_gc") and "peak_bytes" in r]
    results["qwen05b_fits_16gib"] = bool(peaks) and max(peaks) < LIMIT_GIB * GIB
    for name, entry in results["models"].items():
        for key in ("without_gc", "with_gc", "run"):
            if "peak_bytes" in entry.get(key, {}):
                results[f"{name}_{key}_peak_gib"] = entry[key]["peak_bytes"] / GIB
    return results


def measure_model(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One model's steps without and with gradient checkpointing, each in a fresh process (and for the real
    model, the flow's step; or with --completions, the sweep instead)."""
    built: dict[str, Any] = {}
    preset = "tiny"
    if name == "tiny":
        path = tiny_model(workdir, args.tiny_model)
        shape = (256, 7, 2)  # 32 x 8, `35060=` + 2
    elif name == REAL_MODEL:
        path = harness.real_model_path(args)
        if args.completions:
            return {"completions": completions_sweep(path, [int(c) for c in args.completions.split(",")], args.timeout)}
        if args.vllm_step:
            prompts, generations = (int(n) for n in args.vllm_step.split("x"))
            root = harness.storage_root(args.storage_root)
            return {"vllm_step": vllm_step(root, prompts, generations, args.timeout)}
        if args.actor_processes:
            counts = [int(n) for n in args.actor_processes.split(",")]
            return {"ranks": actor_ranks(path, counts, args.microbatch_tokens, args.timeout)}
        shape, preset = real_model_shape(path), "smol-math"
        built = {"run": harness.side_or_error(measure_run, path, str(workdir), timeout=args.timeout)}
    else:
        path = str(workdir / "qwen2.5-0.5b-shape")
        built = harness.side_or_error(build_qwen_shape, path, timeout=args.timeout)
        if "error" in built:
            return {"error": "building the model: " + built["error"]}
        shape = (args.rows, args.prompt_tokens, args.completion_tokens)
    runs = {
        "with_gc" if checkpointing else "without_gc": harness.side_or_error(
            measure_step, path, *shape, checkpointing, preset, timeout=args.timeout
        )
        for checkpointing in (False, True)
    }
    return {**built, **runs}


def print_report(results: dict[str, Any], args: argparse.Namespace) -> None:
    print("\nPeak resident memory of the actor process, one step on CPU (fp32, AdamW), a fresh process each\n")
    print(
        f"{'model':<14}{'params':>9}{'batch (rows x prompt+completion)':>34}{'grad ckpt':>11}"
        f"{'before step GiB':>16}{'peak GiB':>10}{'step s':>9}"
    )
    for name, entry in results["models"].items():
        if "error" in entry:
            print(f"{name:<14}  error: {entry['error'][:300]}")
            continue
        for key in ("without_gc", "with_gc"):
            if key not in entry:  # a sweep or a vLLM step instead, printed below
                continue
            r = entry[key]
            if "peak_bytes" not in r:
                print(
                    f"{name:<14}{'':>9}{'':>34}{('on' if key == 'with_gc' else 'off'):>11}  "
                    f"{r.get('skipped') or r.get('error', '')[:300]}"
                )
                continue
            batch = f"{r['rows']} x {r['prompt_tokens']}+{r['completion_tokens']}"
            print(
                f"{name:<14}{r['parameters'] / 1e6:>8.1f}M{batch:>34}{('on' if r['gradient_checkpointing'] else 'off'):>11}"
                f"{r['peak_before_step_bytes'] / GIB:>16.2f}{r['peak_bytes'] / GIB:>10.2f}{r['step_s']:>9.1f}"
                + (
                    f"  LoRA: {r['trainable_parameters'] / 1e6:.1f}M trainable"
                    if r.get("trainable_parameters", 0) and r["trainable_parameters"] < r["parameters"]
                    else ""
                )
            )
        run = entry.get("run")
        if run is not None:
            if "peak_bytes" in run:
                print(
                    f"{name:<14}one smol-math step through the grpo flow (actor + transformers engine + Prefect "
                    f"client, one process): peak {run['peak_bytes'] / GIB:.2f} GiB in {run['process_s']:.0f} s"
                )
            else:
                print(f"{name:<14}the grpo flow's step: {run.get('error', '')[:300]}")
    for name, entry in results["models"].items():
        if "completions" in entry:
            print_sweep(name, entry["completions"])
        if "ranks" in entry:
            print_ranks(name, entry["ranks"])
        if "vllm_step" in entry:
            r = entry["vllm_step"]
            outcome = "ran" if r["exit_status"] == 0 else f"failed (exit status {r['exit_status']})"
            print(
                f"\n{name}: two smol-math steps of {r['prompts']} x {r['generations']} with the vLLM engine through "
                f"grpo train {outcome}: peak {r['peak_bytes'] / GIB:.2f} GiB (process tree) in {r['process_s']:.0f} s"
            )
    if "qwen0.5b" in results["models"]:
        print(f"\nQwen2.5-0.5B-shape step within {LIMIT_GIB} GiB: {'yes' if results['qwen05b_fits_16gib'] else 'NO'}")


def print_sweep(name: str, sweep: dict[str, Any]) -> None:
    print(f"\n{name}, smol-math's actor step (LoRA) by completions per step, the default micro-batch budget:\n")
    print(
        f"{'completions':>11}{'micro-batches':>15}{'tokens each':>13}{'peak GiB':>10}{'estimate GiB':>14}{'est/peak':>10}"
    )
    for count, r in sweep.items():
        if "peak_bytes" not in r:
            print(f"{count:>11}  {r.get('error', '')[:300]}")
            continue
        print(
            f"{count:>11}{r['micro_batches']:>15.0f}{r['max_tokens_per_microbatch']:>13.0f}{r['peak_bytes'] / GIB:>10.2f}"
            f"{r['estimate_bytes'] / GIB:>14.2f}{r['estimate_bytes'] / r['peak_bytes']:>10.2f}"
        )


def print_ranks(name: str, ranks: dict[str, Any]) -> None:
    print(f"\n{name}, smol-math's step as a full fine-tune (AdamW, fp32) by actor ranks:\n")
    print(
        f"{'ranks':>6}{'completions':>13}{'micro-batches':>15}{'tokens each':>13}{'states GiB/rank':>17}"
        f"{'loaded GiB/rank':>17}{'peak GiB/rank':>15}{'vs 1 rank':>11}{'s':>7}"
    )
    single = ranks.get("1", {}).get("peak_bytes")
    for count, r in ranks.items():
        if "peak_bytes" not in r:
            print(f"{count:>6}  {r.get('error', '')[:300]}")
            continue
        ratio = f"{r['peak_bytes'] / single:.2f} x" if single else ""
        print(
            f"{count:>6}{r['rows']:>13}{r['micro_batches']:>15.0f}{r['max_tokens_per_microbatch']:>13.0f}"
            f"{r['states_bytes_per_rank'] / GIB:>17.2f}{r['loaded_peak_bytes'] / GIB:>17.2f}"
            f"{r['peak_bytes'] / GIB:>15.2f}{ratio:>11}{r['process_s']:>7.0f}"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return harness.main(__doc__, measure, print_report, argv, options=options, check=check)


if __name__ == "__main__":
    main()
