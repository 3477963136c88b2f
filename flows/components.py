"""Component commands: check one part of a run without starting a run.

    grpo test-rollout   one rollout worker (local, or on Modal with --backend modal) generates
    grpo test-reward    one reward function scores a completion, called exactly as a run calls it
    grpo checkpoints    a run's checkpoints, each verified against its manifest
    grpo clear-cache    delete a cached model (a built-in model, a converted GGUF file, or a hub model's download)

They are the seeds' `test_rollout_fn`, `test_reward_fn`, `list_checkpoints_fn` and `clear_cache`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from grpo_flow.flows.cli_common import UsageError as ComponentError  # bad input; `grpo` prints it and exits 2

DEFAULT_PROMPT = "What is 12 + 7? Answer with the number."


# -- test-rollout ----------------------------------------------------------------------------------------
def command_test_rollout(args: argparse.Namespace) -> int:
    from grpo_flow.flows.cli_common import quiet_prefect

    quiet_prefect(verbose=False)  # no download/loading progress bars around the answer
    from pydantic import ValidationError

    from grpo_flow.schemas.config import describe_validation_error
    from grpo_flow.schemas.presets import preset_config
    from grpo_flow.workers.rollout.base import SamplingParams

    overrides = {"backend": args.backend, "storage_root": args.storage_root, "run_id": "component-test-rollout"}
    if args.model:
        overrides["model"] = args.model
    if args.rollout_engine:
        overrides["rollout_engine"] = args.rollout_engine
    try:
        config = preset_config(args.preset, **overrides)
    except KeyError as error:
        raise ComponentError(f"--preset: {error.args[0]}") from None
    except ValidationError as error:
        raise ComponentError(describe_validation_error(error)) from None
    if args.n < 1 or args.max_tokens < 1:
        raise ComponentError("--n and --max-tokens must be at least 1")
    from grpo_flow.workers.backends.vllm_env import VLLMNotReady, check_vllm_ready

    try:
        check_vllm_ready(config)
    except VLLMNotReady as error:
        raise ComponentError(str(error)) from None
    from grpo_flow.workers.backends import check_backend_ready

    try:  # before the model is resolved: missing Modal credentials were a traceback after it
        check_backend_ready(config)
    except Exception as error:
        raise ComponentError(f"--backend {config.backend}: {error}") from None
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    prompts = chat_if_templated(args.prompt or [DEFAULT_PROMPT], config)
    started = time.perf_counter()
    result, worker = generate_once(config, prompts, params)
    seconds = time.perf_counter() - started
    tokens = sum(len(ids) for ids in result.completion_token_ids)
    print(
        f"rollout worker: {worker}; model {config.model}; {len(prompts)} prompt(s) x {args.n}; "
        f"{tokens} tokens in {seconds:.2f} s including start-up (generation {result.seconds:.2f} s)"
    )
    for i, text in enumerate(result.texts):
        logprobs = result.sampling_logprobs[i]
        mean = sum(logprobs) / len(logprobs) if logprobs else float("nan")
        print(
            json.dumps(
                {
                    "prompt": i // args.n,
                    "finish_reason": result.finish_reasons[i],
                    "tokens": len(result.completion_token_ids[i]),
                    "mean_logprob": round(mean, 4),
                    "completion": text,
                },
                ensure_ascii=False,
            )
        )
    return 0


def chat_if_templated(prompts: list[str], config: Any) -> list[Any]:
    """Each prompt as a one-message conversation where the local model has a chat template, as training
    renders such a model's prompts: given the bare string, a chat model ends its turn at once (SmolLM2 did)."""
    if config.backend != "local":
        return prompts
    from grpo_flow.workers.data.models import resolve_model_path
    from grpo_flow.workers.rollout.base import load_generation_tokenizer

    tokenizer = load_generation_tokenizer(resolve_model_path(config.model, config.storage_root))
    return [[{"role": "user", "content": prompt}] for prompt in prompts] if tokenizer.chat_template else prompts


