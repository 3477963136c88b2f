"""Where a storage root is: a local folder (pathlib, today's fast path) or an fsspec URL (`s3://`, `gs://`,
`az://`, `file://`, `memory://`), as a `UPath` with pathlib's API over the URL's file system.

    root_path("grpo-storage")          # Path('/abs/grpo-storage')
    root_path("s3://bucket/grpo")      # S3Path('s3://bucket/grpo'), through s3fs
    local_root("s3://bucket/grpo")     # ~/.cache/grpo-flow/roots/<hash>: where workers write before upload

Credentials and endpoints come from where each client reads them (`AWS_ENDPOINT_URL`, `AWS_*`,
`FSSPEC_<PROTOCOL>_<KWARG>` variables, fsspec's config files), plus the run's `storage_options`
(`use_storage_options`), which go into fsspec's per-protocol defaults as pandas' `storage_options` would.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path
from typing import Any, cast

# Schemes whose client is an extra of grpo-flow (the others name their fsspec package).
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")


class StorageURLError(ValueError):
    """A storage root URL that cannot be used: its client is missing, or it cannot be reached. One line."""


def url_scheme(root: str | os.PathLike) -> str | None:
    """The scheme of a URL root (`s3`), or None for a local path (`file://` URLs included: they are local)."""
    match = _URL.match(str(root))
    scheme = match.group(1).lower() if match else None
    return None if scheme in (None, "file", "local") else scheme


def is_url(root: str | os.PathLike) -> bool:
    return url_scheme(root) is not None


def is_remote(path: Any) -> bool:
    """Whether a path from `root_path` (or one made from it) lives on a URL's file system, not on local disk."""
    return not isinstance(path, (Path, str))


def _local(root: str | os.PathLike) -> Path:
    text = str(root)
    for prefix in ("file://", "local://"):
        text = text.removeprefix(prefix)
    return Path(os.path.abspath(os.path.expanduser(text)))


def root_path(root: str | os.PathLike) -> Path:
    """The storage root as a path object: a `pathlib.Path` for a local folder; for a URL, a `UPath` (typed
    as Path: it has pathlib's API, but not `os` functions' -- RunStorage's writes tell the two apart)."""
    if not is_url(root):
        return _local(root)
    from upath import UPath

    client_for(str(root))
    return cast(Path, UPath(str(root), use_listings_cache=False))


def absolute_root(root: str | os.PathLike) -> str:
    """A storage root as a deployment or another folder must be given it: a local path made absolute, a
    URL as it is."""
    return str(root) if is_url(root) else str(_local(root))


def local_root(root: str | os.PathLike) -> Path:
    """A local folder that stands in for the root where a file must exist on disk first (what torch and
    transformers save before it is uploaded, a downloaded checkpoint, logs): the root itself when it is
    local, else a folder of the user's cache named by the URL's hash (never after the URL)."""
    if not is_url(root):
        return _local(root)
    return cache_root() / "roots" / hashlib.sha256(str(root).rstrip("/").encode()).hexdigest()[:16]


def models_root(root: str | os.PathLike) -> Path:
    """Where the models a run loads are kept on disk: `<root>/models`, or for a URL root the cache's
    `models/`, which every URL root shares (a model is loaded from local disk either way)."""
    return (cache_root() if is_url(root) else _local(root)) / "models"


def cache_root() -> Path:
    """$GRPO_FLOW_CACHE, else ~/.cache/grpo-flow."""
    return Path(os.environ.get("GRPO_FLOW_CACHE") or Path.home() / ".cache" / "grpo-flow")


def client_for(url: str) -> type:
    """The fsspec file system class of a URL's scheme; a missing client is a StorageURLError naming the extra."""
    import fsspec

    scheme = url_scheme(url) or "file"
    try:
        return cast(type, fsspec.get_filesystem_class(scheme))
    except ImportError:
        extra = EXTRAS.get(scheme)
        install = f"pip install 'grpo-flow[{extra}]'" if extra else "install the fsspec package for it"
        raise StorageURLError(f"{url!r}: no client for {scheme}:// is installed; {install}") from None
    except ValueError:
        raise StorageURLError(f"{url!r}: fsspec knows no file system for {scheme}://") from None


def use_storage_options(root: str | os.PathLike, options: dict[str, Any] | None) -> None:
    """The run's `storage_options` as fsspec's defaults for the root's scheme (in this process), so every
    reader and writer of the run, pandas and pyarrow included, reaches the store with them."""
    scheme = url_scheme(root)
    if scheme is None or not options:
        return
    import fsspec.config

    fsspec.config.conf.setdefault(scheme, {}).update(options)


@functools.cache  # once per process: the command line and the flow's start check both ask
def check_reachable(url: str, write: bool = True) -> None:
    """A URL root's store answers (and, with `write`, takes a write: a probe object is written under it and
    removed). An unreachable endpoint or bucket and missing or refused credentials are one StorageURLError
    naming the URL."""
    path = root_path(url)
    probe = path / f".grpo-flow-write-check-{os.getpid()}"
    try:
        if write:
            probe.write_bytes(b"grpo-flow\n")
            probe.unlink()
        else:
            path.fs.ls(path.parent.path)  # type: ignore[attr-defined]
    except Exception as error:  # botocore, aiohttp, google-auth: each client has its own types
        raise StorageURLError(f"{url!r} cannot be {'written' if write else 'read'}: {describe_error(error)}") from None


def reach_from_here(root: str, marker: str | None, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Whether this process (a probe on one node of a cluster) reaches a storage root: a URL's store
    answering a listing, with the run's `options`; a local root by the `marker` file the caller wrote in it.
    Returns the host and, when it cannot, why."""
    import socket

    problem = None
    if is_url(root):
        use_storage_options(root, options)
        try:
            check_reachable(root, write=False)
        except StorageURLError as error:
            problem = str(error)
    elif marker is not None and not Path(marker).is_file():
        problem = f"{root} is not there, or is another folder than the one this process wrote in"
    return {"host": socket.gethostname(), "problem": problem}


def describe_error(error: BaseException) -> str:
    """A client's error in one line (s3fs wraps botocore's: its text is kept, the traceback is not)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) < 300 else text[:297] + "..."
