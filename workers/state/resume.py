"""Where a run stands on disk, and what resuming it means. Plain code: no Prefect, no torch.

The state of a run is its newest checkpoint whose files match their manifest, plus the
rollouts logged after it. Resuming restores the checkpoint, replays the logged rollouts
through the actor (no generation), and continues. Nothing logged is rewritten: a damaged
file is moved to the run's quarantine folder. A damaged step after the checkpoint is
generated again; one before it is not needed to resume (the checkpoint holds the weights
trained on it), so it is only set aside, and its rows are no longer part of the log.

The steps a resume replays are checked against their manifests byte for byte (sha256): they
are read anyway. The steps before the checkpoint get the size check only, one stat per file,
so resuming a long run stays as fast as resuming a short one; `grpo verify` reads them all.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic_core import to_jsonable_python

from grpo_flow.schemas.config import NON_TRAINING_FIELDS, GRPOFlowConfig
from grpo_flow.workers.state.storage import DamagedRunFileError, RunStorage, file_sha256, read_run_file


BASE_MODEL_FILE = "base_model.json"  # in a LoRA checkpoint: the base model its adapter is trained on


class ResumeError(ValueError):
    """A run cannot be resumed as asked (unknown run, refused config change)."""


class BaseModelChangedError(ResumeError):
    """A LoRA checkpoint's base model is not the one its adapter was trained on."""


@dataclass(frozen=True)
class ResumePoint:
    """What the flow does with an existing run."""

    checkpoint_step: int | None  # restore this checkpoint; None: start from the initial model
    replay_steps: tuple[int, ...]  # logged steps after it: the actor trains on them again, no generation
    first_step: int  # the first step after the checkpoint
    set_aside: tuple[int, ...] = ()  # steps whose damaged rollouts were moved to quarantine/
    moved: tuple[str, ...] = ()  # each file or folder moved to quarantine/, why, and what it means: for the console


def changed_training_fields(stored: dict[str, Any], config: GRPOFlowConfig) -> dict[str, tuple[Any, Any]]:
    """Fields that change what the run computes, with their stored and new values.

    A field the stored config lacks (the run was started by an older grpo-flow) counts as its
    default, which is what that version computed with, so an upgrade alone does not stop a resume.
    """
    new = config.model_dump(mode="json")
    fields = GRPOFlowConfig.model_fields
    stored = {
        name: stored.get(name, to_jsonable_python(fields[name].get_default(call_default_factory=True))) for name in new
    }
    return {
        name: (stored[name], value)
        for name, value in new.items()
        if name not in NON_TRAINING_FIELDS and stored[name] != value
    }


def data_fingerprint(dataset: str) -> str | None:
    """sha256 over a local `hf:` data set's bytes (a file, or each file of a folder, with its name); None for
    anything else. The Python API's data sets carry theirs in their name (`registered:<fingerprint>`)."""
    if not dataset.startswith("hf:"):
        return None
    path = Path(dataset.removeprefix("hf:")).expanduser()
    if path.is_file():
        return _file_fingerprint(str(path.resolve()), *_stamp(path))
    if not path.is_dir():
        return None
    return files_fingerprint(path, [p for p in path.rglob("*") if p.is_file()])


def files_fingerprint(folder: Path, files: list[Path]) -> str:
    """sha256 over files of `folder`, each by its name in the folder and its own sha256."""
    digest = hashlib.sha256()
    for file in sorted(files):
        digest.update(f"{file.relative_to(folder)}\0{_file_fingerprint(str(file.resolve()), *_stamp(file))}\0".encode())
    return digest.hexdigest()


def model_folder(model_path: str) -> Path:
    """A model's local folder: the path itself, or a hub id's downloaded snapshot (never fetched here)."""
    if Path(model_path).is_dir():
        return Path(model_path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model_path, local_files_only=True))


def model_fingerprint(model_path: str) -> str:
    """sha256 over a model's config.json and weight files: what a LoRA checkpoint's adapter was trained on.
    Other files (tokenizer, build notes) do not change the weights an adapter adds to."""
    folder = model_folder(model_path)
    files = [p for p in folder.iterdir() if p.name == "config.json" or p.suffix in (".safetensors", ".bin")]
    return files_fingerprint(folder, files)


def base_model_reference(model: str, model_path: str) -> dict[str, str]:
    """What a LoRA checkpoint records of its base model (BASE_MODEL_FILE) instead of a copy of it."""
    return {"model": model, "path": str(model_path), "sha256": model_fingerprint(model_path)}


