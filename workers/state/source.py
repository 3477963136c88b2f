"""grpo-flow's own code, for interpreters that do not import it from this one: a vLLM
environment's engine process, Ray workers, Modal containers.

In a source checkout `grpo_flow/` holds links to the repository's top-level folders; in an
installed wheel they are folders under it. `package_files` names the real files either way,
and `stage_package` lays out a `grpo_flow` package holding only the parts asked for.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def package_files(parts: Iterable[str]) -> dict[str, Path]:
    """{path inside a folder on sys.path: the real file or folder}: `grpo_flow/__init__.py` and each part."""
    import grpo_flow

    init = Path(grpo_flow.__file__)
    files = {"grpo_flow/__init__.py": init.resolve()}
    for part in parts:
        files[f"grpo_flow/{part}"] = (init.parent / part).resolve()
    return files


def stage_package(folder: Path | str, parts: Iterable[str]) -> Path:
    """`folder/grpo_flow/` with links to `__init__.py` and the given subpackages; put `folder` on sys.path."""
    folder = Path(folder)
    for relative, real in package_files(parts).items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(real, folder / relative)
    return folder
