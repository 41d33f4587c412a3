"""The artifact store on a local (or shared POSIX) directory: the interface's own behaviour
(tasks/store/base.py), which works in the store itself and locks with flock.

A store whose path is a file (or lies under one) is refused when it is opened. A missing
directory is created by the first stage that writes into it (`trainflow run`, `convert`,
`export`), parents included; the commands that only read a store refuse it (`require`)."""

from __future__ import annotations

from pathlib import Path

from tasks.store.base import ArtifactStore
from tasks.store.records import InputError
from tasks.store.urls import is_url


class LocalStore(ArtifactStore):
    """Artifacts in a local or shared POSIX directory, locked with flock."""

    @classmethod
    def handles(cls, root: str) -> bool:
        return not is_url(root)

    def __init__(self, root: str | Path):
        super().__init__(root)
        blocking = _nearest_file(self.root)
        if blocking is not None:
            where = "is a file" if blocking == self.root else f"lies under {blocking}, a file"
            raise InputError(f"artifact store {self.root} {where}, not a directory; pass a directory as --store")

    def require(self) -> None:
        """InputError unless the store's directory exists (for a command that only reads it)."""
        if not self.root.is_dir():
            raise InputError(f"no artifact store at {self.root} (the directory does not exist; check --store)")

    def find(self, artifact_id: str) -> Path:
        self.require()
        return super().find(artifact_id)


def _nearest_file(path: Path) -> Path | None:
    """The file that `path` is or lies under (nothing could be created there), else None."""
    for candidate in (path, *path.parents):
        try:
            if candidate.exists():
                return None if candidate.is_dir() else candidate
        except OSError:  # not searchable: the stage that writes there will say so
            return None
    return None
