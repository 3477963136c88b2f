"""The storage root: everything a run knows, as plain files (pyarrow only, no torch).

    <root>/runs/<run_id>/config.json                     frozen config of the run
    <root>/runs/<run_id>/resumes/resume-001.json         each resume: config in force, step, changes
    <root>/runs/<run_id>/rollouts/step-000042/shard-00.parquet
    <root>/runs/<run_id>/rollouts/step-000042/_manifest.json   each shard's size and sha256
    <root>/runs/<run_id>/metrics/step-000042.parquet
    <root>/runs/<run_id>/checkpoints/step-000040/        manifest.json written last = complete
    <root>/runs/<run_id>/eval/initial.json               held-out accuracy before RL
    <root>/runs/<run_id>/quarantine/                     damaged files moved aside, never deleted
    <root>/runs/<run_id>/summary.json
    <root>/runs/<run_id>/writer.lock                     who writes the run now (a URL root: writer.lock/<generation>; lock.py)
    <root>/models/<name>/                                models the project builds itself

Every file is written to a temporary name in its own folder and renamed into place, so a
reader never sees a partial file. A step's rollout shards are written into a hidden staging
folder and the folder is renamed into place once every shard is there, so a step's rollouts
are all logged or not at all; its `_manifest.json` (each shard's size and sha256) is written
into the staging folder last, so a committed step always has one. Logged rollouts and metrics
are never overwritten.

Checking a step against its manifest comes in two strengths: sizes only (a stat per shard:
`grpo runs`, every read of a step, and the steps before a resume's checkpoint) and sizes plus
sha256 (`grpo verify`, `grpo rollouts`, and the steps a resume replays). A truncated file, the
common damage, is caught by either; bit rot of the same size only by the checksum, which reads
every byte and is kept off the paths that must stay fast on a long run.

Temporary files are named `.<name>.w<pid>@<host>.<random>.tmp`, so a later start can tell a
killed writer's leftover (its pid is gone) from a live writer's (`clean_stale_temps`).

The leading underscore of `_manifest.json` keeps it out of pyarrow's and pandas' data set
discovery (they skip names starting with `_` or `.`), so `pd.read_parquet(<run>/rollouts)`
still reads only the shards.

On an object store (a URL root: `s3://`, `gs://`, `memory://`, ...; workers/state/location.py)
there is no rename, so a commit is a marker written last: every file of a step or checkpoint is
written at its final key (a PUT is whole or absent), then its manifest; a step or checkpoint
folder without its manifest is not committed, is skipped by every reader, and is removed by the
run's next writer (`discard_staging`). Torch and transformers write a checkpoint into a local
folder first (`staging_checkpoint_dir`, under `location.local_root`), which the commit uploads.

The writer commits what it wrote: the actor, wherever it runs, writes and commits its checkpoint
under the run's storage as it sees it (`write_checkpoint`); the flow only checks the manifest.

Step folders are named `step-000042`, not hive-style `step=000042`: every row already
carries its `step` column, and a hive folder of the same name makes pandas and pyarrow
refuse to read the run as one data set (the folder's key and the column clash in type).
"""

from __future__ import annotations

import errno
import hashlib
import functools
import json
import math
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from grpo_flow.workers.state.faults import maybe_fail
from grpo_flow.workers.state.location import is_remote, is_url, local_root, root_path
from grpo_flow.workers.state.lock import live_holder, pid_alive, this_host

if TYPE_CHECKING:
    from grpo_flow.schemas.config import GRPOFlowConfig
    from grpo_flow.schemas.records import RunPlan

MANIFEST = "manifest.json"
STEP_MANIFEST = "_manifest.json"
BUILD_INFO = "build_info.json"
EVAL_METADATA_KEY = b"grpo_flow.eval"
# A temporary file whose writer cannot be told alive (written on another host, or named before
# names carried the writer) is a leftover once it is this old; no write of a run takes a day.
STALE_TEMP_AGE_S = 24 * 3600
logger = logging.getLogger("grpo_flow.storage")


class StorageFullError(OSError):
    """The disk filled up during a write; the partial file was removed, nothing else changed."""


class DamagedCheckpointError(RuntimeError):
    """A checkpoint's manifest is missing, or its files do not match the manifest."""


class DamagedStepError(ValueError):
    """A logged step's rollout files do not match its manifest (or cannot be read); names each file."""


class DamagedRunFileError(ValueError):
    """config.json, run.json or a resume record that cannot be read: names the file, in one line."""


