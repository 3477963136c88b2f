"""Rollout engine on vLLM (GPU): the same interface and outputs as `TransformersRolloutEngine`.

`VLLMRolloutEngine` is a plain class: `load()`, `generate(prompts, params, max_prompt_length)
-> GenerationResult`, `load_state_dict(weights, version)`, `policy_version`, plus the
weight-sync hooks `sleep()`, `wake_up()`, `reload_weights_from(path, version)`,
`load_lora_adapter(folder, version)` and `recreate(model_path, version)`. vLLM is imported
lazily inside methods, so this module imports (and its pure functions are tested) on machines
without vLLM.

The mapping between grpo-flow's records and vLLM's is two pure functions, tested offline
with fake `RequestOutput`-shaped objects (tests/workers/rollout/test_vllm_engine.py):

- `to_vllm_sampling_kwargs(params, prompt_index)`: keyword arguments of `vllm.SamplingParams`
  (`n`, `max_tokens`, `temperature`, `top_p`, `seed`, `logprobs=0`).
- `from_vllm_outputs(request_outputs, eos_token_id, n)`: a `GenerationResult` in prompt-major
  order (completions [i*n, (i+1)*n) belong to prompt i), with the sampling log-probability of
  each chosen token and finish reasons `stop` / `length`, cut at the first EOS as the
  transformers engine does.

VERIFIED ONLY AGAINST vLLM's DOCUMENTED API, NOT RUN HERE (no GPU, vLLM not installable on
this machine). What it relies on, with where it is documented or used:
- `vllm.LLM(model=..., logprobs_mode="processed_logprobs", enable_sleep_mode=..., ...)`:
  engine args (docs.vllm.ai, configuration/engine_args); TRL 1.16's colocate mode builds its
  `LLM` with the same `logprobs_mode`, so returned log-probs are those of the distribution
  after temperature and top-p (the ones TRL's importance-sampling correction expects).
- `LLM.generate([{"prompt_token_ids": ids}, ...], sampling_params=[...], use_tqdm=False)`
  returns one `RequestOutput` per prompt, in prompt order; `RequestOutput.prompt_token_ids`,
  `.outputs[j].index / .token_ids / .logprobs / .finish_reason / .text`. With `logprobs=0`,
  `.logprobs[t]` is a dict {token_id: Logprob(logprob, rank, decoded_token)} holding the
  sampled token (TRL's `extract_logprobs` reads it the same way).
- With `n > 1` and a seed, vLLM's `ParentRequest` gives child j the seed `seed + j`, so the
  n samples of one prompt differ; we give prompt i the seed `seed + i * n` so no two
  completions of a batch share a seed.
- `LLM.sleep(level)`, `LLM.wake_up(tags=["weights"] | ["kv_cache"] | None)` (docs: features/
  sleep_mode), `LLM.reset_prefix_cache()`, `LLM.collective_rpc(callable, args=...)` where the
  callable gets the worker as its first argument and `worker.model_runner.model.load_weights(
  iterable of (name, tensor))` loads Hugging Face-named tensors in place (the pattern TRL's
  colocate mode and verl use). Sending a callable to vLLM's worker processes needs
  `VLLM_ALLOW_INSECURE_SERIALIZATION=1`, set here before the engine starts (our own
  module-level functions are the only callables sent).
- LoRA: `LLM(enable_lora=True, max_lora_rank=...)` and `generate(..., lora_request=
  LoRARequest(name, int_id, path))` (docs: features/lora).
"""

from __future__ import annotations

import gc
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from workers.rollout.base import GenerationResult, Prompt, SamplingParams, encode_prompt

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


