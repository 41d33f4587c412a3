"""The artifact store: one interface, backends beside it. Each name is imported from the
module that defines it.

    base.py       the interface: `ArtifactStore(root)` gives the backend for a path or a
                  URL; resolving an artifact argument (a path, a URL or an id); it imports
                  no backend
    local.py      the store in a local or shared POSIX directory
    bucket.py     the s3:// / gs:// store: the bucket, with a local store of staging copies beside it
    objects.py    the bucket's bytes through fsspec, the checkpoint-step mirror, directories at a URL
    leases.py     the bucket's lock: a lease object with a conditional create (boto3 on S3)
    processes.py  what a lock or lease records of its holder, and whether that one still runs
    consume.py    what a stage reads of an input artifact, its proportional verification, the file hasher
    records.py    ids, digests, manifests and flocks (the layout of an artifact)
    names.py      a stage's folder name in a store
    urls.py       what a store location is (`is_url`)
"""

# The backends register with the interface (ArtifactStore.__init_subclass__) when imported.
from tasks.store import bucket, local  # noqa: F401
