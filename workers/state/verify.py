"""`grpo verify RUN`: every logged step and checkpoint of a run checked byte for byte.

- rollouts: each step's shards against its `_manifest.json` (size and sha256); a step logged
  before steps had manifests is read in full instead;
- checkpoints: each file against the checkpoint's `manifest.json` (size and sha256);
- metrics: each step's Parquet row is read;
- the run's records (config.json, run.json, resumes/resume-NNN.json): each is read as JSON. One that
  is damaged is named and left in place (the run is known by it): restore it from a backup.

What is damaged is named, file by file, and moved to the run's `quarantine/` (never deleted),
so the run's readers (pandas, pyarrow, DuckDB, `grpo rollouts`, evaluation, report) read the
rest. Nothing is moved while another process writes the run (it holds the writer lock): that
process is named instead. Whether a damaged step matters: before the newest valid checkpoint it
is not needed to resume (its rows are lost from the log); after it, a resume generates it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_flow.workers.state.lock import RunLock, RunLockedError, describe_holder
from grpo_flow.workers.state.storage import (
    DamagedCheckpointError,
    DamagedRunFileError,
    RunStorage,
    read_parquet,
    read_run_file,
)


@dataclass
class Damage:
    """One damaged step, checkpoint or metrics file, with what was found and where it went."""

    kind: str  # "rollouts", "checkpoint", "metrics" or "record" (config.json, run.json, a resume's)
    step: int
    path: Path
    problems: list[str]
    moved_to: Path | None = None


@dataclass
class RunCheck:
    """What `verify_run` found."""

    run_id: str
    steps: int = 0  # logged steps whose rollouts were checked
    shards: int = 0
    shard_bytes: int = 0
    unmanifested_steps: list[int] = field(default_factory=list)  # logged before step manifests: read instead
    metrics: int = 0
    checkpoints: list[int] = field(default_factory=list)  # intact ones
    newest_checkpoint: int | None = None
    damage: list[Damage] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)  # what quarantine/ held before this check
    leftovers: list[str] = field(default_factory=list)  # staging and temporary files of killed writers
    writer: dict[str, Any] | None = None  # a live process writing the run: nothing was moved

    @property
    def clean(self) -> bool:
        return not self.damage


def verify_run(storage: RunStorage, quarantine: bool = True) -> RunCheck:
    """Check every step, checkpoint and metrics file of the run; move what is damaged aside
    (unless `quarantine` is False, or another process writes the run)."""
    check = RunCheck(run_id=storage.run_id, quarantined=storage.quarantined())
    records = [storage.config_path, storage.run_dir / "run.json"]
    for path in records + sorted((storage.run_dir / "resumes").glob("resume-*.json")):
        try:
            if path.exists() or path == storage.config_path:
                read_run_file(path)
        except DamagedRunFileError as error:
            check.damage.append(
                Damage("record", 0, path, [f"{storage.relative(path)}: {str(error).partition(': ')[2]}"])
            )
    for step in storage.checkpoint_steps():
        try:
            storage.verify_checkpoint(step)
            check.checkpoints.append(step)
        except DamagedCheckpointError as error:
            check.damage.append(Damage("checkpoint", step, storage.checkpoint_dir(step), [str(error)]))
    check.newest_checkpoint = check.checkpoints[-1] if check.checkpoints else None
    for step in storage.rollout_steps():
        folder = storage.rollout_dir(step)
        problems = storage.step_problems(step, checksums=True)
        if problems:
            check.damage.append(Damage("rollouts", step, folder, problems))
            continue
        shards = sorted(folder.glob("shard-*.parquet"))
        check.steps += 1
        check.shards += len(shards)
        check.shard_bytes += sum(p.stat().st_size for p in shards)
        if not (folder / "_manifest.json").exists():
            check.unmanifested_steps.append(step)
    for step in storage.logged_steps():
        path = storage.metrics_path(step)
        try:
            read_parquet(path)
            check.metrics += 1
        except Exception as error:  # pyarrow raises several types for damaged files
            check.damage.append(Damage("metrics", step, path, [f"{storage.relative(path)}: unreadable ({error})"]))
    check.leftovers = [storage.relative(p) for p in storage.uncommitted()]
    if check.damage and quarantine:
        move_aside(storage, check)
    return check


def move_aside(storage: RunStorage, check: RunCheck) -> None:
    """Quarantine each damaged item, holding the run's writer lock so no writer reads it meanwhile."""
    lock = RunLock(storage.run_dir, command="grpo verify")
    try:
        lock.acquire()
    except RunLockedError as error:
        check.writer = error.holder or {}
        return
    try:
        for damage in check.damage:
            if damage.kind != "record":  # the run is known by its records: moving one would lose the run
                damage.moved_to = storage.quarantine(damage.path, "; ".join(damage.problems), log=False)
    finally:
        lock.release()


def consequence(damage: Damage, newest_checkpoint: int | None) -> str:
    """What a damaged item means for the run, in words."""
    if damage.kind == "record":
        return "the run cannot be resumed or evaluated until it is restored from a backup"
    if damage.kind == "checkpoint":
        return "a resume uses the newest intact checkpoint before it"
    if damage.kind == "metrics":
        return "that step's metrics row is no longer read (report, summary)"
    if newest_checkpoint is not None and damage.step <= newest_checkpoint:
        return (
            f"not needed to resume (checkpoint {newest_checkpoint} holds the weights trained on it); "
            "its rows are no longer part of the run's log"
        )
    return "a resume generates the step again"


def report_lines(storage: RunStorage, check: RunCheck) -> list[str]:
    """What `grpo verify` prints: each damaged file, where it went and what it means, then a summary."""
    lines = [f"damaged: {problem}" for damage in check.damage for problem in damage.problems]
    for damage in check.damage:
        name = f"checkpoint {damage.step}" if damage.kind == "checkpoint" else f"step {damage.step}'s {damage.kind}"
        if damage.kind == "record":
            name = storage.relative(damage.path)
        where = f"moved to {storage.relative(damage.moved_to)}" if damage.moved_to else "left in place"
        lines.append(f"{name}: {where}; {consequence(damage, check.newest_checkpoint)}")
    if check.writer is not None:
        lines.append(f"nothing was moved: the run is being written by {describe_holder(check.writer)}")
    lines.append(
        f"run {check.run_id}: {check.steps} step(s) of rollouts ({check.shards} shards, "
        f"{check.shard_bytes / 2**20:.1f} MB), {len(check.checkpoints)} checkpoint(s) and {check.metrics} "
        "metrics file(s) intact" + (f"; {len(check.damage)} damaged" if check.damage else "")
    )
    if check.unmanifested_steps:
        steps = check.unmanifested_steps
        lines.append(f"steps {steps[0]}..{steps[-1]}: {len(steps)} logged before steps had manifests, read in full")
    if check.quarantined:
        lines.append(f"already in quarantine/: {', '.join(check.quarantined)}")
    if check.leftovers:
        lines.append(f"left by a killed writer (removed at the run's next start): {', '.join(check.leftovers)}")
    return lines
