"""The artifact store on a local (or shared POSIX) directory: the interface's own behaviour
(tasks/store/base.py), which works in the store itself and locks with flock.

A store whose path is a file (or lies under one) is refused when it is opened. A missing
directory is created by the first stage that writes into it (`trainflow run`, `convert`,
`export`), parents included; the commands that only read a store refuse it (`require`)."""

from __future__ import annotations

from pathlib import Path

from tasks.store.base import ArtifactStore
from tasks.store.objects import is_url
from tasks.store.records import InputError


class LocalStore(ArtifactStore):
    """Artifacts in a local or shared POSIX directory, locked with flock."""

    @classmethod
    def handles(cls, root: str) -> bool:
        return not is_url(root)

    def __init__(self, root: str | Path):
        super().__init__(root)
        existing = next(p for p in (self.root, *self.root.parents) if p.exists())
        if not existing.is_dir():
            where = "is a file" if existing == self.root else f"lies under {existing}, a file"
            raise InputError(f"artifact store {self.root} {where}, not a directory; pass a directory as --store")

    def require(self) -> None:
        """InputError unless the store's directory exists (for a command that only reads it)."""
        if not self.root.is_dir():
            raise InputError(f"no artifact store at {self.root} (the directory does not exist; check --store)")

    def find(self, artifact_id: str) -> Path:
        self.require()
        return super().find(artifact_id)
