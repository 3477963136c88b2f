"""GPU figures on a randomly initialised model of Qwen2.5-0.5B's shape: the actor's step
throughput and model FLOPs utilisation, and generation throughput of transformers and of vLLM.

    python -m benchmarks.gpu [--rows 64] [--prompt-tokens 128] [--completion-tokens 256]
                             [--steps 5] [--no-vllm] [--json FILE]

Needs a CUDA GPU: without one it says so and exits with status 2 (`--device cpu --shape tiny`
runs the same code on the CPU with a tiny model, to check it, not to measure anything).

- Matmul rate: the GPU's measured dense bf16 matmul rate (square matrices of `--matmul-size`,
  best of several timed runs): the denominator of MFU, measured rather than taken from a data
  sheet.
- Actor: the project's `Actor` (TRL's loss, AdamW, bf16 autocast as TRL's default on a GPU)
  on a step's rollouts table of `--rows` completions of `--completion-tokens` tokens after
  prompts of `--prompt-tokens` tokens (random ids); one warm-up step, then `--steps` timed
  steps. Tokens per second count prompt and completion tokens. Model FLOPs per step:
  6 x parameters x tokens (forward and backward; the tied embedding is counted once, as the LM
  head's matmul) + the attention scores' 12 x layers x hidden x sequence per token (PaLM's
  convention). Recomputation is not counted (with `--gradient-checkpointing` that is
  hardware, not model, FLOPs). MFU = model FLOPs per second / matmul rate.
- Generation: the project's `TransformersRolloutEngine` (`generate` with sampling and
  per-token log-probs) on `--gen-prompts` prompts x `--gen-n` samples of
  `--completion-tokens` new tokens, in fp32 (as the engine loads) and in bf16; the random
  model almost never emits its end token, so every completion runs to full length.
- Placement: where the local backend puts each worker with the config's default device (`auto`),
  asserted before anything is measured: the actor's policy and both transformers engines on the
  GPU, TRL told the same (`use_cpu` off), and vLLM engines placed by `vllm_mode` (colocate: the
  actor's GPU; server: engine i on GPU i + 1). A run that would train on the CPU on a GPU machine
  fails here.
- vLLM generation: the same prompts and sampling through the project's vLLM engine
  (`VLLMProcessEngine`, its own process from the vLLM environment `grpo setup-vllm` builds:
  `vllm` on a CUDA machine), in bf16 (its default on a GPU) and fp32; its start seconds, and
  the ratio to transformers in the same dtype. `--no-vllm` leaves it out; without the vLLM
  environment the benchmark stops before measuring anything, naming `grpo setup-vllm`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.memory import QWEN_05B_SHAPE, rollouts_table
from benchmarks.steps import save_random_model

TINY_SHAPE = {
    **QWEN_05B_SHAPE,
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    # head_dim 32: vLLM's CPU build cannot serve head_dim 16, and --device cpu runs its part too
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def model_flops_per_step(parameters: int, layers: int, hidden: int, rows: int, sequence: int) -> float:
    """Forward + backward model FLOPs of one pass over `rows` sequences of `sequence` tokens."""
    tokens = rows * sequence
    return 6.0 * parameters * tokens + 12.0 * layers * hidden * sequence * tokens


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_rate(device: str, dtype_name: str, size: int, repeats: int = 20) -> float:
    """Best measured FLOP/s of a square matmul on the device."""
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeats):
            a @ b
        synchronize(device)
        best = min(best, (time.perf_counter() - started) / repeats)
    return 2.0 * size**3 / best


def actor_throughput(
    model_path: str, device: str, rows: int, prompt_tokens: int, completion_tokens: int, steps: int, checkpointing: bool
) -> dict[str, Any]:
    import torch

    from grpo_flow.schemas.presets import preset_config
    from grpo_flow.workers.actor.actor import Actor

    overrides: dict[str, Any] = {
        "model": model_path,
        "run_id": "gpu-bench",
        "learning_rate": 1e-6,
        "max_completion_length": completion_tokens,
        "max_prompt_length": prompt_tokens,
    }
    if checkpointing:
        overrides["gradient_checkpointing"] = True
    actor = Actor(preset_config("tiny", **overrides), model_path, device=device)
    actor.load()
    actor.sampling_matches_actor = True  # rows at the actor's version: no importance-sampling pass
    table = rollouts_table(rows, prompt_tokens, completion_tokens, actor.model.config.vocab_size)
    seconds = []
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for step in range(steps + 1):  # the first is a warm-up
        synchronize(device)
        started = time.perf_counter()
        actor.step(step, table)
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    step_s = statistics.median(seconds[1:])
    config = actor.model.config
    parameters = sum(p.numel() for p in actor.model.parameters())
    flops = model_flops_per_step(
        parameters, config.num_hidden_layers, config.hidden_size, rows, prompt_tokens + completion_tokens
    )
    return {
        "bf16": bool(actor.objective.args.bf16),
        "gradient_checkpointing": checkpointing,
        "step_s": step_s,
        "first_step_s": seconds[0],
        "tokens_per_step": rows * (prompt_tokens + completion_tokens),
        "tokens_per_s": rows * (prompt_tokens + completion_tokens) / step_s,
        "model_flops_per_step": flops,
        "model_flops_per_s": flops / step_s,
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated() if device.startswith("cuda") else None,
    }


def generation_throughput(
    model_path: str, device: str, prompts: int, n: int, new_tokens: int, dtype_name: str
) -> dict[str, Any]:
    import torch

    from grpo_flow.workers.data.loaders import load_task
    from grpo_flow.workers.rollout.base import SamplingParams
    from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine

    engine = TransformersRolloutEngine(model_path, worker_id="gpu-bench", device=device)
    engine.load()
    if dtype_name != "float32":
        engine.model.to(getattr(torch, dtype_name))
    texts = load_task("last_digit").train.select(range(prompts))["prompt"]
    seconds, generated = [], []
    for seed in range(3):  # the first is a warm-up
        synchronize(device)
        started = time.perf_counter()
        result = engine.generate(texts, SamplingParams(n=n, max_tokens=new_tokens, temperature=1.0, seed=seed))
        synchronize(device)
        seconds.append(time.perf_counter() - started)
        generated.append(sum(len(ids) for ids in result.completion_token_ids))
    del engine
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {
        "dtype": dtype_name,
        "sequences": prompts * n,
        "new_tokens_per_call": statistics.median(generated[1:]),
        "call_s": statistics.median(seconds[1:]),
        "tokens_per_s": statistics.median(g / s for g, s in zip(generated[1:], seconds[1:], strict=True)),
    }


def vllm_generation_throughput(
    model_path: str, prompts: int, n: int, new_tokens: int, dtype_name: str, python: str, log_dir: Path
) -> dict[str, Any]:
    """As generation_throughput (on the device vLLM's build is for), through the project's vLLM engine process; also its start seconds."""
    from grpo_flow.workers.data.loaders import load_task
    from grpo_flow.workers.rollout.base import SamplingParams
    from grpo_flow.workers.rollout.vllm_engine import VLLMOptions
    from grpo_flow.workers.rollout.vllm_process import VLLMProcessEngine

    texts = load_task("last_digit").train.select(range(prompts))["prompt"]
    options = VLLMOptions(dtype=dtype_name, max_model_len=64 + new_tokens, gpu_memory_utilization=0.5)
    started = time.perf_counter()
    engine = VLLMProcessEngine(
        model_path, worker_id="gpu-bench", options=options, python=python, log_path=log_dir / f"vllm-{dtype_name}.log"
    )
    engine.load()
    start_s = time.perf_counter() - started
    seconds, generated = [], []
    try:
        for seed in range(3):  # the first is a warm-up
            started = time.perf_counter()
            result = engine.generate(texts, SamplingParams(n=n, max_tokens=new_tokens, temperature=1.0, seed=seed))
            seconds.append(time.perf_counter() - started)
            generated.append(sum(len(ids) for ids in result.completion_token_ids))
    finally:
        engine.close()
    return {
        "dtype": dtype_name,
        "engine": "vllm",
        "start_s": start_s,
        "sequences": prompts * n,
        "new_tokens_per_call": statistics.median(generated[1:]),
        "call_s": statistics.median(seconds[1:]),
        "tokens_per_s": statistics.median(g / s for g, s in zip(generated[1:], seconds[1:], strict=True)),
    }


def worker_placement(model_path: str, device: str, storage_root: Path) -> dict[str, Any]:
    """Where the local backend puts each worker (`device`: `cuda`, or `cpu` to check the code), asserted:
    the actor's policy and each transformers engine on the device, TRL's use_cpu saying the same, and the
    GPUs each vLLM engine process would see in either vllm_mode."""
    from grpo_flow.schemas.presets import preset_config
    from grpo_flow.workers import backends
    from grpo_flow.workers.backends import vllm_env

    config = preset_config(
        "tiny",
        run_id="gpu-placement",
        storage_root=str(storage_root),
        model=model_path,
        device="auto" if device == "cuda" else "cpu",
        num_rollout_workers=2,
    )
    placement = backends.placement(config, model_path)
    actor, engines = placement.start()
    try:
        policy = next(actor.server.actor.model.parameters()).device.type
        use_cpu = bool(actor.server.actor.objective.args.use_cpu)
        on = [next(engine.server.engine.model.parameters()).device.type for engine in engines]
    finally:
        placement.close()
    placed = {"device": placement.device, "actor": policy, "trl_use_cpu": use_cpu, "transformers_engines": on}
    assert placed == {
        "device": device,
        "actor": device,
        "trl_use_cpu": device == "cpu",
        "transformers_engines": [device, device],
    }, f"the local backend's workers are not all on {device}: {placed}"
    visible = {}
    for mode in ("colocate", "server"):
        engine_config = config.model_copy(update={"rollout_engine": "vllm", "vllm_mode": mode})
        visible[mode] = [
            vllm_env.local_engine(engine_config, model_path, i, 1, None, gpu=device == "cuda").env.get(
                "CUDA_VISIBLE_DEVICES"
            )
            for i in range(2)
        ]
    if device == "cuda":  # colocate: the actor's devices, as inherited; server: GPU i + 1 for engine i
        assert visible == {"colocate": [None, None], "server": ["1", "2"]}, f"vLLM engines misplaced: {visible}"
    return {**placed, "vllm_cuda_visible_devices": visible}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=64, help="completions in an actor step (default 64)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt tokens per row (default 128)")
    parser.add_argument("--completion-tokens", type=int, default=256, help="completion tokens (default 256)")
    parser.add_argument("--steps", type=int, default=5, help="timed actor steps after a warm-up (default 5)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="actor with gradient checkpointing")
    parser.add_argument("--gen-prompts", type=int, default=16, help="generation: prompts per call (default 16)")
    parser.add_argument("--gen-n", type=int, default=8, help="generation: samples per prompt (default 8)")
    parser.add_argument("--matmul-size", type=int, default=8192, help="matmul rate: square size (default 8192)")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu with --shape tiny to check the code")
    parser.add_argument("--shape", choices=("qwen0.5b", "tiny"), default="qwen0.5b")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM generation out")


def check(args: argparse.Namespace) -> str | None:
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return (
            "benchmarks/gpu.py needs a CUDA GPU and torch with CUDA; this machine has none "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False). Nothing was measured."
        )
    if args.device == "cpu" and args.shape != "tiny":
        return "--device cpu is for checking the code: use it with --shape tiny"
    if not args.no_vllm:
        from grpo_flow.workers.backends.vllm_env import vllm_python

        if not Path(vllm_python()).is_file():
            return f"no vLLM environment at {vllm_python()}: run `grpo setup-vllm` first, or pass --no-vllm"
    return None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    on_gpu = args.device.startswith("cuda")
    shape = QWEN_05B_SHAPE if args.shape == "qwen0.5b" else TINY_SHAPE
    with tempfile.TemporaryDirectory(prefix="grpo-flow-gpu-") as tmp:
        model_path = str(Path(tmp) / f"{args.shape}-shape")
        parameters = save_random_model(Path(model_path), shape=shape, seed=0)
        placement = worker_placement(model_path, "cuda" if on_gpu else "cpu", Path(tmp) / "storage")
        actor = actor_throughput(
            model_path,
            args.device,
            args.rows,
            args.prompt_tokens,
            args.completion_tokens,
            args.steps,
            args.gradient_checkpointing,
        )
        matmul_dtype = "bfloat16" if actor["bf16"] else "float32"
        rate = matmul_rate(args.device, matmul_dtype, args.matmul_size if on_gpu else 512)
        sizes = (args.gen_prompts, args.gen_n, args.completion_tokens)
        generation = [
            generation_throughput(model_path, args.device, *sizes, dtype) for dtype in ("float32", "bfloat16")
        ]
        vllm = []
        if not args.no_vllm:
            from grpo_flow.workers.backends.vllm_env import vllm_python

            vllm = [
                vllm_generation_throughput(model_path, *sizes, dtype, vllm_python(), Path(tmp))
                for dtype in ("bfloat16", "float32")
            ]
    return {
        "device": torch.cuda.get_device_name(args.device) if on_gpu else "cpu (code check only)",
        "torch": torch.__version__,
        "shape": args.shape,
        "parameters": parameters,
        "placement": placement,
        "matmul_dtype": matmul_dtype,
        "matmul_flops_per_s": rate,
        "actor_tokens_per_s": actor["tokens_per_s"],
        "mfu": actor["model_flops_per_s"] / rate,
        "generation_tokens_per_s": {g["dtype"]: g["tokens_per_s"] for g in generation},
        "actor": actor,
        "generation": generation,
        "vllm_generation_tokens_per_s": {g["dtype"]: g["tokens_per_s"] for g in vllm},
        "vllm_generation": vllm,
        "workload": {
            "rows": args.rows,
            "prompt_tokens": args.prompt_tokens,
            "completion_tokens": args.completion_tokens,
            "gen_prompts": args.gen_prompts,
            "gen_n": args.gen_n,
        },
    }


def print_report(r: dict[str, Any], args: argparse.Namespace) -> None:
    a, w = r["actor"], r["workload"]
    print(
        f"\n{r['device']}, torch {r['torch']}; randomly initialised {r['shape']} shape, {r['parameters'] / 1e6:.0f}M parameters\n"
    )
    where = r["placement"]
    print(
        f"placement (local backend, device {where['device']}): actor on {where['actor']}, transformers engines on "
        f"{', '.join(where['transformers_engines'])}, TRL use_cpu {where['trl_use_cpu']}; vLLM engines' "
        f"CUDA_VISIBLE_DEVICES {where['vllm_cuda_visible_devices']}"
    )
    print(f"measured {r['matmul_dtype']} matmul rate: {r['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s")
    print(
        f"\nactor step ({w['rows']} rows x {w['prompt_tokens']}+{w['completion_tokens']} tokens, "
        f"bf16 {'on' if a['bf16'] else 'off'}, gradient checkpointing {'on' if a['gradient_checkpointing'] else 'off'}):"
    )
    print(
        f"  {a['step_s']:.3f} s per step (median), {a['tokens_per_s']:,.0f} tokens/s, "
        f"{a['model_flops_per_s'] / 1e12:.1f} model TFLOP/s, MFU {100 * r['mfu']:.1f} %"
    )
    if a["peak_gpu_memory_bytes"]:
        print(f"  peak GPU memory {a['peak_gpu_memory_bytes'] / 1024**3:.1f} GiB")
    print(
        f"\ntransformers generation ({w['gen_prompts']} prompts x {w['gen_n']} samples x {w['completion_tokens']} new tokens):"
    )
    for g in r["generation"]:
        print(f"  {g['dtype']:<9} {g['tokens_per_s']:>12,.0f} tokens/s   ({g['call_s']:.2f} s per call)")
    if r["vllm_generation"]:
        print("\nvLLM generation (same prompts and sampling; its own process):")
        plain = r["generation_tokens_per_s"]
        for g in r["vllm_generation"]:
            print(
                f"  {g['dtype']:<9} {g['tokens_per_s']:>12,.0f} tokens/s   ({g['call_s']:.2f} s per call, "
                f"engine start {g['start_s']:.1f} s); x{g['tokens_per_s'] / plain[g['dtype']]:.2f} transformers"
            )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return harness.main(__doc__, measure, print_report, argv, options=options, check=check)


if __name__ == "__main__":
    main()
