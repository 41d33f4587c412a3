"""The artifact store: one interface, a local and an object-storage implementation.

    base.py     the interface: `ArtifactStore(root)` gives the implementation for a path or
                a URL; resolving an artifact argument (a path, a URL or an id)
    local.py    the store in a local or shared POSIX directory
    bucket.py   the s3:// / gs:// store: the local store of its staging copies plus the bucket
    consume.py  what a stage reads of an input artifact, and its proportional verification
    records.py  ids, digests, manifests and locks (the layout of an artifact)
    urls.py     what a store location is (`is_url`): the one test, importing no backend
    objects.py  the bucket's bytes and leases through fsspec, the checkpoint-step mirror

tasks/artifacts.py re-exports the records' names under which the rest of trainflow imports
them; the bucket's names are imported from objects.py.
"""

from tasks.store.base import ArtifactStore, Claim, resolve_artifact, split_artifact_url
from tasks.store.bucket import BucketStore
from tasks.store.local import LocalStore

__all__ = ["ArtifactStore", "BucketStore", "Claim", "LocalStore", "resolve_artifact", "split_artifact_url"]
