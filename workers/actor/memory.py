"""How much memory a step takes, told before anything loads, and the micro-batch budget that bounds it.

    info = read_model_info(config.model, config.storage_root)   # config.json or GGUF metadata; no weights
    parts = estimate_step_memory(config, info)                   # bytes by part, and "total"
    default_microbatch_tokens(config, info, total_memory_bytes)  # max_tokens_per_microbatch when None

Pure arithmetic on the model's shape (a decoder-only transformer, Llama/Qwen2 style), the config and the
machine's total memory; nothing imports torch. The actor computes its fp32 weights, gradients and AdamW's
two moments for the trainable parameters (the LoRA adapters with use_lora), a frozen reference copy with
beta > 0 and a full fine-tune (TRL's ref_model), activations for one micro-batch, and the rollout engine
beside it. The activation term is fitted to measured peaks (benchmarks/memory.py, docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_flow.schemas.config import GRPOFlowConfig

GIB = 1024**3
FLOAT = 4  # the actor's weights, gradients, optimizer state and activations are fp32
# Floats a token keeps per layer for the backward pass: the inputs of the norms and linear layers by hidden,
# key/value and intermediate size, and copies of its attention weights (heads x row length); with gradient
# checkpointing a layer keeps its input only, and one layer's activations are rebuilt at a time.
HIDDEN_FLOATS, KV_FLOATS, INTERMEDIATE_FLOATS, ATTENTION_COPIES = 8, 4, 4, 3
# TRL's fused LM head on CPU scores every position in tiles of at most LM_HEAD_TOKENS tokens, and its forward
# and backward hold about this many vocabulary-sized float rows per token of a tile (measured: SmolLM2-135M's
# shape, benchmarks/memory.py); gradient checkpointing does not reach it.
LM_HEAD_TOKENS, LM_HEAD_COPIES = 4096, 10
PROCESS_BYTES = int(0.45 * GIB)  # torch, transformers, TRL and Prefect imported, before any weights
# Share of the device's total memory that one micro-batch's activations may take by default: the rest holds
# the weights, the optimizer, the rollout engine and what else runs on the machine.
ACTIVATION_SHARE = 8
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Built-in models fetched on first use, by their published config.json, so a run is estimated before the fetch.
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    }
}


@dataclass(frozen=True)
class ModelInfo:
    """A decoder's shape: what its memory follows."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tied: bool
    head_dim: int
    qkv_bias: bool = False

    @property
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer, by peft's module names."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim, self.kv_dim
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def parameters(self) -> int:
        layer = sum(a * b for a, b in self.linear_shapes.values()) + 2 * self.hidden_size
        if self.qkv_bias:
            layer += self.num_heads * self.head_dim + 2 * self.kv_dim
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied else 2)
        return self.num_layers * layer + embeddings + self.hidden_size