def read_run_file(path: Path) -> dict[str, Any]:
    """A run's JSON record (config.json, run.json, resumes/resume-NNN.json) as a dict; a damaged one is a
    DamagedRunFileError naming it, not a JSONDecodeError traceback."""
    try:
        record = json.loads(path.read_bytes())
    except (OSError, ValueError) as error:  # unreadable, not UTF-8, not JSON
        raise DamagedRunFileError(f"{path}: unreadable ({' '.join(str(error).split())})") from None
    if not isinstance(record, dict):
        raise DamagedRunFileError(f"{path}: unreadable (a JSON {type(record).__name__}, not an object)")
    return record


def _explain_write_error(path: Path, error: OSError) -> OSError:
    if is_disk_full(error):
        return StorageFullError(error.errno, f"no space left on the device while writing {path}; nothing was logged")
    return error


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC or EDQUOT, as an OSError or inside another library's error (safetensors' SafetensorError
    says `No space left on device (os error 28)`; torch.save's RuntimeError says the same)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    return any(marker in text for marker in ("No space left on device", "Disk quota exceeded", "os error 28"))


# -- temporary files ---------------------------------------------------------------------------------
_TEMP_WRITER = re.compile(r"\.w(\d+)@([A-Za-z0-9-]+)\.[^.]*\.tmp$")


def temp_prefix(name: str) -> str:
    """`.<name>.w<pid>@<host>.`: the prefix of a temporary file or folder this process writes for `name`
    (give it to mkstemp / mkdtemp with suffix `.tmp`)."""
    return f".{name}.w{os.getpid()}@{this_host()}."


def is_stale_temp(path: Path, now: float | None = None) -> bool:
    """Whether a temporary file or folder is a killed writer's leftover: its writer's pid is gone (on
    this host), or, where that cannot be told, it has not changed for STALE_TEMP_AGE_S."""
    match = _TEMP_WRITER.search(path.name)
    if match and match.group(2) == this_host():
        return not pid_alive(int(match.group(1)))
    try:
        changed = max(
            [path.stat().st_mtime] + [p.stat().st_mtime for p in path.rglob("*")]
            if path.is_dir()
            else [path.stat().st_mtime]
        )
    except OSError:
        return False
    return (time.time() if now is None else now) - changed > STALE_TEMP_AGE_S


def clean_stale_temps(folders: Iterable[Path]) -> list[Path]:
    """Remove the stale temporary files and folders (`.*.tmp`) directly in `folders`; returns them."""
    removed = []
    for folder in folders:
        for path in folder.glob(".*.tmp"):
            if not is_stale_temp(path):
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
            logger.info("removed %s, left by a writer that is gone", path)
    return removed


@functools.cache
def default_modes() -> tuple[int, int]:
    """(file mode, folder mode) that `open()` and `mkdir()` give under this process's umask. Temporary
    files and folders are made private (0600, 0700); what is renamed into place gets these instead, so a
    run on shared storage is readable by whoever the umask lets read it."""
    mask = None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                mask = int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    if mask is None:  # no /proc: read it by setting it (not thread-safe, so once per process)
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask, 0o777 & ~mask


def atomic_write(path: Path, write: Callable[[Path], None], exclusive: bool = False) -> Path:
    """`write(temporary path)`, then the file renamed into place: a reader sees the whole file or none.
    `exclusive`: never replace a file already there (FileExistsError), even when two writers race. Every
    atomic file of a run goes through here. On an object store the file is written locally, then put at
    its key (a PUT is whole or absent; `exclusive` is the store's conditional create)."""
    if is_remote(path):
        return _put_remote(path, write, exclusive)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path.name), suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, default_modes()[0])
        if not exclusive:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if `path` exists, atomically
            except FileExistsError:
                raise
            except OSError:  # a file system without hard links: check, then rename (a narrow race)
                if path.exists():
                    raise FileExistsError(path) from None
                os.replace(tmp, path)
    except FileExistsError:
        raise
    except OSError as error:
        raise _explain_write_error(path, error) from error
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _put_remote(path: Path, write: Callable[[Path], None], exclusive: bool) -> Path:
    with tempfile.TemporaryDirectory(prefix=".grpo-flow-upload-") as folder:
        tmp = Path(folder) / path.name
        write(tmp)
        fs, key = remote_fs(path), remote_key(path)
        if exclusive:
            with open(tmp, "rb") as source, fs.open(key, "xb") as target:
                shutil.copyfileobj(source, target)
        else:
            fs.put_file(str(tmp), key)
    return path


def remote_fs(path: Path) -> Any:
    """The fsspec file system of a path from `root_path` on a URL."""
    return path.fs  # type: ignore[attr-defined]


def remote_key(path: Path) -> str:
    """The path as its fsspec file system names it (`bucket/runs/x/...`)."""
    return str(path.path)  # type: ignore[attr-defined]


