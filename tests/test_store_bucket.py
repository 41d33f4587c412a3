"""Faults on a bucket store (moto S3): a bucket that refuses writes while a stage commits.

The stage's committed checkpoint steps are on the bucket (the step mirror's sync); then
the bucket starts refusing PUTs -- an expired credential or a policy change, injected by
a wrapper around the store's real s3fs file system -- while the runner uploads the payload
before the manifest. The stage fails with one sentence naming the artifact's URL, the
bucket holds no `complete` manifest, the steps committed before stay whole, and a re-run
once the bucket takes writes again resumes and commits.
"""

from __future__ import annotations

import pytest

from tasks.artifacts import ArtifactStore
from tasks.objectstore import StoreWriteError, complete_steps
from tasks.runner import RESUMED, execute_stage
from tests.test_consume import STEPS, _job
from tests.test_object_store import bucket, s3_endpoint  # noqa: F401  (moto S3 fixtures)


class Refusing:
    """The store's fsspec file system, refusing every write once `refuse` is set."""

    def __init__(self, fs):
        self.fs, self.refuse = fs, False

    def __getattr__(self, name):
        attr = getattr(self.fs, name)
        if name in ("put", "put_file", "pipe_file", "open") and callable(attr):

            def guarded(*args, **kwargs):
                writing = name != "open" or "w" in (args[1] if len(args) > 1 else kwargs.get("mode", "rb"))
                if self.refuse and writing:
                    raise PermissionError("Access Denied")
                return attr(*args, **kwargs)

            return guarded
        return attr


def test_a_bucket_refusing_writes_at_commit_fails_naming_the_url_and_keeps_the_committed_steps(
    bucket,  # noqa: F811
    monkeypatch,
):
    url = f"s3://{bucket}/refusing"
    store = ArtifactStore(url)
    refusing = Refusing(store.remote.fs)
    store.remote.fs = refusing
    job = _job()
    where = store.location(job.stage, job.artifact_id)

    original_upload = store.remote.upload

    def upload_then_refuse(*args, **kwargs):  # the stage's work is done: the bucket turns read-only
        store.remote.mirror(job.stage, job.artifact_id, store.artifact_dir(job.stage, job.artifact_id)).sync()
        refusing.refuse = True
        return original_upload(*args, **kwargs)

    monkeypatch.setattr(store.remote, "upload", upload_then_refuse)
    with pytest.raises(StoreWriteError, match=rf"could not upload .* to {where}: PermissionError: Access Denied"):
        execute_stage(job, store)
    manifest = store.manifest(job.stage, job.artifact_id)
    assert manifest is None or manifest["status"] != "complete"
    assert not store.is_complete(job.stage, job.artifact_id)
    steps = complete_steps(store.remote, job.stage, job.artifact_id)
    assert steps and steps[-1] == STEPS[-1], steps  # the mirror had them whole before the refusal

    monkeypatch.undo()  # the bucket takes writes again
    store.remote.fs = refusing.fs
    assert execute_stage(job, store).status == RESUMED
    assert store.is_complete(job.stage, job.artifact_id)
    assert store.verify(store.artifact_dir(job.stage, job.artifact_id)) == []