def check_base_model(reference: dict[str, str], model_path: str) -> None:
    """Refuse to put a LoRA adapter on another base model than the one it was trained on."""
    found = model_fingerprint(model_path)
    if found != reference["sha256"]:
        raise BaseModelChangedError(
            f"model: this LoRA checkpoint's adapter was trained on {reference['model']!r} ({reference['path']}, "
            f"sha256 {reference['sha256'][:12]}...), but {model_path} has sha256 {found[:12]}...: restore that "
            "base model, or start a new run"
        )


def check_base_model_unchanged(storage: RunStorage) -> None:
    """The base model the newest LoRA checkpoint adapts, where it recorded it, is still the same (before
    anything loads; the actor checks the folder it loads again when it restores)."""
    steps = storage.checkpoint_steps()
    path = storage.checkpoint_dir(steps[-1]) / BASE_MODEL_FILE if steps else None
    if path is None or not path.exists():
        return
    try:
        reference = read_run_file(path)
    except DamagedRunFileError:  # a damaged checkpoint: the resume sets it aside
        return
    if Path(reference["path"]).is_dir():
        check_base_model(reference, reference["path"])


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=64)
def _file_fingerprint(path: str, size: int, mtime_ns: int) -> str:
    """A file's sha256, read once per (path, size, mtime) in a process: a resume checks it twice."""
    return file_sha256(Path(path))


def recorded_data_fingerprint(storage: RunStorage) -> str | None:
    """The fingerprint of the data the run last trained on: the newest resume's, else the start's
    (run.json); None for a run that recorded none (an older grpo-flow, or data that is not a local file)."""
    for path in sorted((storage.run_dir / "resumes").glob("resume-*.json"), reverse=True):
        record = read_run_file(path)
        if "dataset_sha256" in record:
            return record["dataset_sha256"]
    run = storage.run_dir / "run.json"
    return read_run_file(run).get("dataset_sha256") if run.exists() else None


def check_data_unchanged(storage: RunStorage, config: GRPOFlowConfig, allow_config_change: bool) -> dict:
    """The same local data file as the run last trained on (its bytes, not only its name); a changed one is
    refused naming it, unless allowed. Returns the change, for the resume record."""
    if config.dataset != storage.effective_config().get("dataset"):
        return {}  # another name: a changed field, which check_config_change names
    old = recorded_data_fingerprint(storage)
    new = data_fingerprint(config.dataset)
    if old is None or new is None or old == new:
        return {}
    if not allow_config_change:
        raise ResumeError(
            f"dataset: {config.dataset.removeprefix('hf:')} changed since run {storage.run_id!r} last trained on "
            f"it (sha256 {old[:12]}... -> {new[:12]}...), so the steps after the resume would train on other data. "
            "Restore the file, use another run id, or allow it with --allow-config-change (allow_config_change=True)."
        )
    return {"dataset content (sha256)": (old, new)}


def holds_prompts_out(config: dict[str, Any]) -> bool:
    """Whether a run on an `hf:` data set holds prompts out for evaluation (rewards.task.run_task's rule), so
    that eval_prompts, otherwise free to change, decides which prompts train."""
    dataset = str(config.get("dataset", ""))
    return dataset.startswith("hf:") and bool(config.get("accuracy_reward")) and config.get("eval_prompts") != 0


def check_config_change(
    storage: RunStorage, config: GRPOFlowConfig, allow_config_change: bool
) -> dict[str, tuple[Any, Any]]:
    """Refuse a change to a training field of an existing run, or to its local data file's bytes, unless it
    is allowed; return the changes."""
    stored = storage.effective_config()
    changes = changed_training_fields(stored, config)
    new = config.model_dump(mode="json")
    if holds_prompts_out(stored) != holds_prompts_out(new):  # the train split itself would change
        changes["eval_prompts"] = (stored.get("eval_prompts"), new["eval_prompts"])
    if config.max_steps > 0:
        check_max_steps(storage, config.max_steps)
    if changes and not allow_config_change:
        listed = "; ".join(f"{name}: {old!r} -> {new!r}" for name, (old, new) in sorted(changes.items()))
        belongs = ""
        if "model" in changes:
            belongs = f"run {storage.run_id!r} belongs to model {stored.get('model')!r}, not {config.model!r}. "
        raise ResumeError(
            f"{belongs}Resuming run {storage.run_id!r} would change fields that alter training ({listed}). "
            "Use another run id, or allow it with --allow-config-change (allow_config_change=True)."
        )
    check_base_model_unchanged(storage)
    return {**changes, **check_data_unchanged(storage, config, allow_config_change)}


def last_step(storage: RunStorage) -> int:
    """The last step a run trained: its last metrics row (logged before that step's checkpoint)."""
    steps = storage.logged_steps()
    return max([steps[-1] if steps else 0, *storage.complete_checkpoints()])