def generate_once(config: Any, prompts: list[Any], params: Any) -> tuple[Any, str]:
    """One rollout worker's answer: the local engine (transformers, or vLLM in its own environment), or
    the Modal RolloutWorker (`.local()` on CPU when GRPO_FLOW_MODAL_MODE=local)."""
    from grpo_flow.workers.data.models import resolve_model_path

    model_path = resolve_model_path(config.model, config.storage_root)
    if config.backend == "local" and config.rollout_engine == "vllm":
        from grpo_flow.workers.backends.vllm_env import local_engine

        engine = local_engine(
            config, model_path, 0, threads=None, log_dir=None, gpu=False if config.device == "cpu" else None
        )
        engine.load()
        try:
            return engine.generate(prompts, params, config.max_prompt_length), "local vLLM engine (own process)"
        finally:
            engine.close()
    if config.backend == "local":
        from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine

        from grpo_flow.workers.backends import local_device

        device = local_device(config)
        engine = TransformersRolloutEngine(model_path, device=device)
        engine.load()
        return engine.generate(prompts, params, config.max_prompt_length), f"local transformers engine ({device})"
    from grpo_flow.workers.backends.modal_app import VOLUME_PATH, build_worker_app, worker_config_json

    local = os.environ.get("GRPO_FLOW_MODAL_MODE") == "local"
    app = build_worker_app(config)
    worker = app.rollout_cls(
        config_json=worker_config_json(config),
        model_path=model_path,
        worker_index=0,
        device="cpu" if local else "cuda",
        storage_root=config.storage_root if local else VOLUME_PATH,
    )
    if local:
        return worker.generate.local(0, prompts, params, config.max_prompt_length), (
            f"Modal RolloutWorker (.local(), CPU, {config.rollout_engine})"
        )
    with app.app.run():
        return worker.generate.remote(
            0, prompts, params, config.max_prompt_length
        ), f"Modal RolloutWorker ({config.modal_rollout_gpu})"


# -- test-reward ---------------------------------------------------------------------------------------
def parse_columns(text_pairs: list[str], json_pairs: list[str]) -> dict[str, Any]:
    """`name=value` pairs: `--column` values as text, as a JSONL data set's string column holds them
    (`answer=56` is the string "56"); `--column-json` values parsed as JSON, for a column of numbers or lists."""
    columns: dict[str, Any] = {}
    for option, pairs in (("--column", text_pairs), ("--column-json", json_pairs)):
        for pair in pairs:
            name, sep, value = pair.partition("=")
            if not sep or not name:
                raise ComponentError(f"{option}: {pair!r} is not name=value")
            if option == "--column":
                columns[name] = value
                continue
            try:
                columns[name] = json.loads(value)
            except json.JSONDecodeError as error:
                raise ComponentError(f"--column-json: {name}: {value!r} is not JSON ({error.msg})") from None
    return columns


def command_test_reward(args: argparse.Namespace) -> int:
    from grpo_flow.schemas.records import RolloutBatch
    from grpo_flow.workers.rollout.base import GenerationResult
    from grpo_flow.workers.rewards.functions import (
        RewardOutputError,
        RewardTrainerState,
        resolve_reward_funcs,
        score_batch,
    )

    try:
        funcs = resolve_reward_funcs(args.reward_funcs)
    except (ValueError, ImportError, AttributeError) as error:
        raise ComponentError(f"REWARD_FUNC: {error}") from None
    columns = parse_columns(args.column or [], args.column_json or [])
    completion = GenerationResult(  # as a rollout worker would answer, for the batch a run scores
        prompt_token_ids=[[]],
        completion_token_ids=[[]],
        sampling_logprobs=[[]],
        finish_reasons=["stop"],
        texts=[args.completion],
        extra={"worker_id": "test-reward", "policy_version": 0, "prompt_texts": [args.prompt]},
    )
    row = {**columns, "prompt_id": "test-0", "prompt": args.prompt}
    batch = RolloutBatch.from_generation([row], completion, run_id="component-test-reward", step=1, columns=columns)
    state = RewardTrainerState(global_step=1, max_steps=1, epoch=0.0)
    try:  # a function that raises shows its traceback: that is where its bug is
        scored = score_batch(batch, funcs, None, state)
    except RewardOutputError as error:  # the call worked, its output is wrong: the message says all
        print(f"grpo test-reward: {error}", file=sys.stderr)
        return 1
    for name, scores in scored.rewards.items():
        shown = "None (not applicable)" if scores[0] is None else f"{scores[0]:.4f}"
        print(f"{name}: {shown}  ({scored.reward_seconds[name] * 1000:.1f} ms)")
    for name, values in scored.logged_metrics.items():
        print(f"logged {name}: {', '.join(str(value) for value in values)}")
    if scored.logged_extra[0] is not None:
        print(f"logged extra: {scored.logged_extra[0]}")
    print(f"reward (sum, weight 1 each): {scored.reward[0]:.4f}")
    return 0


