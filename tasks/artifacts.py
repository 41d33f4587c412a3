"""The artifact store's records and the stores, under the names the rest of trainflow imports.

The code lives in tasks/store/: records.py (ids, digests, manifests, locks: the layout of
docs/design.md "Artifacts and lineage"), base.py / local.py / bucket.py (one store interface, a
local and an object-storage implementation; `ArtifactStore(root)` gives the one for a path
or a URL), consume.py (what a consuming stage reads of an input, and its verification).
"""

from __future__ import annotations

from engine.contract import MANIFEST  # noqa: F401
from tasks.store.base import (  # noqa: F401
    ArtifactStore,
    Claim,
    resolve_artifact,
    split_artifact_url,
)
from tasks.store.bucket import (  # noqa: F401
    BucketStore,
)
from tasks.store.local import (  # noqa: F401
    LocalStore,
)
from tasks.store.records import (  # noqa: F401
    COMPLETE,
    FAILED,
    ID_LENGTH,
    LOCK,
    RUNNING,
    ArtifactError,
    ArtifactLock,
    ArtifactRef,
    InputError,
    artifact_id,
    canonical_json,
    code_version,
    compare_files,
    digest_files,
    drop_fields,
    now_iso,
    parent_dir,
    payload_files,
    read_manifest,
    sha256_file,
    verify_artifact,
    write_json_atomic,
)