def arrow_source(path: Path) -> Any:
    """What pyarrow reads `path` from: the file, or on a URL its bytes, fetched here by fsspec. pyarrow
    reading through an fsspec file system calls Python from its I/O threads, and threads still at it when
    the interpreter exits abort the process (apache/arrow#39162: `grpo rollouts` on s3:// often did)."""
    return pa.BufferReader(remote_fs(path).cat_file(remote_key(path))) if is_remote(path) else path


def read_parquet(path: Path, columns: list[str] | None = None) -> pa.Table:
    """A Parquet file; with `columns`, those of them it has. Read on this thread: a buffer of Python's
    bytes released on one of pyarrow's threads at exit aborts the process as well."""
    file = pq.ParquetFile(arrow_source(path))
    if columns is not None:
        columns = [name for name in columns if name in file.schema_arrow.names]
    return file.read(columns=columns, use_threads=False)


def parquet_schema(path: Path) -> pa.Schema:
    """A Parquet file's schema, with its metadata, read from its footer (on a URL too)."""
    if not is_remote(path):
        return pq.read_schema(path)
    with remote_fs(path).open(remote_key(path), "rb") as file:
        return pq.ParquetFile(file).schema_arrow


def remove_tree(path: Path, marker: str | None = None) -> None:
    """Remove a folder (on an object store: every object under its prefix, `marker` first, so a folder
    half removed is no longer committed)."""
    if not is_remote(path):
        shutil.rmtree(path)
        return
    fs = remote_fs(path)
    if marker is not None and (path / marker).exists():
        fs.rm(remote_key(path / marker))
    if fs.exists(remote_key(path)):
        fs.rm(remote_key(path), recursive=True)


def move(path: Path, target: Path) -> None:
    """Rename a file or folder (on an object store: copy, then delete, object by object: s3fs's recursive
    copy also copies the folder's own key, which S3 does not have)."""
    if is_remote(path):
        fs, source, destination = remote_fs(path), remote_key(path), remote_key(target)
        for key in fs.find(source) if fs.isdir(source) else [source]:
            fs.mv(key, destination + key[len(source) :])
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, target)


def atomic_folder(final: Path, write: Callable[[Path], None]) -> bool:
    """`write(staging folder)`, then the folder renamed into place; False (nothing written) if it is there
    already, or another writer put it there meanwhile (a retried call, or another process building the same
    folder: the same content)."""
    if final.exists():
        return False
    staging = staging_folder(final.parent, final.name)
    try:
        write(staging)
        give_default_modes(staging)  # libraries write some files private (safetensors: 0600)
        os.replace(staging, final)
    except OSError:
        if final.exists():
            return False
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True


def build_once(final: Path, build: Callable[[Path], dict[str, Any]]) -> Path:
    """The folder `final`, built the first time by `build(staging folder)`, whose returned build info is
    written beside what it built as build_info.json; builds killed midway (their pid is in the staging
    folder's name) are removed first."""
    if final.parent.is_dir():
        clean_stale_temps([final.parent])

    def write(staging: Path) -> None:
        (staging / BUILD_INFO).write_text(json.dumps(build(staging), indent=2))

    atomic_folder(final, write)
    return final


def give_default_modes(folder: Path) -> None:
    """`folder` and everything in it to the umask's modes (`default_modes`), before it is renamed into
    place: libraries write some files private whatever the umask (safetensors' `save_file`: 0600), which
    teammates, a web server or Ray workers of another user could then not read on shared storage."""
    file_mode, folder_mode = default_modes()
    os.chmod(folder, folder_mode)
    for root, folders, files in os.walk(folder):
        for name, mode in [(name, folder_mode) for name in folders] + [(name, file_mode) for name in files]:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, mode)


def staging_folder(parent: Path, name: str) -> Path:
    """An empty hidden folder in `parent` to write `name` into before renaming it (with the umask's mode)."""
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=parent, prefix=temp_prefix(name), suffix=".tmp"))
    os.chmod(staging, default_modes()[1])
    return staging


def atomic_write_bytes(path: Path, data: bytes) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())

    atomic_write(path, write)


def finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def atomic_write_json(path: Path, payload: Any) -> None:
    atomic_write_bytes(path, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode())


def atomic_write_parquet(path: Path, table: pa.Table) -> None:
    atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with (path if is_remote(path) else Path(path)).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_manifest(folder: Path, pattern: str = "*") -> dict[str, dict[str, Any]]:
    """Every file under `folder` matching `pattern`, by relative path: its size and sha256 (a
    checkpoint manifest's `files`, a step manifest's shards)."""
    return {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(folder.rglob(pattern))
        if p.is_file()
    }


