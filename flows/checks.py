"""What `grpo train` and `GRPOFlowTrainer` check before anything starts: reward names and
`module:function` paths, `reward_weights` against the functions, a local data set or model path
(or the form of a hub id), and a storage root that can be written. In about a second: no model,
data set, torch or Prefect is loaded.

    check_before_start(config)          # raises StartCheckError: `error.field`, one-line `error.message`
    check_storage_root(root)

The flow's `prepare_run` checks the same things again where the run really starts (a deployment
run never passes through here).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Collection
from pathlib import Path

from schemas.config import GRPOFlowConfig

# A Hugging Face hub id: `name` or `namespace/name` (letters, digits, `-`, `_`, `.`; at most 96 each).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?$")


class StartCheckError(ValueError):
    """A config that cannot start; `field` names the field, `message` says why in one line."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check_before_start(config: GRPOFlowConfig, registered_rewards: Collection[str] = ()) -> None:
    """Everything about `config` that can be checked before anything loads. `registered_rewards`:
    the names GRPOFlowTrainer registers for this run (`registered:<name>`), taken as they are."""
    check_storage_root(config.storage_root)
    if config.dataset.startswith("hf:"):
        check_local_or_hub("dataset", config.dataset.removeprefix("hf:"), "data set", folder_only=False)
    check_rewards(config, registered_rewards)
    if config.model != "tiny" and config.backend == "local":
        check_local_or_hub("model", config.model, "model", folder_only=True)


def check_storage_root(root: str | os.PathLike) -> None:
    """The storage root, or the nearest folder above it that exists, takes a new file (one is created
    and removed: `os.access` says yes to root on a read-only file system such as /sys)."""
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


def check_rewards(config: GRPOFlowConfig, registered: Collection[str] = ()) -> None:
    """Reward names resolve (built-ins, `module:function` imports), and reward_weights has one weight
    per function, the data set's default ones included."""
    from workers.data.loaders import DEFAULT_REWARDS
    from workers.rewards.functions import resolve_reward_funcs

    names = list(config.reward_funcs)
    if not names:
        names = list(DEFAULT_REWARDS.get(config.dataset, ()))
        if not names:
            raise StartCheckError(
                "reward_funcs", f"data set {config.dataset!r} has no default rewards; give reward_funcs"
            )
    checkable = [name for name in names if name.removeprefix("registered:") not in registered]
    try:
        resolve_reward_funcs(checkable)
    except ValueError as error:
        raise StartCheckError("reward_funcs", str(error).partition(": ")[2] or str(error)) from None
    if config.reward_weights is not None and len(config.reward_weights) != len(names):
        raise StartCheckError(
            "reward_weights",
            f"{len(config.reward_weights)} weights for {len(names)} reward functions ({', '.join(names)})",
        )


def check_local_or_hub(field: str, value: str, what: str, folder_only: bool) -> None:
    """`value` is an existing local path, or has the form of a hub id (whether the hub has it is
    found out when it loads: that needs the network)."""
    from workers.data.loaders import FILE_BUILDERS

    path = Path(value).expanduser()
    if path.exists():
        if folder_only and not (path / "config.json").is_file():
            raise StartCheckError(field, f"{value!r} is not a saved {what} (a folder with config.json)")
        if path.is_file() and path.suffix not in FILE_BUILDERS:
            kinds = ", ".join(sorted(set(FILE_BUILDERS)))
            raise StartCheckError(field, f"{value!r}: a {what} file must be one of {kinds}")
        return
    if value.startswith(("/", "./", "../", "~", ".\\")) or value.count("/") > 1 or "\\" in value:
        raise StartCheckError(field, f"{value!r}: no such file or folder")
    if not HUB_ID.match(value):
        raise StartCheckError(
            field, f"{value!r} is neither a local path nor a Hugging Face hub id (name or namespace/name)"
        )
