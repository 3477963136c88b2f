"""Rollout engine on transformers `generate` (CPU, or GPU without vLLM).

A plain class: `load()`, `generate(prompts, params)`, `load_state_dict(weights, version)`.
It returns completion token ids, the per-token log-probabilities of the sampling
distribution (after temperature and top-p, as TRL's importance-sampling correction
expects) and a finish reason per completion.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from grpo_flow.workers.rollout.base import (
    GenerationResult,
    Prompt,
    SamplingParams,
    encode_prompt,
    load_generation_tokenizer,
)

# torch's global RNG seeds `generate` and draws its samples, so one generation at a time keeps each
# seeded call reproducible. Whatever else seeds, sets or draws from that RNG on another thread while
# engines generate holds this lock too: the local backend's healing, which loads models and restores a
# checkpoint's RNG state (`Actor.load` seeds it) while the other shards generate.
GENERATION_LOCK = threading.RLock()


class TransformersRolloutEngine:
    """One rollout worker's copy of the policy, generating with transformers."""

    def __init__(self, model_path: str | Path, worker_id: str = "rollout-0", device: str = "cpu"):
        self.initial_model_path = self.model_path = str(model_path)
        self.worker_id = worker_id
        self.device = device
        self.policy_version = 0
        self.model: Any = None
        self.tokenizer: Any = None

    def load(self) -> None:
        """The initial model, whatever this engine held before (weights, an adapter, another folder)."""
        self.recreate(self.initial_model_path, 0)

    def recreate(self, model_path: str | Path, version: int) -> None:
        """Model and tokenizer from a saved folder (the `checkpoint` weight sync), as `version`."""
        from transformers import AutoModelForCausalLM

        self.model_path = str(model_path)
        self.tokenizer = load_generation_tokenizer(self.model_path)
        model: Any = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        self.model = model.to(self.device)
        self.model.eval()
        self.policy_version = version

    def close(self) -> None:
        """Nothing runs beside this process; the model goes with the engine."""

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int, adapter_config: Any = None) -> None:
        """Take the actor's weights in memory (the local backend's weight sync): full weights, or with
        `adapter_config` (a peft LoraConfig) a LoRA adapter over the base model this engine loaded."""
        if adapter_config is None:
            self.model.load_state_dict(state_dict, strict=True)
        else:
            from peft import get_peft_model, set_peft_model_state_dict

            if not hasattr(self.model, "peft_config"):
                self.model = get_peft_model(self.model, adapter_config)
                self.model.eval()
            result: Any = set_peft_model_state_dict(self.model, state_dict)
            if result.unexpected_keys:
                raise ValueError(f"adapter weights this engine has no place for: {result.unexpected_keys[:3]}")
        self.policy_version = version

    @torch.no_grad()
    def generate(
        self, prompts: list[Prompt], params: SamplingParams, max_prompt_length: int | None = None
    ) -> GenerationResult:
        from transformers import GenerationConfig

        prompt_ids = [encode_prompt(self.tokenizer, p, max_prompt_length) for p in prompts]
        padded = self.tokenizer.pad({"input_ids": prompt_ids}, padding=True, return_tensors="pt")
        eos_id = self.tokenizer.eos_token_id
        sampling = {} if params.greedy else {"temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        generation_config = GenerationConfig(
            max_new_tokens=params.max_tokens,
            do_sample=not params.greedy,
            num_return_sequences=params.n,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=eos_id,
            output_scores=True,
            return_dict_in_generate=True,
            **sampling,
        )
        with GENERATION_LOCK:
            started = time.perf_counter()  # time spent generating, not waiting for another shard
            torch.manual_seed(params.seed)
            output = self.model.generate(
                input_ids=padded["input_ids"].to(self.device),
                attention_mask=padded["attention_mask"].to(self.device),
                generation_config=generation_config,
            )
            seconds = time.perf_counter() - started
        tokens = output.sequences[:, padded["input_ids"].shape[1] :].cpu()  # (B*n, T)
        scores = torch.stack(output.scores, dim=1).float().cpu()  # (B*n, T, V), processed logits
        logprobs = scores.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        # A completion ends at its first EOS, which it keeps (as TRL's completion mask does).
        is_eos = tokens == eos_id
        has_eos = is_eos.any(dim=1)
        lengths = torch.where(has_eos, is_eos.int().argmax(dim=1) + 1, tokens.shape[1]).tolist()
        token_rows, logprob_rows = tokens.tolist(), logprobs.tolist()
        completion_ids = [row[:length] for row, length in zip(token_rows, lengths, strict=True)]
        return GenerationResult(
            prompt_token_ids=prompt_ids,
            completion_token_ids=completion_ids,
            sampling_logprobs=[row[:length] for row, length in zip(logprob_rows, lengths, strict=True)],
            finish_reasons=["stop" if eos else "length" for eos in has_eos.tolist()],
            texts=self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
            seconds=seconds,
        )