def model_info_from_config(fields: dict[str, Any]) -> ModelInfo:
    """The shape from a Hugging Face config.json's fields (a multimodal model's text_config where it has one)."""
    fields = fields.get("text_config") or fields
    hidden, heads = int(fields["hidden_size"]), int(fields["num_attention_heads"])
    return ModelInfo(
        hidden_size=hidden,
        intermediate_size=int(fields.get("intermediate_size") or 4 * hidden),
        num_layers=int(fields["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(fields.get("num_key_value_heads") or heads),
        vocab_size=int(fields["vocab_size"]),
        tied=bool(fields.get("tie_word_embeddings", True)),
        head_dim=int(fields.get("head_dim") or hidden // heads),
        qkv_bias=bool(fields.get("attention_bias", fields.get("model_type") == "qwen2")),
    )


def model_info_from_gguf(path: str | os.PathLike) -> ModelInfo:
    """The shape from a GGUF file's metadata (the reader maps the file; no tensor is read)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(name: str) -> Any:
        found = reader.get_field(name)
        return None if found is None else found.contents()

    arch = field("general.architecture")
    return model_info_from_config(
        {
            "hidden_size": field(f"{arch}.embedding_length"),
            "intermediate_size": field(f"{arch}.feed_forward_length"),
            "num_hidden_layers": field(f"{arch}.block_count"),
            "num_attention_heads": field(f"{arch}.attention.head_count"),
            "num_key_value_heads": field(f"{arch}.attention.head_count_kv"),
            "vocab_size": len(field("tokenizer.ggml.tokens")),
            "tie_word_embeddings": "output.weight" not in {t.name for t in reader.tensors},
        }
    )


def read_model_info(model: str, storage_root: str | os.PathLike) -> ModelInfo | None:
    """The shape of `model` as a run names it, without loading weights: a built-in model's folder (or its
    published shape before the fetch), a `.gguf` file's metadata, a local folder's or the hub cache's
    config.json. None where none of these is at hand (a hub model not downloaded yet)."""
    from grpo_flow.workers.data.models import BUILTIN_MODELS, builtin_model_path, is_cached, is_gguf_path

    if model in BUILTIN_MODELS:
        built = builtin_model_path(storage_root, model) / "config.json"
        if is_cached(storage_root, model) and built.is_file():
            return model_info_from_config(json.loads(built.read_text()))
        return model_info_from_config(KNOWN_SHAPES[model]) if model in KNOWN_SHAPES else None
    if is_gguf_path(model):
        return model_info_from_gguf(Path(model).expanduser()) if Path(model).expanduser().is_file() else None
    config_path = Path(model).expanduser() / "config.json"
    if not config_path.is_file():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(model, "config.json")
        except ValueError:  # not a hub id either
            return None
        if not isinstance(cached, str):
            return None
        config_path = Path(cached)
    try:
        return model_info_from_config(json.loads(config_path.read_text()))
    except (KeyError, TypeError, ValueError):  # not a decoder's config: estimated nowhere
        return None


def trainable_parameters(config: GRPOFlowConfig, info: ModelInfo) -> int:
    """Every parameter in a full fine-tune; with use_lora, rank x (in + out) for each adapted linear layer."""
    if not config.use_lora:
        return info.parameters
    rank = config.lora_r or 16
    targets = config.lora_target_modules or LORA_DEFAULT_TARGETS
    return info.num_layers * sum(rank * (a + b) for name, (a, b) in info.linear_shapes.items() if name in targets)


def row_tokens(config: GRPOFlowConfig) -> int:
    """The widest row the actor can see: prompt (max_prompt_length, else 512) plus completion."""
    return (config.max_prompt_length or 512) + config.max_completion_length


def activation_bytes_per_token(config: GRPOFlowConfig, info: ModelInfo) -> int:
    """What one token of a micro-batch keeps for the backward pass, over all layers and the LM head."""
    layer = HIDDEN_FLOATS * info.hidden_size + KV_FLOATS * info.kv_dim + INTERMEDIATE_FLOATS * info.intermediate_size
    layer += ATTENTION_COPIES * info.num_heads * row_tokens(config)
    if config.gradient_checkpointing:  # each layer's input, and one layer rebuilt at a time
        return FLOAT * (info.num_layers * info.hidden_size + layer + LM_HEAD_COPIES * info.vocab_size)
    return FLOAT * (info.num_layers * layer + LM_HEAD_COPIES * info.vocab_size)


def activation_bytes(config: GRPOFlowConfig, info: ModelInfo, tokens: int) -> int:
    """A micro-batch of `tokens` padded tokens: per token, but the LM head's part stops at one tile."""
    head = FLOAT * LM_HEAD_COPIES * info.vocab_size * max(0, tokens - LM_HEAD_TOKENS)
    return tokens * activation_bytes_per_token(config, info) - head


def default_microbatch_tokens(config: GRPOFlowConfig, info: ModelInfo, total_memory: int) -> int:
    """max_tokens_per_microbatch when the config leaves it None: the tokens whose activations fill
    1/ACTIVATION_SHARE of the device's total memory, rounded down to a power of two (so devices of about
    the same size split a batch alike), at least one widest row. From the total, never the free memory:
    the same config on the same machine always splits a batch the same way."""
    tokens = max(1, total_memory // ACTIVATION_SHARE // activation_bytes_per_token(config, info))
    return max(1 << (tokens.bit_length() - 1), row_tokens(config))


def microbatch_tokens(config: GRPOFlowConfig, info: ModelInfo, total_memory: int) -> int:
    """The padded tokens of the actor's largest micro-batch: the budget, or the whole batch if smaller."""
    budget = config.max_tokens_per_microbatch or default_microbatch_tokens(config, info, total_memory)
    return min(max(budget, row_tokens(config)), config.completions_per_step * row_tokens(config))


def engine_bytes(config: GRPOFlowConfig, info: ModelInfo) -> int:
    """The rollout engine beside the actor on the local backend: the transformers engine's fp32 copy of the
    weights; vLLM's CPU engine process (weights, its overhead and KV cache, as vllm_engine plans them)."""
    if config.backend != "local":
        return 0
    if config.rollout_engine == "transformers":
        return info.parameters * FLOAT
    from grpo_flow.workers.rollout.vllm_engine import CPU_ENGINE_OVERHEAD, CPU_KV_CACHE_MAX, CPU_MAX_NUM_SEQS

    value_bytes = 2 if config.vllm_dtype == "bfloat16" or config.bf16 else FLOAT
    weights = (info.parameters + (info.vocab_size * info.hidden_size if info.tied else 0)) * value_bytes
    length = config.vllm_max_model_length or row_tokens(config)
    kv = min(CPU_KV_CACHE_MAX, CPU_MAX_NUM_SEQS * 2 * info.num_layers * info.kv_dim * value_bytes * length)
    return weights + CPU_ENGINE_OVERHEAD + kv


def estimate_step_memory(config: GRPOFlowConfig, info: ModelInfo, total_memory: int) -> dict[str, int]:
    """A step's peak memory in bytes, by part, with their `total`: the process, the actor's weights,
    gradients and AdamW state, a frozen reference model (beta > 0 without LoRA), one micro-batch's
    activations and TRL's LM-head tile, and the rollout engine. `total_memory`: the device's, which sizes
    the default micro-batch."""
    trainable = trainable_parameters(config, info)
    tokens = microbatch_tokens(config, info, total_memory)
    parts = {
        "process": PROCESS_BYTES,
        "weights": info.parameters * FLOAT,
        "gradients": trainable * FLOAT,
        "optimizer": 2 * trainable * FLOAT,
        "reference": info.parameters * FLOAT if config.beta != 0.0 and not config.use_lora else 0,
        "activations": activation_bytes(config, info, tokens),
        "engine": engine_bytes(config, info),
    }
    return {**parts, "total": sum(parts.values())}


def describe(parts: dict[str, int]) -> str:
    """The parts above 0.1 GiB, largest first: `activations 1.9 GiB, engine 0.5 GiB, ...`."""
    shown = sorted(((v, k) for k, v in parts.items() if k != "total" and v >= GIB // 10), reverse=True)
    return ", ".join(f"{name} {value / GIB:.1f} GiB" for value, name in shown)


def machine_memory() -> tuple[int, int]:
    """(total, available) bytes of this machine's memory (/proc/meminfo)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    return int(fields["MemTotal"].split()[0]) * 1024, int(fields["MemAvailable"].split()[0]) * 1024


def device_total_memory(device: str) -> int:
    """The total memory of the actor's device: a CUDA GPU's, else the machine's."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return machine_memory()[0]


def estimate_item(config: GRPOFlowConfig) -> tuple[str, str, str] | None:
    """`("peak memory", "~X GiB", "estimate")`, the start line's item (flows/start_line.py); None when the
    model's shape is not at hand before it loads (a hub model not yet fetched)."""
    info = read_model_info(config.model, config.storage_root)
    if info is None:
        return None
    total = estimate_step_memory(config, info, machine_memory()[0])["total"]
    return ("peak memory", f"~{total / GIB:.1f} GiB", "estimate")