def check_max_steps(storage: RunStorage, total_steps: int) -> None:
    """Refuse to resume a run with fewer steps than it has already trained: its weights are already
    past them, and its summary would report steps it did not end at."""
    last = last_step(storage)
    if total_steps < last:
        raise ResumeError(
            f"max_steps: {total_steps} is below the last step of run {storage.run_id!r}, {last} "
            f"(its weights are already past step {total_steps}); give max_steps {last} or more"
        )


def config_for_resume(storage: RunStorage, overrides: dict[str, Any]) -> GRPOFlowConfig:
    """The run's config in force, with the fields a user gave on the command line applied."""
    check_resumable(storage)
    return GRPOFlowConfig(**{**storage.effective_config(), **overrides})


def held_by_the_python_api(config: dict[str, Any]) -> str | None:
    """What of a run's config only the Python process that started it holds (GRPOFlowTrainer's data set
    objects, and reward functions that no module names: lambdas, closures, objects, a script's own), in
    words; None when a fresh process (`grpo train`, `grpo eval`, the nightly sweep) can rebuild the run."""
    parts = []
    if str(config.get("dataset", "")).startswith("registered:"):
        parts.append("a data set given as a Dataset object")
    objects = [
        str(n).removeprefix("registered:") for n in config.get("reward_funcs") or [] if str(n).startswith("registered:")
    ]
    if objects:
        parts.append(f"reward functions given as objects ({', '.join(objects)})")
    return " and ".join(parts) or None


def check_resumable(storage: RunStorage) -> None:
    """A run TRL's own loop trained (simple mode) keeps no state grpo-flow's loop can go on from."""
    if storage.run_mode() == "simple":
        raise ResumeError(
            f"run_id: run {storage.run_id!r} was trained by TRL's loop (--simple-mode), which does not resume; "
            "start a new run"
        )


def find_resume_point(storage: RunStorage) -> ResumePoint:
    """Newest valid checkpoint and the logged steps after it; tidies what a killed process left.

    The caller holds the run's writer lock. Staging folders (never logged) and killed writers'
    temporary files are removed. A damaged checkpoint newer than the one used and a damaged
    step's rollouts are moved to quarantine: after the checkpoint the step is written again,
    before it the step is not needed (and is named in a warning).
    """
    storage.discard_staging()
    storage.clean_temps()
    checkpoint = storage.latest_valid_checkpoint()
    after = (checkpoint or 0) + 1
    moved = []

    def move(path: Any, reason: str, consequence: str) -> None:
        target = storage.quarantine(path, f"{reason}; {consequence}")
        moved.append(f"{storage.relative(path)}: {reason}; moved to {storage.relative(target)}; {consequence}")

    for step in storage.checkpoint_steps():
        if step > (checkpoint or 0):
            used = (
                f"the resume uses checkpoint {checkpoint}" if checkpoint else "the resume starts from the initial model"
            )
            move(storage.checkpoint_dir(step), "checkpoint does not match its manifest", used)
    replay, set_aside = [], []
    for step in storage.rollout_steps():
        before = step < after
        problems = storage.step_problems(step, checksums=not before)
        if problems:
            consequence = (
                f"not needed to resume (checkpoint {checkpoint} holds the weights trained on it); "
                "its rows are no longer part of the run's log"
                if before
                else "the step is generated again"
            )
            move(storage.rollout_dir(step), f"damaged ({'; '.join(problems)})", consequence)
            set_aside.append(step)
        elif not before:
            replay.append(step)
    return ResumePoint(
        checkpoint_step=checkpoint,
        replay_steps=tuple(replay),
        first_step=after,
        set_aside=tuple(set_aside),
        moved=tuple(moved),
    )


def record_resume(
    storage: RunStorage, config: GRPOFlowConfig, point: ResumePoint, changes: dict, session: str = ""
) -> None:
    storage.write_resume(
        {
            "time": datetime.now(timezone.utc).isoformat(),
            "session": session,
            "set_aside_steps": list(point.set_aside),
            "checkpoint_step": point.checkpoint_step,
            "replay_steps": list(point.replay_steps),
            "first_step": point.first_step,
            "changed_fields": {name: list(values) for name, values in changes.items()},
            "config": config.model_dump(mode="json"),
            "dataset_sha256": data_fingerprint(config.dataset),
        }
    )


def replay_actor_to(actor: Any, version: int, storage: RunStorage) -> None:
    """Bring an actor (local or remote: `reset()`, `restore(folder)`, `step(expected, rollouts)`) to
    policy `version`: the newest valid checkpoint at or before it, then the logged steps after it."""
    checkpoint = storage.latest_valid_checkpoint(at_most=version)
    if checkpoint is None:
        actor.reset()
    else:
        actor.restore(storage.local_checkpoint(checkpoint))
    for step in range(actor.policy_version + 1, version + 1):
        actor.step(step - 1, storage.read_rollouts(step))
