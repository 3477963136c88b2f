"""The storage root: everything a run knows, as plain files (pyarrow only, no torch).

    <root>/runs/<run_id>/config.json                     frozen config of the run
    <root>/runs/<run_id>/rollouts/step-000042/shard-00.parquet
    <root>/runs/<run_id>/metrics/step-000042.parquet
    <root>/runs/<run_id>/checkpoints/step-000040/        manifest.json written last = complete
    <root>/runs/<run_id>/summary.json
    <root>/models/<name>/                                models the project builds itself

Every file is written to a temporary name in its own folder and renamed into place, so a
reader never sees a partial file. Logged rollouts and metrics are never overwritten.

Step folders are named `step-000042`, not hive-style `step=000042`: every row already
carries its `step` column, and a hive folder of the same name makes pandas and pyarrow
refuse to read the run as one data set (the folder's key and the column clash in type).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

MANIFEST = "manifest.json"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
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
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
        if self.config_path.exists():
            raise FileExistsError(f"run {self.run_id!r} already has a config at {self.config_path}")
        atomic_write_json(self.config_path, config)

    def read_config(self) -> dict[str, Any]:
        return json.loads(self.config_path.read_text())

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_json(self.summary_path, summary)

    def read_summary(self) -> dict[str, Any] | None:
        return json.loads(self.summary_path.read_text()) if self.summary_path.exists() else None

    # -- rollouts and metrics: append-only -------------------------------------------------------
    def write_rollouts(self, step: int, shard: int, table: pa.Table) -> Path:
        path = self.rollout_path(step, shard)
        if path.exists():
            raise FileExistsError(f"rollouts of step {step} shard {shard} are already logged at {path}")
        atomic_write_parquet(path, table)
        return path

    def read_rollouts(self, step: int | None = None, columns: list[str] | None = None) -> pa.Table:
        """Rollouts of one step (or of the whole run), ordered by step, group and sample."""
        source = self.rollout_dir(step) if step is not None else self.run_dir / "rollouts"
        if not source.exists():
            raise FileNotFoundError(f"run {self.run_id!r} has no rollouts" + (f" for step {step}" if step else ""))
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

    # -- checkpoints ----------------------------------------------------------------------------
    def staging_checkpoint_dir(self, step: int) -> Path:
        """An empty hidden folder to write a checkpoint into before `commit_checkpoint`."""
        parent = self.run_dir / "checkpoints"
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=parent, prefix=f".step-{step:06d}.", suffix=".tmp"))

    def commit_checkpoint(self, step: int, staging: Path, extra: dict[str, Any]) -> Path:
        """Write the manifest (file list with sizes and checksums) last, then rename into place."""
        files = {
            str(p.relative_to(staging)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
            for p in sorted(staging.rglob("*"))
            if p.is_file()
        }
        atomic_write_json(staging / MANIFEST, {"step": step, "files": files, **extra})
        final = self.checkpoint_dir(step)
        if final.exists():
            shutil.rmtree(staging)
            raise FileExistsError(f"checkpoint of step {step} already exists at {final}")
        os.replace(staging, final)
        return final

    def complete_checkpoints(self) -> list[int]:
        parent = self.run_dir / "checkpoints"
        return sorted(int(p.name.split("-")[1]) for p in parent.glob("step-*") if (p / MANIFEST).exists())


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