def file_matches(path: Path, expected: dict[str, Any]) -> bool:
    """Whether `path` is a file with the size and sha256 a manifest entry gives."""
    return path.is_file() and path.stat().st_size == expected["bytes"] and file_sha256(path) == expected["sha256"]


def read_eval_summary(path: str | os.PathLike) -> dict[str, Any]:
    """The summary stored in an eval file's schema metadata (flows/evaluate.py writes them)."""
    metadata = parquet_schema(path if is_remote(path) else Path(path)).metadata or {}  # type: ignore[arg-type]
    if EVAL_METADATA_KEY not in metadata:
        raise ValueError(f"{path} has no {EVAL_METADATA_KEY.decode()} metadata")
    return json.loads(metadata[EVAL_METADATA_KEY])


def eval_metric_names(summary: dict[str, Any]) -> list[str]:
    """The measured figures of an eval summary, in display order."""
    passes = sorted((k for k in summary if k.startswith("pass@")), key=lambda k: int(k.split("@")[1]))
    return passes + [k for k in ("greedy_accuracy", "mean_reward", "mean_completion_length") if k in summary]


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    status: str  # completed, failed or incomplete as summary.json says; running while a writer holds the lock
    last_step: int | None
    path: Path
    damaged: tuple[str, ...] = ()  # files of logged steps that fail the size check, as "<file>: <why>"
    writer: dict[str, Any] | None = None  # the live holder of the run's writer lock


