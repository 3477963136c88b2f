"""The storage root: everything a run knows, as plain files (pyarrow only, no torch).

    <root>/runs/<run_id>/config.json                     frozen config of the run
    <root>/runs/<run_id>/resumes/resume-001.json         each resume: config in force, step, changes
    <root>/runs/<run_id>/rollouts/step-000042/shard-00.parquet
    <root>/runs/<run_id>/metrics/step-000042.parquet
    <root>/runs/<run_id>/checkpoints/step-000040/        manifest.json written last = complete
    <root>/runs/<run_id>/eval/initial.json               held-out accuracy before RL
    <root>/runs/<run_id>/quarantine/                     damaged files moved aside, never deleted
    <root>/runs/<run_id>/summary.json
    <root>/models/<name>/                                models the project builds itself

Every file is written to a temporary name in its own folder and renamed into place, so a
reader never sees a partial file. A step's rollout shards are written into a hidden staging
folder and the folder is renamed into place once every shard is there, so a step's rollouts
are all logged or not at all. Logged rollouts and metrics are never overwritten.

Step folders are named `step-000042`, not hive-style `step=000042`: every row already
carries its `step` column, and a hive folder of the same name makes pandas and pyarrow
refuse to read the run as one data set (the folder's key and the column clash in type).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

MANIFEST = "manifest.json"
logger = logging.getLogger("grpo_flow.storage")


class StorageFullError(OSError):
    """The disk filled up during a write; the partial file was removed, nothing else changed."""


class DamagedCheckpointError(RuntimeError):
    """A checkpoint's manifest is missing, or its files do not match the manifest."""


def _explain_write_error(path: Path, error: OSError) -> OSError:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFullError(error.errno, f"no space left on the device while writing {path}; nothing was logged")
    return error


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as error:
        Path(tmp).unlink(missing_ok=True)
        raise _explain_write_error(path, error) from error
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, payload: Any) -> None:
    atomic_write_bytes(path, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode())


