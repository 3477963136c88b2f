"""Rollout engines side by side: vLLM (its own environment and process) against transformers.

    python -m benchmarks.engines [--hidden-size 384] [--layers 4] [--prompts 32] [--n 8]
                          [--max-tokens 32] [--repeats 3] [--dtypes float32,bfloat16]
                          [--json FILE]
    python -m benchmarks.engines --model smollm2-135m [--prompts 4] [--n 8] [--max-tokens 16]
                          [--storage-root DIR] [...]

One randomly initialised Qwen2 model (the project's builder), saved once; both engines load it
with `from_pretrained`. Measured in one invocation:

- engine start: transformers `load()`; vLLM from starting its process to a loaded engine (the
  environment `grpo setup-vllm` built, `vllm_python`), in fp32 and in bf16 (vLLM's default);
- generation: the same prompts x n, the same sampling (temperature 1, seeded), median seconds of
  `--repeats` calls after one warm-up call, and completion tokens per second;
- weight sync: the actor's export plus the engine's load, per weight_sync_method, median of
  three, on the transformers engine and the fp32 vLLM engine, plus a state dict handed over in
  memory (what the local backend does with a transformers engine; for vLLM: safetensors bytes
  over the engine's socket);
- log-prob agreement: each engine's sampling log-probs against the fp32 actor's for the same
  tokens (TRL's code), max and mean |difference|.

With `--model smollm2-135m` both engines load the real pretrained chat model instead
(SmolLM2-135M-Instruct, `resolve_model_path`: fetched once and converted under `--storage-root`), on
`smol_math`'s chat prompts rendered by its template (prompts of up to 128 tokens, the smol-math preset's
limit); by default the smol-math step's shape (4 prompts x 8 samples of up to 16 tokens), and the
weight syncs without `checkpoint` (which re-creates the engine: its start is measured already).

Needs the vLLM environment (`grpo setup-vllm`); no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import REAL_MODEL
from benchmarks.steps import save_random_model

SYNC_METHODS = ("reload", "volume", "direct", "checkpoint")

REAL_PROMPT_TOKENS = 128  # the smol-math preset's max_prompt_length
TINY_PROMPT_TOKENS = 32  # the tiny model holds 64 positions


def prompts(count: int, task: str = "last_digit") -> list[Any]:
    from grpo_flow.workers.data.loaders import load_task

    return list(load_task(task).train.select(range(count))["prompt"])


def timed_generation(
    engine: Any, batch: list[Any], params: Any, repeats: int, prompt_tokens: int = TINY_PROMPT_TOKENS
) -> dict[str, float]:
    engine.generate(batch, params, prompt_tokens)  # warm-up: lazy initialisation is not steady-state speed
    seconds, tokens = [], 0
    for i in range(repeats):
        started = time.perf_counter()
        result = engine.generate(batch, replace(params, seed=params.seed + i), prompt_tokens)
        seconds.append(time.perf_counter() - started)
        tokens = sum(len(ids) for ids in result.completion_token_ids)
    median = statistics.median(seconds)
    return {"generate_s": median, "tokens": tokens, "tokens_per_s": tokens / median}


def agreement(
    engine: Any, actor: Any, batch: list[Any], params: Any, prompt_tokens: int = TINY_PROMPT_TOKENS
) -> dict[str, float]:
    result = engine.generate(batch, params, prompt_tokens)
    actors = actor.completion_logprobs(result.prompt_token_ids, result.completion_token_ids)
    diffs = [
        abs(a - b)
        for sampled, scored in zip(result.sampling_logprobs, actors, strict=True)
        for a, b in zip(sampled, scored, strict=True)
    ]
    return {"max": max(diffs), "mean": sum(diffs) / len(diffs), "tokens": len(diffs)}


def sync_seconds(engine: Any, actor: Any, method: str | None, run_dir: Path) -> float:
    """Median of three: the actor's export and the engine's load (method None: a state dict in memory)."""
    from grpo_flow.workers.backends.weight_sync import apply_weights, export_weights

    seconds = []
    for _ in range(3):
        actor.policy_version += 1  # a new version each time (the volume/checkpoint folders are per version)
        started = time.perf_counter()
        if method is None:
            engine.load_state_dict(actor.policy_state_dict(), actor.policy_version)
        else:
            apply_weights(engine, export_weights(method, actor, run_dir))
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def all_syncs(engine: Any, actor: Any, run_dir: Path, methods: tuple[str, ...] = SYNC_METHODS) -> dict[str, float]:
    seconds = {method: sync_seconds(engine, actor, method, run_dir) for method in methods}
    seconds["in memory"] = sync_seconds(engine, actor, None, run_dir)
    return seconds


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        choices=("random-qwen2", REAL_MODEL),
        default="random-qwen2",
        help=f"random-qwen2 (default: a randomly initialised Qwen2, --hidden-size/--layers) or {REAL_MODEL}",
    )
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=None, help=f"default 32; 4 with --model {REAL_MODEL}")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=None, help=f"default 32; 16 with --model {REAL_MODEL}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", type=lambda text: text.split(","), default=["float32", "bfloat16"])
    harness.storage_root_option(parser)


def check(args: argparse.Namespace) -> str | None:
    """Also fills in the defaults that depend on --model."""
    real = args.model == REAL_MODEL
    args.prompts = args.prompts or (4 if real else 32)
    args.max_tokens = args.max_tokens or (16 if real else 32)
    if not real and not 1 <= args.max_tokens <= 32:
        return "--max-tokens: 1 to 32 (the model holds 64 positions; prompts take up to 32)"
    if real and not 1 <= args.max_tokens <= 512:
        return f"--max-tokens: 1 to 512 with --model {REAL_MODEL}"
    if not set(args.dtypes) <= {"float32", "bfloat16"}:
        return f"--dtypes: float32 and/or bfloat16, comma-separated; got {','.join(args.dtypes)}"
    from grpo_flow.workers.backends.vllm_env import vllm_python

    if not os.path.isfile(vllm_python()):
        return f"no vLLM environment at {vllm_python()}: run `grpo setup-vllm` first"
    return None


def measure_engine(
    engine: Any, started: float, actor: Any, batch: list[Any], params: Any, args: argparse.Namespace
) -> dict[str, Any]:
    """One engine's row: its start (from `started`, before it was made), generation and log-probs."""
    engine.load()
    return {
        "start_s": time.perf_counter() - started,
        **timed_generation(engine, batch, params, args.repeats, args.prompt_tokens),
        "logprobs_vs_actor": agreement(engine, actor, batch, params, args.prompt_tokens),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from grpo_flow.schemas.config import GRPOFlowConfig
    from grpo_flow.workers.actor.actor import Actor
    from grpo_flow.workers.backends.vllm_env import vllm_python
    from grpo_flow.workers.rollout.base import SamplingParams
    from grpo_flow.workers.rollout.channel import EngineProcessError
    from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine
    from grpo_flow.workers.rollout.vllm_engine import VLLMOptions
    from grpo_flow.workers.rollout.vllm_process import VLLMProcessEngine

    real = args.model == REAL_MODEL
    results: dict[str, Any] = {}
    args.prompt_tokens = REAL_PROMPT_TOKENS if real else TINY_PROMPT_TOKENS
    # The real model's syncs move 540 MB each; `checkpoint` re-creates the engine, whose start is measured.
    methods = tuple(m for m in SYNC_METHODS if m != "checkpoint") if real else SYNC_METHODS
    with tempfile.TemporaryDirectory(prefix="grpo-flow-engines-") as tmp:
        if real:
            folder = Path(harness.real_model_path(args))
            params_count = json.loads((folder / "build_info.json").read_text())["parameters"]
        else:
            folder = Path(tmp) / "model"
            params_count = save_random_model(folder, args.hidden_size, args.layers)
        batch = prompts(args.prompts, "smol_math" if real else "last_digit")
        params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, seed=0)
        config = GRPOFlowConfig(
            run_id="engines", storage_root=tmp, model=str(folder), max_prompt_length=args.prompt_tokens
        )
        actor = Actor(config, folder)
        actor.load()

        started = time.perf_counter()
        engine: Any = TransformersRolloutEngine(folder)
        row = measure_engine(engine, started, actor, batch, params, args)
        row["sync_s"] = all_syncs(engine, actor, Path(tmp) / "run", methods)
        results["transformers (fp32)"] = row

        for dtype in args.dtypes:
            started = time.perf_counter()
            engine = VLLMProcessEngine(
                folder,
                # tiny: max_model_len from the model's config (the builder's max_position_embeddings, 64);
                # real: prompt + completion, as a grpo-flow run sizes it
                options=VLLMOptions(dtype=dtype, max_model_len=args.prompt_tokens + args.max_tokens if real else None),
                python=vllm_python(),
                log_path=Path(tmp) / f"vllm-{dtype}.log",
            )
            try:
                row = measure_engine(engine, started, actor, batch, params, args)
                if dtype == "float32":
                    row["sync_s"] = all_syncs(engine, actor, Path(tmp) / "run", methods)
            except EngineProcessError as error:  # reported in its row; the other engines are still measured
                row = {"error": str(error).splitlines()[0]}
            finally:
                engine.close()
            results[f"vLLM ({dtype})"] = row
    return {
        "parameters": params_count,
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "engines": results,
    }