# -- functions run inside vLLM's worker processes (through collective_rpc) -------------------------
def _load_safetensors_file_in_worker(worker: Any, path: str) -> int:
    """Load a safetensors file of Hugging Face-named tensors into the worker's model, in place."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as handle:
        names = list(handle.keys())
        worker.model_runner.model.load_weights((name, handle.get_tensor(name)) for name in names)
    return len(names)


def _load_safetensors_bytes_in_worker(worker: Any, payload: bytes) -> int:
    """Load serialized safetensors bytes (the `direct` sync's payload) into the worker's model."""
    from safetensors.torch import load

    tensors = load(payload)
    worker.model_runner.model.load_weights(tensors.items())
    return len(tensors)


@dataclass(frozen=True)
class VLLMOptions:
    """Engine arguments we set (everything else is vLLM's default)."""

    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    enable_sleep_mode: bool = True
    enable_lora: bool = False
    max_lora_rank: int = 16
    dtype: str = "auto"
    seed: int = 0
    enforce_eager: bool = False


class VLLMRolloutEngine:
    """One rollout worker's copy of the policy, generating with vLLM (untested here: see the module doc)."""

    def __init__(
        self, model_path: str | Path, worker_id: str = "rollout-0", options: VLLMOptions | None = None
    ) -> None:
        self.model_path = str(model_path)
        self.worker_id = worker_id
        self.options = options or VLLMOptions()
        self.policy_version = 0
        self.llm: Any = None
        self.tokenizer: Any = None
        self._sleep_level = 0  # 0 awake; 1 weights offloaded to CPU; 2 weights discarded
        self._lora_request: Any = None

    # -- lifecycle --------------------------------------------------------------------------------
    def load(self) -> None:
        from transformers import AutoTokenizer
        from vllm import LLM

        # Weight sync sends our own module-level functions to vLLM's worker processes.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        o = self.options
        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            gpu_memory_utilization=o.gpu_memory_utilization,
            max_model_len=o.max_model_len,
            enable_sleep_mode=o.enable_sleep_mode,
            dtype=o.dtype,
            seed=o.seed,
            enforce_eager=o.enforce_eager,
            # Log-probs of the distribution actually sampled from (after temperature / top-p), as TRL does.
            logprobs_mode="processed_logprobs",
        )
        if o.enable_lora:
            kwargs.update(enable_lora=True, max_lora_rank=o.max_lora_rank)
        self.llm = LLM(**kwargs)
        self._sleep_level = 0

    def recreate(self, model_path: str | Path, version: int) -> None:
        """The `checkpoint` sync: a new engine from a saved model folder (the old one freed first)."""
        self.shutdown()
        self.model_path = str(model_path)
        self.load()
        self.policy_version = version

    def shutdown(self) -> None:
        """Drop the engine and give its GPU memory back (a new `LLM` cannot start beside the old one)."""
        if self.llm is None:
            return
        self.llm = None
        self._lora_request = None
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:  # pragma: no cover - torch is a dependency
            pass

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
    def _before_weight_update(self) -> None:
        # After a level-2 sleep the weight memory is unmapped: map it before writing (TRL does the same).
        if self._sleep_level:
            self.llm.wake_up(tags=["weights"])

    def _after_weight_update(self, version: int) -> None:
        # Cached prefix KV blocks were computed by the old weights.
        self.llm.reset_prefix_cache()
        self.policy_version = version

    def reload_weights_from(self, path: str | Path, version: int) -> None:
        """Load a safetensors file of the policy (Hugging Face names) into the running engine, in place."""
        self._before_weight_update()
        self.llm.collective_rpc(_load_safetensors_file_in_worker, args=(str(path),))
        self._after_weight_update(version)

    def load_state_dict(self, weights: dict[str, Any] | bytes, version: int) -> None:
        """Take the actor's weights in memory (a state dict, or safetensors bytes as a Modal call carries)."""
        if not isinstance(weights, (bytes, bytearray)):
            from safetensors.torch import save

            weights = save({name: tensor.detach().cpu().contiguous() for name, tensor in weights.items()})
        self._before_weight_update()
        self.llm.collective_rpc(_load_safetensors_bytes_in_worker, args=(bytes(weights),))
        self._after_weight_update(version)

    def load_lora_adapter(self, folder: str | Path, version: int) -> None:
        """Generate with the adapter in `folder` from now on (a new adapter id per version)."""
        from vllm.lora.request import LoRARequest

        if not self.options.enable_lora:
            raise RuntimeError("this vLLM engine was started without enable_lora; weight_sync_method='lora' needs it")
        self._lora_request = LoRARequest(f"policy-v{version}", version + 1, str(folder))  # ids must be > 0
        self.policy_version = version

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
        return from_vllm_outputs(outputs, self.tokenizer.eos_token_id, params.n, seconds=seconds)
