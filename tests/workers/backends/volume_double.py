"""A Modal Volume test double: folders on this machine that behave as Modal's docs say a Volume does.

Modal's guide (https://modal.com/docs/guide/volumes, "Volume commits and reloads") and `modal.Volume`'s
docstring state the semantics this double keeps:

- At container creation time the latest committed state of the Volume is mounted (`mount`: the
  container gets a folder of its own, a copy of that state).
- What a container writes stays in its own view until it calls `commit()`; another container sees it
  only after that commit and its own `reload()`, which fetches the latest committed state.
- Concurrent modification is allowed; the last commit wins, file by file: a commit publishes the
  files its container added, changed or removed since it mounted or last reloaded, and leaves others'.
- From outside a container (the user's machine) the Volume is read and changed through the client:
  `listdir`, `read_file` (chunks), `remove_file(path, recursive=...)`, each on the committed state.

Not kept: the limit on files, `reload()`'s refusal while files are open, background commits (a
container that ends commits what it wrote: a worker that does not commit is wrong here and would be
wrong on Modal while it runs).

    volume = VolumeDouble(tmp_path / "volume")
    root = volume.mount("actor")          # the folder the "actor" container sees as the Volume
    volume.container_volume("grpo", root)  # its handle (commit, reload), as `modal_app.container_volume` gives
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Each file under `folder` by relative path: (size, mtime in ns); copies keep both (copy2)."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()
    }


def copy_file(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target)


class ContainerView:
    """One container's mount of the Volume: its own folder, `commit()` and `reload()`."""

    def __init__(self, volume: VolumeDouble, root: Path) -> None:
        self.volume, self.root = volume, root
        self.reload()

    def commit(self) -> None:
        """Publish what this container added, changed or removed since its last mount or reload."""
        now = snapshot(self.root)
        committed = self.volume.committed
        for name, stamp in now.items():
            if self.base.get(name) != stamp:
                copy_file(self.root / name, committed / name)
        for name in self.base.keys() - now.keys():
            (committed / name).unlink(missing_ok=True)
        self.base = now
        self.volume.commits += 1

    def reload(self) -> None:
        """The latest committed state, in place of this container's view."""
        if self.root.exists():
            shutil.rmtree(self.root)
        shutil.copytree(self.volume.committed, self.root)
        self.base = snapshot(self.root)


class VolumeDouble:
    """The committed state of a Volume (a folder) and the containers' views of it."""

    def __init__(self, folder: Path) -> None:
        self.committed = folder / "committed"
        self.committed.mkdir(parents=True, exist_ok=True)
        self.containers = folder / "containers"
        self.views: dict[str, ContainerView] = {}
        self.commits = 0

    def mount(self, container: str) -> str:
        """A new container's storage root: the latest committed state, in a folder of its own."""
        root = self.containers / f"{container}-{len(self.views)}"
        self.views[str(root)] = ContainerView(self, root)
        return str(root)

    def container_volume(self, name: str, mount: str) -> ContainerView | None:
        """What `modal.Volume.from_name(name)` is inside the container that mounted it at `mount`."""
        return self.views.get(str(mount))

    # -- the client, from outside any container -------------------------------------------------------
    def listdir(self, path: str) -> list[SimpleNamespace]:
        folder = self.committed / path.lstrip("/")
        return [SimpleNamespace(path=str(p.relative_to(self.committed))) for p in sorted(folder.iterdir())]

    def read_file(self, path: str) -> Iterator[bytes]:
        with open(self.committed / path.lstrip("/"), "rb") as handle:
            yield from iter(lambda: handle.read(1 << 16), b"")

    def remove_file(self, path: str, recursive: bool = False) -> None:
        target = self.committed / path.lstrip("/")
        if not target.exists():
            raise FileNotFoundError(path)
        if target.is_dir():
            if not recursive:
                raise IsADirectoryError(f"{path} is a directory: pass recursive=True")
            shutil.rmtree(target)
        else:
            target.unlink()

    def exists(self, path: str) -> bool:
        """Whether `path` is in the committed state (what a newly started container would see)."""
        return (self.committed / path.lstrip("/")).exists()