class RunStorage:
    """Paths and atomic reads/writes for one run under a storage root: a local folder, or a URL whose
    paths are `UPath`s (pathlib's API; `is_remote` tells them apart where the writes differ)."""

    def __init__(self, root: str | os.PathLike, run_id: str):
        self.remote = is_url(root)
        self.root = root_path(root)
        self.run_id = run_id
        self.run_dir = self.root / "runs" / run_id
        # Where files are written before upload and checkpoints downloaded to: the run folder itself locally.
        self.local_run_dir = local_root(root) / "runs" / run_id if self.remote else self.run_dir

    @classmethod
    def of(cls, run: RunPlan | GRPOFlowConfig) -> RunStorage:
        """A run's storage from its plan or config (a config without a run_id: the root's runs folder)."""
        return cls(run.storage_root, run.run_id or "")

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
    def write_config(self, config: dict[str, Any], mode: str = "grpo", dataset_sha256: str | None = None) -> None:
        """Create the run: its identity (run.json, a fresh uid, the loop that trains it: `grpo`, or
        `simple` for TRL's own, and the fingerprint of a local data file) and its frozen config."""
        if self.config_path.exists():
            raise FileExistsError(f"run {self.run_id!r} already has a config at {self.config_path}")
        identity = {"run_id": self.run_id, "uid": uuid.uuid4().hex, "mode": mode}
        if dataset_sha256 is not None:
            identity["dataset_sha256"] = dataset_sha256
        atomic_write_json(self.run_dir / "run.json", identity)
        atomic_write_json(self.config_path, config)

    def run_uid(self) -> str:
        return read_run_file(self.run_dir / "run.json")["uid"]

    def run_mode(self) -> str:
        """`grpo` (grpo-flow's loop, resumable) or `simple` (TRL's loop, which does not resume)."""
        return str(read_run_file(self.run_dir / "run.json").get("mode", "grpo"))

    def resume_count(self) -> int:
        return len(list((self.run_dir / "resumes").glob("resume-*.json")))

    def read_config(self) -> dict[str, Any]:
        return read_run_file(self.config_path)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """As strict JSON: a figure that was not measured (NaN: no evaluation) is `null`, which every JSON
        parser reads (Python's json writes NaN, which JavaScript's and jq's refuse)."""
        atomic_write_json(self.summary_path, {key: finite_or_none(value) for key, value in summary.items()})

    def read_summary(self) -> dict[str, Any] | None:
        """The last session's summary; None when there is none, or it cannot be read (it is a report,
        written again at the end of every session: `list_runs` names it damaged meanwhile)."""
        try:
            summary = json.loads(self.summary_path.read_text())
        except (OSError, ValueError):  # none yet; unreadable, not UTF-8, not JSON
            return None
        return summary if isinstance(summary, dict) else None

    # -- rollouts and metrics: append-only -------------------------------------------------------
    def staging_rollout_dir(self, step: int) -> Path:
        # Hidden (leading dot): pyarrow's dataset discovery skips it, so readers never see a partial step.
        # On an object store shards go to their final keys: the step's manifest is the commit.
        return self.rollout_dir(step) if self.remote else self.run_dir / "rollouts" / f".step-{step:06d}.staging"

    def rollouts_committed(self, step: int) -> bool:
        if self.remote:
            return (self.rollout_dir(step) / STEP_MANIFEST).exists()
        return self.rollout_dir(step).exists()

    def write_rollouts(self, step: int, shard: int, table: pa.Table) -> Path:
        """Stage one shard of a step; `commit_rollouts` publishes the step once every shard is staged."""
        if self.rollouts_committed(step):
            raise FileExistsError(f"rollouts of step {step} are already logged at {self.rollout_dir(step)}")
        path = self.staging_rollout_dir(step) / f"shard-{shard:02d}.parquet"
        atomic_write_parquet(path, table)  # a retried shard replaces its own staged file
        return path

    def commit_rollouts(self, step: int, num_shards: int) -> Path:
        """Write the step's manifest (each shard's size and sha256) into its staging folder, then rename
        the folder into place: the step is logged whole, or not at all."""
        staging, final = self.staging_rollout_dir(step), self.rollout_dir(step)
        if self.rollouts_committed(step):
            raise FileExistsError(f"rollouts of step {step} are already logged at {final}")
        missing = [s for s in range(num_shards) if not (staging / f"shard-{s:02d}.parquet").exists()]
        if missing:
            raise FileNotFoundError(f"rollouts of step {step}: shards {missing} were never written")
        files = file_manifest(staging, "shard-*.parquet")
        atomic_write_json(staging / STEP_MANIFEST, {"step": step, "files": files})
        if not self.remote:
            os.replace(staging, final)
        return final

    def rollout_steps(self) -> list[int]:
        """Steps whose rollouts are logged (committed)."""
        if self.remote:
            return sorted(int(p.parent.name.split("-")[1]) for p in self._glob("rollouts", "step-*/" + STEP_MANIFEST))
        return sorted(int(p.name.split("-")[1]) for p in (self.run_dir / "rollouts").glob("step-*") if p.is_dir())

    def relative(self, path: Path) -> str:
        """A path as messages name it: relative to the run folder."""
        try:
            return str(path.relative_to(self.run_dir))
        except ValueError:
            return str(path)

    def step_problems(self, step: int, checksums: bool = True) -> list[str]:
        """What is wrong with a logged step's rollout files, one `<file>: <why>` each (empty: intact).

        Against the step's manifest: every shard it lists is there with its size (and, with
        `checksums`, its sha256), and no other shard is. A step logged before steps had manifests
        is read in full instead when `checksums` is asked for (there is nothing to compare sizes with).
        """
        folder = self.rollout_dir(step)
        try:
            entries = self._sizes(folder)
        except FileNotFoundError:
            return [f"{self.relative(folder)}: missing"]
        shards = sorted(name for name in entries if name.startswith("shard-") and name.endswith(".parquet"))
        if STEP_MANIFEST not in entries:
            if not shards:
                return [f"{self.relative(folder)}: no shard files and no {STEP_MANIFEST}"]
            return (
                [problem for name in shards for problem in self._parquet_problems(folder / name)] if checksums else []
            )
        try:
            files = json.loads((folder / STEP_MANIFEST).read_bytes())["files"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            return [f"{self.relative(folder / STEP_MANIFEST)}: unreadable ({error})"]
        problems = []
        for name, expected in files.items():
            size = entries.get(name)
            if size is None:
                problems.append(f"{self.relative(folder / name)}: missing")
                continue
            if size != expected["bytes"]:
                problems.append(f"{self.relative(folder / name)}: {size} bytes, its manifest says {expected['bytes']}")
            elif checksums and file_sha256(folder / name) != expected["sha256"]:
                problems.append(f"{self.relative(folder / name)}: does not match its sha256 in {STEP_MANIFEST}")
        problems += [
            f"{self.relative(folder / n)}: not in the step's {STEP_MANIFEST}" for n in shards if n not in files
        ]
        return problems

    def _sizes(self, folder: Path) -> dict[str, int]:
        """Each file in `folder` by name, with its size: one listing (os.scandir locally, a LIST on a store),
        as `grpo runs` and a resume check every step of a run."""
        if self.remote:
            fs = remote_fs(folder)
            listing = fs.ls(remote_key(folder), detail=True)
            if not listing:
                raise FileNotFoundError(folder)
            return {info["name"].rstrip("/").rsplit("/", 1)[-1]: int(info.get("size") or 0) for info in listing}
        return {entry.name: entry.stat().st_size for entry in os.scandir(folder)}

    def _glob(self, folder: str, pattern: str) -> list[Path]:
        return sorted((self.run_dir / folder).glob(pattern))

    def _parquet_problems(self, path: Path) -> list[str]:
        try:
            read_parquet(path)
        except Exception as error:  # pyarrow raises several types for damaged files
            return [f"{self.relative(path)}: unreadable Parquet ({error})"]
        return []

    def check_rollouts(self, step: int, checksums: bool = True) -> None:
        """Raise DamagedStepError naming each damaged file of the step (see `step_problems`)."""
        problems = self.step_problems(step, checksums)
        if problems:
            raise DamagedStepError(f"rollouts of step {step} are damaged: " + "; ".join(problems))

    def quarantine(self, path: Path, reason: str, log: bool = True) -> Path:
        """Move a damaged file or folder aside (never delete what was logged) and say so (unless the
        caller says it itself)."""
        target = self.run_dir / "quarantine" / f"{path.parent.name}-{path.name}"
        counter = 1
        while target.exists():
            counter += 1
            target = target.with_name(f"{path.parent.name}-{path.name}.{counter}")
        move(path, target)
        if log:
            logger.warning("%s: %s; moved to %s", path, reason, target)
        return target

    def quarantined(self) -> list[str]:
        """What was moved to quarantine/, by name (e.g. `rollouts-step-000020`)."""
        folder = self.run_dir / "quarantine"
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    def discard_staging(self) -> list[Path]:
        """Remove staging folders a killed process left behind (never logged, so nothing is lost).

        Only the run's writer calls this (it holds the run's lock), so no live process is still
        filling them; a folder restored from a backup is discarded the same way.
        """
        leftovers = self.uncommitted()
        for path in leftovers:
            if is_remote(path):
                remove_tree(path)
            else:
                shutil.rmtree(path, ignore_errors=True)
        return leftovers

    def uncommitted(self) -> list[Path]:
        """What writers left that was never committed: staging folders, and on an object store the step and
        checkpoint folders without the manifest written last."""
        found = [
            *(self.local_run_dir / "rollouts").glob(".step-*.staging"),
            *(self.local_run_dir / "checkpoints").glob(".step-*.tmp"),
        ]
        if self.remote:
            steps, checkpoints = set(self.rollout_steps()), set(self.complete_checkpoints())
            found += [p for p in self._glob("rollouts", "step-*") if int(p.name.split("-")[1]) not in steps]
            found += [p for p in self._glob("checkpoints", "step-*") if int(p.name.split("-")[1]) not in checkpoints]
        return found

    def clean_temps(self) -> list[Path]:
        """Remove killed writers' temporary files in the run folder (`clean_stale_temps`): the run
        folder, each folder in it, and the weight-sync folders; committed step and checkpoint
        folders are renamed into place whole, so none is inside them."""
        if self.remote or not self.run_dir.is_dir():  # an object store has no temporary names
            return []
        folders = [self.run_dir] + [p for p in self.run_dir.iterdir() if p.is_dir() and p.name != "quarantine"]
        weights = self.run_dir / "weights"
        if weights.is_dir():
            folders += [p for p in weights.iterdir() if p.is_dir() and not p.name.startswith(".")]
        return clean_stale_temps(folders)

    def read_rollouts(self, step: int | None = None, columns: list[str] | None = None) -> pa.Table:
        """Rollouts of one step (or of the whole run), ordered by step, group and sample.

        Every step read is checked against its manifest's sizes first. One step that fails raises
        DamagedStepError naming the file; reading the whole run skips a damaged step with a warning.
        """
        source = self.rollout_dir(step) if step is not None else self.run_dir / "rollouts"
        if not source.exists():
            raise FileNotFoundError(f"run {self.run_id!r} has no rollouts" + (f" for step {step}" if step else ""))
        import pyarrow.dataset as ds  # here, not at the top: it imports pandas, a second of `grpo runs`

        if step is not None:
            self.check_rollouts(step, checksums=False)
            steps = [step]
        else:
            steps = []
            for logged in self.rollout_steps():
                problems = self.step_problems(logged, checksums=False)
                if problems:
                    logger.warning(
                        "run %s: skipping step %d, its rollouts are damaged (%s); `grpo verify %s` moves it aside",
                        self.run_id,
                        logged,
                        "; ".join(problems),
                        self.run_id,
                    )
                    continue
                steps.append(logged)
        paths = [p for s in steps for p in sorted(self.rollout_dir(s).glob("shard-*.parquet"))]
        if not paths:
            return pa.table({})
        if self.remote:  # each file's bytes, fetched here (`arrow_source`)
            table = pa.concat_tables([read_parquet(p, columns) for p in paths], promote_options="default")
        else:
            table = ds.dataset([str(p) for p in paths], format="parquet").to_table(columns=columns)
        sort_keys = [(k, "ascending") for k in ("step", "group_index", "sample_index") if k in table.column_names]
        return table.sort_by(sort_keys) if sort_keys else table

    def write_metrics(self, step: int, table: pa.Table) -> Path:
        path = self.metrics_path(step)
        if path.exists():
            raise FileExistsError(f"metrics of step {step} are already logged at {path}")
        atomic_write_parquet(path, table)
        return path

    def read_metrics(self) -> pa.Table:
        """All metric rows of the run; columns that appear only at some steps are null elsewhere.
        A metrics file that cannot be read is skipped with a warning (`grpo verify` names it)."""
        tables = []
        for path in sorted((self.run_dir / "metrics").glob("step-*.parquet")):
            try:
                tables.append(read_parquet(path))
            except Exception as error:  # pyarrow raises several types for damaged files
                logger.warning("run %s: skipping %s, it cannot be read: %s", self.run_id, self.relative(path), error)
        if not tables:
            return pa.table({})
        return pa.concat_tables(tables, promote_options="default").sort_by("step")

    def logged_steps(self) -> list[int]:
        return sorted(int(p.stem.split("-")[1]) for p in (self.run_dir / "metrics").glob("step-*.parquet"))

    def read_step_metrics(self, step: int) -> dict[str, Any]:
        return read_parquet(self.metrics_path(step)).to_pylist()[0]

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
            record = read_run_file(resumes[-1])
            if not isinstance(record.get("config"), dict):
                raise DamagedRunFileError(f"{resumes[-1]}: unreadable (it holds no config)")
            return record["config"]
        return self.read_config()

    @property
    def initial_eval_path(self) -> Path:
        return self.run_dir / "eval" / "initial.json"

    def write_initial_eval(self, accuracy: float) -> None:
        if not self.initial_eval_path.exists():
            atomic_write_json(self.initial_eval_path, {"accuracy": accuracy})

    def eval_path(self, step: int) -> Path:
        """The evaluation of checkpoint `step` (flows/evaluate.py): written once, never overwritten."""
        return self.run_dir / "eval" / f"step-{step:06d}.parquet"

    def evaluated_steps(self) -> list[int]:
        """Checkpoint steps that have an eval file."""
        return sorted(int(p.stem.split("-")[1]) for p in (self.run_dir / "eval").glob("step-*.parquet"))

    def stored_evaluation(self, checkpoint: int | None = None) -> dict[str, Any] | None:
        """The stored evaluation summary of checkpoint `checkpoint`, or of the newest checkpoint whose
        files have their manifest's sizes (no checksums: hashing a large model's optimizer state takes
        long); None if it has none, or its file cannot be read."""
        if checkpoint is None:
            for step in reversed(self.checkpoint_steps()):
                try:
                    self.verify_checkpoint(step, checksums=False)
                except DamagedCheckpointError:
                    continue
                checkpoint = step
                break
        if checkpoint is None or not self.eval_path(checkpoint).exists():
            return None
        try:
            return read_eval_summary(self.eval_path(checkpoint))
        except Exception:  # unreadable: evaluate as if there were none
            return None

    def read_initial_eval(self) -> float | None:
        if not self.initial_eval_path.exists():
            return None
        return json.loads(self.initial_eval_path.read_text())["accuracy"]

    # -- checkpoints ----------------------------------------------------------------------------
    def staging_checkpoint_dir(self, step: int) -> Path:
        """An empty hidden local folder to write a checkpoint into before `commit_checkpoint` (`write_checkpoint`)."""
        return staging_folder(self.local_run_dir / "checkpoints", f"step-{step:06d}")

    def checkpoint_committed(self, step: int) -> bool:
        return (self.checkpoint_dir(step) / MANIFEST).exists()

    def write_checkpoint(self, step: int, write: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
        """Checkpoint `step` written at its final place under this storage and committed, by its writer (the
        actor, wherever it runs): `write(folder)` fills a local staging folder (beside the final one on a
        local or shared root; under `local_run_dir` on an object store) and returns the manifest's extra
        fields; `commit_checkpoint` then renames it into place, or puts each file at its final key and the
        manifest last. Nothing half-written stays behind. Returns the manifest; a checkpoint committed
        already (a retried call) is answered with its manifest, after a size check."""
        if self.checkpoint_committed(step):
            return self.verify_checkpoint(step, checksums=False)
        staging = self.staging_checkpoint_dir(step)
        try:
            started = time.perf_counter()
            extra = write(staging)
            maybe_fail("checkpoint", step)
            extra["write_seconds"] = time.perf_counter() - started
            self.commit_checkpoint(step, staging, extra)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return self.verify_checkpoint(step, checksums=False)

    def commit_checkpoint(self, step: int, staging: Path, extra: dict[str, Any]) -> Path:
        """Write the manifest (file list with sizes and checksums) last, then rename into place; on an
        object store, upload every file to its final key, then the manifest."""
        manifest = {"step": step, "files": file_manifest(staging), **extra}
        final = self.checkpoint_dir(step)
        if self.checkpoint_committed(step) or (not self.remote and final.exists()):
            shutil.rmtree(staging)
            raise FileExistsError(f"checkpoint of step {step} already exists at {final}")
        if self.remote:
            remove_tree(final)  # what an upload killed midway left (never committed)
            fs = remote_fs(final)
            for name in manifest["files"]:
                fs.put_file(str(staging / name), remote_key(final / name))
            atomic_write_json(final / MANIFEST, manifest)
            shutil.rmtree(staging)
            return final
        atomic_write_json(staging / MANIFEST, manifest)
        give_default_modes(staging)  # torch and safetensors wrote into it
        os.replace(staging, final)
        return final

    def local_checkpoint(self, step: int) -> Path:
        """The checkpoint as a local folder (what torch and transformers load): the checkpoint itself on a
        local root; on an object store, a copy under `local_run_dir`, downloaded once per manifest."""
        final = self.checkpoint_dir(step)
        if not self.remote:
            return final
        manifest = (final / MANIFEST).read_bytes()
        local = self.local_run_dir / "checkpoints" / final.name
        if (local / MANIFEST).is_file() and (local / MANIFEST).read_bytes() == manifest:
            return local
        if local.exists():
            shutil.rmtree(local)  # the copy of a checkpoint of this step committed before this one

        def download(staging: Path) -> None:
            for name in json.loads(manifest)["files"]:
                (staging / name).parent.mkdir(parents=True, exist_ok=True)
                remote_fs(final).get_file(remote_key(final / name), str(staging / name))
            (staging / MANIFEST).write_bytes(manifest)

        atomic_folder(local, download)
        return local

    def complete_checkpoints(self) -> list[int]:
        return sorted(int(p.parent.name.split("-")[1]) for p in self._glob("checkpoints", "step-*/" + MANIFEST))

    def checkpoint_steps(self) -> list[int]:
        """Every checkpoint folder in place, complete or not (on an object store, a folder without its
        manifest is not a checkpoint: `uncommitted`)."""
        if self.remote:
            return self.complete_checkpoints()
        return sorted(int(p.name.split("-")[1]) for p in (self.run_dir / "checkpoints").glob("step-*") if p.is_dir())

    def verify_checkpoint(self, step: int, checksums: bool = True) -> dict[str, Any]:
        """The manifest, after checking every file it lists (size, and sha256 unless `checksums` is
        False); raises DamagedCheckpointError."""
        folder = self.checkpoint_dir(step)
        if not (folder / MANIFEST).exists():
            raise DamagedCheckpointError(f"checkpoint {folder} has no {MANIFEST}")
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            files = manifest["files"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise DamagedCheckpointError(f"checkpoint {folder}: {MANIFEST} is unreadable ({error})") from None
        for name, expected in files.items():
            path = folder / name
            if not path.exists():
                raise DamagedCheckpointError(f"checkpoint {folder}: {name} is missing")
            if path.stat().st_size != expected["bytes"]:
                raise DamagedCheckpointError(
                    f"checkpoint {folder}: {name} is {path.stat().st_size} bytes, its manifest says {expected['bytes']}"
                )
            if checksums and not file_matches(path, expected):
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
            remove_tree(self.checkpoint_dir(step), MANIFEST)
            removed.append(step)
        return removed


def list_runs(root: str | os.PathLike, check: bool = True) -> list[RunInfo]:
    """Every run under the root with its status (`completed`, `failed`, `incomplete`, or `running`
    while a live process holds its writer lock) and last step; with `check`, each logged step's
    shards against its manifest's sizes (a stat per file: fast on a long run; `grpo verify` reads
    every byte)."""
    runs = []
    for run_dir in sorted((root_path(root) / "runs").glob("*")):
        if not (run_dir / "config.json").exists():
            continue
        storage = RunStorage(root, run_dir.name)
        steps = storage.logged_steps()
        summary = storage.read_summary() or {}
        writer = live_holder(run_dir)
        damaged = (
            [p for s in storage.rollout_steps() for p in storage.step_problems(s, checksums=False)] if check else []
        )
        if not summary and storage.summary_path.exists():
            damaged.append(f"{storage.relative(storage.summary_path)}: unreadable (not a JSON object)")
        runs.append(
            RunInfo(
                run_id=run_dir.name,
                status="running" if writer else summary.get("status", "incomplete"),
                last_step=steps[-1] if steps else None,
                path=run_dir,
                damaged=tuple(damaged),
                writer=writer,
            )
        )
    return runs