# -- checkpoints -----------------------------------------------------------------------------------------
def command_checkpoints(args: argparse.Namespace) -> int:
    from grpo_flow.flows.cli_common import named_run
    from grpo_flow.workers.state.storage import MANIFEST, DamagedCheckpointError

    storage = named_run(args.storage_root, args.run_id)
    steps = storage.checkpoint_steps()
    if not steps:
        print(f"run {args.run_id}: no checkpoints")
        return 0
    print(f"run {args.run_id}: {len(steps)} checkpoint(s) under {storage.run_dir / 'checkpoints'}")
    print(f"{'step':>6}  {'status':<8}  {'size MB':>8}  {'policy':>6}  written")
    for step in steps:
        folder = storage.checkpoint_dir(step)
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20
        try:
            manifest = storage.verify_checkpoint(step)
            status, detail = "ok", ""
        except DamagedCheckpointError as error:
            manifest = json.loads((folder / MANIFEST).read_text()) if (folder / MANIFEST).exists() else {}
            status, detail = "damaged", f"  ({error})"
        stamp = folder / MANIFEST if (folder / MANIFEST).exists() else folder  # written last: the commit's time
        written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp.stat().st_mtime))
        version = manifest.get("policy_version", "?")
        print(f"{step:>6}  {status:<8}  {size:>8.1f}  {version!s:>6}  {written}{detail}")
    return 0


# -- clear-cache -----------------------------------------------------------------------------------------
def hub_cache_dir() -> Path:
    """Where the Hugging Face hub caches downloads on this machine (HF_HUB_CACHE, HF_HOME, or the default)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def cache_entries(storage_root: str, model: str | None) -> list[Path]:
    """The cached copies of `model` (all models when None): the built-in models and converted GGUF files
    under the storage root, and the hub's download of a hub id."""
    from grpo_flow.workers.data.models import (
        BUILTIN_MODELS,
        builtin_model_path,
        gguf_model_path,
        is_gguf_path,
        models_dir,
    )

    folder = models_dir(storage_root)
    if model is None:
        return sorted(folder.glob("*")) if folder.exists() else []
    if model in BUILTIN_MODELS:
        entry = builtin_model_path(storage_root, model)
    elif is_gguf_path(model):
        if not Path(model).expanduser().is_file():
            raise ComponentError(f"--model: {model!r}: no such GGUF file (its conversion is found by its content)")
        entry = gguf_model_path(model, storage_root)
    else:
        entry = hub_cache_dir() / ("models--" + model.replace("/", "--"))
    return [entry] if entry.exists() else []


def command_clear_cache(args: argparse.Namespace) -> int:
    from grpo_flow.workers.data.models import BUILTIN_MODELS, is_gguf_path, models_dir

    if args.backend == "modal":
        return clear_modal_cache(args)
    entries = cache_entries(args.storage_root, args.model)
    if not entries:
        in_hub = args.model is not None and args.model not in BUILTIN_MODELS and not is_gguf_path(args.model)
        print(
            f"nothing cached for {args.model or 'any model'} (looked in {models_dir(args.storage_root)}"
            + (f" and {hub_cache_dir()}" if in_hub else "")
            + ")"
        )
        return 0
    for entry in entries:
        size = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file()) / 2**20
        if args.dry_run:
            print(f"would delete {entry} ({size:.1f} MB)")
        else:
            shutil.rmtree(entry)
            print(f"deleted {entry} ({size:.1f} MB); the next run builds, fetches or downloads it again")
    return 0


