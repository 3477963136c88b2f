"""The project's own tiny model: a real Qwen2 architecture with a byte-level tokenizer.

Built on first use under `<storage_root>/models/tiny-qwen2/` and loaded from there with
`from_pretrained` like any hub model, so everything runs offline.

Format warm start: a randomly initialised model does not yet know what an answer looks like
(for `last_digit`, one of the digits it was shown, followed by end-of-sequence). A short
supervised pass teaches that answer format on targets the task draws *at random in its
format* (`TaskData.format_answer`): for `last_digit` a random digit of the prompt, so the
model learns to copy some digit but not which one, and held-out accuracy ends near
1/length (about 0.3). Learning which digit (the last) is left to RL. `build_info.json`
records held-out accuracy before and after the warm start.

One architecture, one warm start per task: `tiny` is warm-started on `last_digit`'s format,
`tiny-reverse` on `reverse_digits`' (the prompt's digits in a random order), each in its own
folder (TINY_MODELS). Runs find them by name through workers/data/models.py, where every built-in
model is listed.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grpo_flow.workers.data.models import BUILTIN_MODELS
from grpo_flow.workers.state.location import models_root
from grpo_flow.workers.state.storage import build_once

TINY_MODEL_NAME = "tiny"
# Model names the project builds itself -> (folder under <storage_root>/models, the task whose answer
# format its warm start teaches), from the list of every built-in model.
TINY_MODELS = {
    model.name: (model.folder, model.warm_start_task or "")
    for model in BUILTIN_MODELS.values()
    if model.source == "built" and model.warm_start_task != "digit_lookup"  # tiny-tools: workers/data/tiny_tools.py
}
TINY_DIR = TINY_MODELS[TINY_MODEL_NAME][0]
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"  # Qwen2's names
BUILD_SEED = 0


def build_tokenizer() -> Any:
    """A byte-level BPE tokenizer with no merges: every byte is a token, as in Qwen2's alphabet.

    transformers loads it back as a `Qwen2Tokenizer` (the class it maps to Qwen2 models).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for token in (PAD_TOKEN, EOS_TOKEN):
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, padding_side="left"
    )


def build_model(tokenizer: Any, hidden_size: int = 64, layers: int = 2, seed: int = BUILD_SEED) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        # head_dim = hidden_size / heads = 32: vLLM's CPU attention serves head dims of 32 and up (16 kills its
        # engine at the first generate), so both rollout engines can serve this model. One KV head keeps
        # k_proj/v_proj at 64x32, the same parameter count as the earlier 4-head shape.
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def format_warm_start(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    format_answer: Callable[[str, random.Random], str],
    steps: int = 200,
    seed: int = BUILD_SEED,
) -> float:
    """Supervised steps on `prompt -> format_answer(prompt), <eos>`: a random answer in the task's
    format (for last_digit, one of the prompt's digits), so the format, not the answer."""
    rng = random.Random(seed)

    def batch() -> list[tuple[list[int], list[int]]]:
        chosen = rng.sample(prompts, 64)
        rows = []
        for prompt, text in [(p, p + format_answer(p, rng)) for p in chosen]:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            start = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            rows.append((ids, [0] * start + [1] * (len(ids) - start)))
        return rows

    return supervised_steps(model, tokenizer, batch, steps)


def supervised_steps(
    model: Any, tokenizer: Any, batches: Callable[[], list[tuple[list[int], list[int]]]], steps: int
) -> float:
    """`steps` AdamW steps on `batches()`, each row its token ids and a loss mask (1: a token the loss
    counts), right-padded; returns the last step's loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        batch = batches()
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (ids, mask) in enumerate(batch):
            row = torch.tensor(ids)
            input_ids[i, : len(ids)] = row
            attention[i, : len(ids)] = 1
            labels[i, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), row, -100)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return float(loss.detach())


def tiny_model_path(storage_root: str | os.PathLike, name: str = TINY_MODEL_NAME) -> Path:
    return models_root(storage_root) / TINY_MODELS[name][0]


def ensure_tiny_model(storage_root: str | os.PathLike, name: str = TINY_MODEL_NAME) -> Path:
    """The folder of tiny model `name` (a TINY_MODELS key), building it (once, atomically) if it is not there yet."""
    return build_once(tiny_model_path(storage_root, name), lambda folder: build_tiny_model(name, folder))


def build_tiny_model(name: str, folder: Path) -> dict[str, Any]:
    """Tiny model `name` warm-started into `folder`; its build info."""
    from grpo_flow.workers.data.loaders import load_task
    from grpo_flow.workers.state.phase import say
    from grpo_flow.workers.rollout.heldout import heldout_accuracy
    from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine

    task_name = TINY_MODELS[name][1]
    say(f"building the tiny model {name!r} into {folder.parent} (once: a warm start on {task_name})")
    task = load_task(task_name)
    assert task.format_answer is not None, f"{task_name} has no format_answer for a warm start"
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    # The longest answer plus end-of-sequence: every character is a token for this tokenizer.
    answer_tokens = max(len(answer) for answer in task.heldout["answer"]) + 1

    def accuracy() -> float:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        engine = TransformersRolloutEngine(folder)
        engine.load()
        return heldout_accuracy(engine, task, limit=200, max_tokens=answer_tokens)

    before = accuracy()
    warm_start_loss = format_warm_start(model, tokenizer, task.train["prompt"], task.format_answer)
    after = accuracy()
    return {
        "architecture": "Qwen2ForCausalLM",
        "parameters": sum(p.numel() for p in model.parameters()),
        "warm_start_task": task_name,
        "heldout_accuracy_random_init": before,
        "heldout_accuracy_after_warm_start": after,
        "warm_start_loss": warm_start_loss,
    }


def read_build_info(model_path: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_path) / "build_info.json"
    return json.loads(path.read_text()) if path.exists() else {}