def report(out: dict[str, Any], args: argparse.Namespace) -> None:
    results, params_count = out["engines"], out["parameters"]
    model = (
        f"SmolLM2-135M-Instruct ({params_count / 1e6:.1f}M parameters), smol_math chat prompts"
        if args.model == REAL_MODEL
        else f"Qwen2 {params_count / 1e6:.1f}M parameters (hidden {args.hidden_size}, {args.layers} layers)"
    )
    print(f"\n{model}, CPU; {args.prompts} prompts x n={args.n}, at most {args.max_tokens} new tokens, temperature 1\n")
    print(f"{'engine':<22}{'start s':>9}{'generate s':>12}{'tokens/s':>11}{'logp diff max':>15}{'mean':>10}")
    for name, row in results.items():
        if "error" in row:
            print(f"{name:<22}failed: {row['error']}")
            continue
        agree = row["logprobs_vs_actor"]
        print(
            f"{name:<22}{row['start_s']:>9.2f}{row['generate_s']:>12.3f}{row['tokens_per_s']:>11.0f}"
            f"{agree['max']:>15.2e}{agree['mean']:>10.1e}"
        )
    base = results["transformers (fp32)"]
    for name, row in results.items():
        if name != "transformers (fp32)" and "error" not in row:
            print(
                f"{name} / transformers: tokens/s x{row['tokens_per_s'] / base['tokens_per_s']:.2f}, "
                f"start x{row['start_s'] / base['start_s']:.1f}"
            )
    vllm_rows = [name for name, row in results.items() if "sync_s" in row and name != "transformers (fp32)"]
    print("\nweight sync, median seconds (actor export + engine load):")
    print(f"  {'method':<14}{'transformers':>14}" + "".join(f"{name:>16}{'ratio':>8}" for name in vllm_rows))
    for method, seconds in base["sync_s"].items():
        line = f"  {method:<14}{seconds:>14.3f}"
        for name in vllm_rows:
            theirs = results[name]["sync_s"][method]
            line += f"{theirs:>16.3f}{theirs / seconds:>8.1f}"
        print(line)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return harness.main(__doc__, measure, report, argv, options=options, check=check)


if __name__ == "__main__":
    main()
