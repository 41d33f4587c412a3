"""The artifact store on a local (or shared POSIX) directory: the interface's own behaviour
(tasks/store/base.py), which works in the store itself and locks with flock."""

from __future__ import annotations

from tasks.store.base import ArtifactStore
from tasks.store.objects import is_url


class LocalStore(ArtifactStore):
    """Artifacts in a local or shared POSIX directory, locked with flock."""

    @classmethod
    def handles(cls, root: str) -> bool:
        return not is_url(root)
