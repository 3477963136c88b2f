"""A checkpoint as a plain transformers model folder (`grpo export`), and the base model a LoRA checkpoint adapts.

A full fine-tune's checkpoint holds such a folder already (`model/`): it is copied as it is. A LoRA
checkpoint holds the adapter and a reference to its base model (actor.py's save_checkpoint): the
base model, checked against the reference, gets the adapter merged in by peft's `merge_and_unload`.
Either way `AutoModelForCausalLM.from_pretrained(output)` loads the result, with its tokenizer.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from grpo_flow.workers.actor.actor import ADAPTER_DIR, MODEL_DIR
from grpo_flow.workers.data.models import resolve_model_path
from grpo_flow.workers.state.resume import BASE_MODEL_FILE, check_base_model
from grpo_flow.workers.state.storage import atomic_folder, read_run_file


def is_adapter_checkpoint(folder: Path) -> bool:
    """A LoRA run's checkpoint: an adapter and a reference to its base model, no full weights."""
    return (folder / BASE_MODEL_FILE).exists()


def base_model_path(folder: Path, storage_root: str | Path) -> str:
    """The base model a LoRA checkpoint adapts, as this machine has it (the folder it recorded, else the
    run's model found again), checked against the recorded fingerprint."""
    reference = read_run_file(folder / BASE_MODEL_FILE)
    path = (
        reference["path"] if Path(reference["path"]).is_dir() else resolve_model_path(reference["model"], storage_root)
    )
    check_base_model(reference, path)
    return path


def merged_model(folder: Path, storage_root: str | Path) -> tuple[Any, Any]:
    """(model, tokenizer) of a LoRA checkpoint: its base model with the adapter merged into the weights."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(base_model_path(folder, storage_root), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(folder / ADAPTER_DIR)).merge_and_unload()
    return model, AutoTokenizer.from_pretrained(folder / ADAPTER_DIR)


def export_model(checkpoint: Path, storage_root: str | Path, output: Path) -> None:
    """Write `output` (it must not exist yet): the checkpoint's model, merged with use_lora."""
    if is_adapter_checkpoint(checkpoint):
        model, tokenizer = merged_model(checkpoint, storage_root)

        def write(staging: Path) -> None:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)

    else:

        def write(staging: Path) -> None:
            shutil.copytree(checkpoint / MODEL_DIR, staging, dirs_exist_ok=True)

    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_folder(output, write)
