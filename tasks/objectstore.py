"""Object storage (s3://, gs://) through fsspec: the bucket side of a store, leases, the
checkpoint-step mirror and plain folders at a URL. The code lives in tasks/store/objects.py;
its names, the private ones tests reach for included, stay importable from here."""

from __future__ import annotations

from tasks.store.objects import (  # noqa: F401
    DEFAULT_CACHE_BYTES,
    FETCH_BLOCK,
    FETCH_THREADS,
    LEASE,
    LEASE_SECONDS,
    MIRROR_SECONDS,
    STEP_DIGESTS,
    Lease,
    LeaseHeld,
    RemoteBackend,
    StepMirror,
    StoreAccessError,
    StoreWriteError,
    _boto_client,
    _bucket_path,
    _filesystem,
    _options,
    _start_time,
    _this_process,
    complete_steps,
    describe,
    download_dir,
    flock_held,
    holder_is_gone,
    is_url,
    list_url,
    read_url,
    remove_url_files,
    upload_dir,
    url_cache,
)