def clear_modal_cache(args: argparse.Namespace) -> int:
    """Delete the model's download from the hub cache on the run's Modal Volume (UNTESTED HERE: needs Modal)."""
    import modal

    from grpo_flow.schemas.config import GRPOFlowConfig
    from grpo_flow.workers.backends.modal_app import HF_HOME, VOLUME_PATH
    from grpo_flow.workers.backends.modal_backend import check_modal_ready
    from grpo_flow.workers.data.models import BUILTIN_MODELS

    if not args.model or args.model in BUILTIN_MODELS:
        raise ComponentError("--model: name the hub model whose cached download to delete from the Volume")
    config = GRPOFlowConfig(backend="modal", modal_volume=args.modal_volume)
    check_modal_ready(config)
    path = f"{HF_HOME.removeprefix(VOLUME_PATH)}/hub/models--{args.model.replace('/', '--')}"
    if args.dry_run:
        print(f"would delete {path} from Modal Volume {args.modal_volume!r}")
        return 0
    modal.Volume.from_name(args.modal_volume).remove_file(path, recursive=True)
    print(f"deleted {path} from Modal Volume {args.modal_volume!r}")
    return 0


# -- wiring ---------------------------------------------------------------------------------------------
def add_component_commands(commands: Any, default_storage_root: str) -> None:
    from grpo_flow.schemas.presets import PRESETS
    from grpo_flow.workers.data.models import BUILTIN_MODELS

    rollout = commands.add_parser("test-rollout", help="one rollout worker generates for a prompt")
    rollout.add_argument("--preset", default="tiny", help=f"one of: {', '.join(sorted(PRESETS))} (default: tiny)")
    rollout.add_argument("--model", default=None, help="model id or path (default: the preset's)")
    rollout.add_argument("--backend", default="local", choices=["local", "modal"])
    rollout.add_argument(
        "--rollout-engine", default=None, choices=["transformers", "vllm"], help="the engine (default: the preset's)"
    )
    rollout.add_argument("--prompt", action="append", help="a prompt (repeatable; default: a sum question)")
    rollout.add_argument("--n", type=int, default=2, help="completions per prompt (default: 2)")
    rollout.add_argument("--max-tokens", type=int, default=16, help="tokens per completion (default: 16)")
    rollout.add_argument("--temperature", type=float, default=1.0)
    rollout.add_argument("--seed", type=int, default=0)
    rollout.add_argument("--storage-root", default=default_storage_root)
    rollout.set_defaults(handler=command_test_rollout)

    reward = commands.add_parser("test-reward", help="score one completion with reward functions, as a run calls them")
    reward.add_argument("reward_funcs", nargs="+", metavar="REWARD_FUNC", help="built-in name or module:function")
    reward.add_argument("--completion", required=True, help="the completion text to score")
    reward.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt it answers")
    reward.add_argument(
        "--column",
        action="append",
        metavar="NAME=VALUE",
        help="a data set column passed to the function, as text (repeatable)",
    )
    reward.add_argument(
        "--column-json",
        action="append",
        metavar="NAME=JSON",
        help="a data set column whose value is parsed as JSON: a number, a list (repeatable)",
    )
    reward.set_defaults(handler=command_test_reward)

    checkpoints = commands.add_parser("checkpoints", help="a run's checkpoints, verified against their manifests")
    checkpoints.add_argument("run_id", metavar="RUN")
    checkpoints.add_argument("--storage-root", default=default_storage_root)
    checkpoints.set_defaults(handler=command_checkpoints)

    clear = commands.add_parser(
        "clear-cache", help="delete a cached model so the next run builds or downloads it again"
    )
    clear.add_argument(
        "--model",
        default=None,
        help=f"a built-in model ({', '.join(BUILTIN_MODELS)}), a .gguf file or a hub id (default: every model under "
        "the storage root)",
    )
    clear.add_argument(
        "--backend", default="local", choices=["local", "modal"], help="modal: the hub cache on the run's Modal Volume"
    )
    clear.add_argument("--modal-volume", default="grpo-flow")
    clear.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    clear.add_argument("--storage-root", default=default_storage_root)
    clear.set_defaults(handler=command_clear_cache)