def atomic_write_parquet(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except OSError as error:
        Path(tmp).unlink(missing_ok=True)
        raise _explain_write_error(path, error) from error
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file under `folder`, by relative path: its size and sha256 (a checkpoint manifest's `files`)."""
    return {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def file_matches(path: Path, expected: dict[str, Any]) -> bool:
    """Whether `path` is a file with the size and sha256 a manifest entry gives."""
    return path.is_file() and path.stat().st_size == expected["bytes"] and file_sha256(path) == expected["sha256"]


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    status: str
    last_step: int | None
    path: Path


class RunStorage:
    """Paths and atomic reads/writes for one run under a storage root."""

    def __init__(self, root: str | os.PathLike, run_id: str):
        self.root = Path(root)
        self.run_id = run_id
        self.run_dir = self.root / "runs" / run_id

    # -- layout -----------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.run_dir / "config.json"

    @property
    def summary_path(self) -> Path:
        return self.run_dir / "summary.json"

    def rollout_dir(self, step: int) -> Path:
        return self.run_dir / "rollouts" / f"step-{step:06d}"

    def rollout_path(self, step: int, shard: int) -> Path:
        return self.rollout_dir(step) / f"shard-{shard:02d}.parquet"

    def metrics_path(self, step: int) -> Path:
        return self.run_dir / "metrics" / f"step-{step:06d}.parquet"

    def checkpoint_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step-{step:06d}"

    def exists(self) -> bool:
        return self.config_path.exists()

    # -- config and summary --------------------------------------------------------------------
    def write_config(self, config: dict[str, Any]) -> None:
        """Create the run: its identity (run.json, a fresh uid) and its frozen config."""
        if self.config_path.exists():
            raise FileExistsError(f"run {self.run_id!r} already has a config at {self.config_path}")
        atomic_write_json(self.run_dir / "run.json", {"run_id": self.run_id, "uid": uuid.uuid4().hex})
        atomic_write_json(self.config_path, config)

    def run_uid(self) -> str:
        return json.loads((self.run_dir / "run.json").read_text())["uid"]

    def resume_count(self) -> int:
        return len(list((self.run_dir / "resumes").glob("resume-*.json")))

    def read_config(self) -> dict[str, Any]:
        return json.loads(self.config_path.read_text())

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_json(self.summary_path, summary)

    def read_summary(self) -> dict[str, Any] | None:
        return json.loads(self.summary_path.read_text()) if self.summary_path.exists() else None

    # -- rollouts and metrics: append-only -------------------------------------------------------
    def staging_rollout_dir(self, step: int) -> Path:
        # Hidden (leading dot): pyarrow's dataset discovery skips it, so readers never see a partial step.
        return self.run_dir / "rollouts" / f".step-{step:06d}.staging"

    def write_rollouts(self, step: int, shard: int, table: pa.Table) -> Path:
        """Stage one shard of a step; `commit_rollouts` publishes the step once every shard is staged."""
        if self.rollout_dir(step).exists():
            raise FileExistsError(f"rollouts of step {step} are already logged at {self.rollout_dir(step)}")
        path = self.staging_rollout_dir(step) / f"shard-{shard:02d}.parquet"
        atomic_write_parquet(path, table)  # a retried shard replaces its own staged file
        return path

    def commit_rollouts(self, step: int, num_shards: int) -> Path:
        """Rename the step's staging folder into place: the step is logged whole, or not at all."""
        staging, final = self.staging_rollout_dir(step), self.rollout_dir(step)
        if final.exists():
            raise FileExistsError(f"rollouts of step {step} are already logged at {final}")
        missing = [s for s in range(num_shards) if not (staging / f"shard-{s:02d}.parquet").exists()]
        if missing:
            raise FileNotFoundError(f"rollouts of step {step}: shards {missing} were never written")
        os.replace(staging, final)
        return final

    def rollout_steps(self) -> list[int]:
        """Steps whose rollouts are logged (committed)."""
        return sorted(int(p.name.split("-")[1]) for p in (self.run_dir / "rollouts").glob("step-*") if p.is_dir())

    def check_rollouts(self, step: int) -> None:
        """Raise if a logged shard of the step cannot be read (a truncated or corrupt Parquet file)."""
        shards = sorted(self.rollout_dir(step).glob("shard-*.parquet"))
        if not shards:
            raise ValueError(f"rollouts of step {step} have no shard files")
        for shard in shards:
            try:
                pq.ParquetFile(shard).read()
            except Exception as error:  # pyarrow raises several types for damaged files
                raise ValueError(f"{shard} is damaged: {error}") from error

    def quarantine(self, path: Path, reason: str) -> Path:
        """Move a damaged file or folder aside (never delete what was logged) and say so."""
        target = self.run_dir / "quarantine" / f"{path.parent.name}-{path.name}"
        counter = 1
        while target.exists():
            counter += 1
            target = target.with_name(f"{path.parent.name}-{path.name}.{counter}")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        logger.warning("%s: %s; moved to %s", path, reason, target)
        return target

    def discard_staging(self) -> list[Path]:
        """Remove staging folders a killed process left behind (never logged, so nothing is lost)."""
        leftovers = list((self.run_dir / "rollouts").glob(".step-*.staging"))
        leftovers += list((self.run_dir / "checkpoints").glob(".step-*.tmp"))
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
        return leftovers

    def read_rollouts(self, step: int | None = None, columns: list[str] | None = None) -> pa.Table:
        """Rollouts of one step (or of the whole run), ordered by step, group and sample."""
        source = self.rollout_dir(step) if step is not None else self.run_dir / "rollouts"
        if not source.exists():
            raise FileNotFoundError(f"run {self.run_id!r} has no rollouts" + (f" for step {step}" if step else ""))
        import pyarrow.dataset as ds  # here, not at the top: it imports pandas, a second of `grpo runs`

        dataset = ds.dataset(source, format="parquet", exclude_invalid_files=True)
        table = dataset.to_table(columns=columns)
        sort_keys = [(k, "ascending") for k in ("step", "group_index", "sample_index") if k in table.column_names]
        return table.sort_by(sort_keys) if sort_keys else table

    def write_metrics(self, step: int, table: pa.Table) -> Path:
        path = self.metrics_path(step)
        if path.exists():
            raise FileExistsError(f"metrics of step {step} are already logged at {path}")
        atomic_write_parquet(path, table)
        return path

    def read_metrics(self) -> pa.Table:
        """All metric rows of the run; columns that appear only at some steps are null elsewhere."""
        files = sorted((self.run_dir / "metrics").glob("step-*.parquet"))
        if not files:
            return pa.table({})
        tables = [pq.read_table(f) for f in files]
        return pa.concat_tables(tables, promote_options="default").sort_by("step")

    def logged_steps(self) -> list[int]:
        return sorted(int(p.stem.split("-")[1]) for p in (self.run_dir / "metrics").glob("step-*.parquet"))

    def read_step_metrics(self, step: int) -> dict[str, Any]:
        return pq.read_table(self.metrics_path(step)).to_pylist()[0]

    # -- resumes and evaluation ---------------------------------------------------------------
    def write_resume(self, record: dict[str, Any]) -> Path:
        """A new numbered resume record; earlier ones and config.json stay as they were."""
        existing = sorted((self.run_dir / "resumes").glob("resume-*.json"))
        path = self.run_dir / "resumes" / f"resume-{len(existing) + 1:03d}.json"
        atomic_write_json(path, record)
        return path

    def effective_config(self) -> dict[str, Any]:
        """The config in force: the newest resume's, else the one the run started with."""
        resumes = sorted((self.run_dir / "resumes").glob("resume-*.json"))
        if resumes:
            return json.loads(resumes[-1].read_text())["config"]
        return self.read_config()

    @property
    def initial_eval_path(self) -> Path:
        return self.run_dir / "eval" / "initial.json"

    def write_initial_eval(self, accuracy: float) -> None:
        if not self.initial_eval_path.exists():
            atomic_write_json(self.initial_eval_path, {"accuracy": accuracy})

    def read_initial_eval(self) -> float | None:
        if not self.initial_eval_path.exists():
            return None
        return json.loads(self.initial_eval_path.read_text())["accuracy"]

    # -- checkpoints ----------------------------------------------------------------------------
    def staging_checkpoint_dir(self, step: int) -> Path:
        """An empty hidden folder to write a checkpoint into before `commit_checkpoint`."""
        parent = self.run_dir / "checkpoints"
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=parent, prefix=f".step-{step:06d}.", suffix=".tmp"))

    def commit_checkpoint(self, step: int, staging: Path, extra: dict[str, Any]) -> Path:
        """Write the manifest (file list with sizes and checksums) last, then rename into place."""
        atomic_write_json(staging / MANIFEST, {"step": step, "files": file_manifest(staging), **extra})
        final = self.checkpoint_dir(step)
        if final.exists():
            shutil.rmtree(staging)
            raise FileExistsError(f"checkpoint of step {step} already exists at {final}")
        os.replace(staging, final)
        return final

    def complete_checkpoints(self) -> list[int]:
        parent = self.run_dir / "checkpoints"
        return sorted(int(p.name.split("-")[1]) for p in parent.glob("step-*") if (p / MANIFEST).exists())

    def checkpoint_steps(self) -> list[int]:
        """Every checkpoint folder in place, complete or not."""
        return sorted(int(p.name.split("-")[1]) for p in (self.run_dir / "checkpoints").glob("step-*") if p.is_dir())

    def verify_checkpoint(self, step: int) -> dict[str, Any]:
        """The manifest, after checking every file it lists (size and sha256); raises DamagedCheckpointError."""
        folder = self.checkpoint_dir(step)
        if not (folder / MANIFEST).exists():
            raise DamagedCheckpointError(f"checkpoint {folder} has no {MANIFEST}")
        manifest = json.loads((folder / MANIFEST).read_text())
        for name, expected in manifest["files"].items():
            path = folder / name
            if not path.exists():
                raise DamagedCheckpointError(f"checkpoint {folder}: {name} is missing")
            if not file_matches(path, expected):
                raise DamagedCheckpointError(f"checkpoint {folder}: {name} does not match its checksum")
        return manifest

    def latest_valid_checkpoint(self, at_most: int | None = None) -> int | None:
        """The newest checkpoint whose files match its manifest; damaged ones are skipped with a warning."""
        for step in reversed(self.checkpoint_steps()):
            if at_most is not None and step > at_most:
                continue
            try:
                self.verify_checkpoint(step)
                return step
            except DamagedCheckpointError as error:
                logger.warning("skipping checkpoint of step %d: %s", step, error)
        return None

    def prune_checkpoints(self, keep_last: int | None, keep_every: int | None) -> list[int]:
        """Delete complete checkpoints beyond the newest `keep_last`, except every `keep_every`-th step."""
        if keep_last is None:
            return []
        steps = self.complete_checkpoints()
        newest = set(steps[-keep_last:])
        removed = []
        for step in steps:
            if step in newest or (keep_every and step % keep_every == 0):
                continue
            shutil.rmtree(self.checkpoint_dir(step))
            removed.append(step)
        return removed


def list_runs(root: str | os.PathLike) -> list[RunInfo]:
    """Every run under the root with its status (`completed`, `failed` or `incomplete`) and last step."""
    runs = []
    for run_dir in sorted((Path(root) / "runs").glob("*")):
        if not (run_dir / "config.json").exists():
            continue
        storage = RunStorage(root, run_dir.name)
        steps = storage.logged_steps()
        summary = storage.read_summary() or {}
        runs.append(
            RunInfo(
                run_id=run_dir.name,
                status=summary.get("status", "incomplete"),
                last_step=steps[-1] if steps else None,
                path=run_dir,
            )
        )
    return runs
