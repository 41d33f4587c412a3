"""A bucket store on moto S3: a bucket that refuses writes while a stage commits, and the
engine's checkpoints written and read at the bucket's URL.

The stage's committed checkpoint steps are on the bucket (the step mirror's sync); then
the bucket starts refusing PUTs -- an expired credential or a policy change, injected by
a wrapper around the store's real s3fs file system -- while the runner uploads the payload
before the manifest. The stage fails with one sentence naming the artifact's URL, the
bucket holds no `complete` manifest, the steps committed before stay whole, and a re-run
once the bucket takes writes again resumes and commits. The engine's own saves at the URL
meet the same refusal mid-run (a proxy in front of moto answering writes with 403): the step
is not committed, the error names the URL, the step before stays whole and resumes.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from engine.models.transformer import Transformer
from engine.train.checkpoint import Checkpointer, CheckpointWriteError, load_params, verify_step
from tasks.runner import RESUMED, execute_stage
from tasks.store.base import ArtifactStore
from tasks.store.objects import StoreWriteError, complete_steps
from tests.test_consume import MODEL, STEPS, _jitter, _job
from tests.test_object_store import _forget_s3_clients, boto3, bucket, s3_endpoint  # noqa: F401  (moto S3 fixtures)


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


# --------------------------------------------------------------------------- the engine at the bucket's URL


def test_the_engine_checkpoints_straight_to_s3_and_resumes_from_the_newest_intact_step(
    bucket,  # noqa: F811
    tmp_path,
    monkeypatch,
    capfd,
):
    """Checkpointer at an s3:// URL: Orbax writes every shard through TensorStore's s3 driver
    (no local copy: the working directory stays empty), the digests commit with each step,
    resume verifies them in the bucket and falls back past a damaged step, load_params reads
    the URL. With the keys in the environment and no ~/.aws, TensorStore logs nothing about
    the AWS files it would otherwise look for (an ERROR line for each, in every S3 stage)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.aws there
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path / "home")
    url = f"s3://{bucket}/engine/checkpoint"
    params = nnx.to_pure_dict(nnx.split(Transformer(MODEL, rngs=nnx.Rngs(0)))[1])
    meta = {"model": MODEL.model_dump(mode="json"), "format": "trainflow.checkpoint/1"}
    ckpt = Checkpointer(url, keep=3, async_save=False)
    saved = {}
    for step in (1, 2):
        saved[step] = _jitter(params, step)
        ckpt.save(step, saved[step], {"mu": _jitter(params, step + 10)}, {**meta, "step": step}, {"position": step})
    ckpt.close()
    assert list((tmp_path / "home").iterdir()) == []  # nothing staged on local disk
    client = boto3.client("s3")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="engine/checkpoint/")["Contents"]]
    assert {"engine/checkpoint/1/digests.json", "engine/checkpoint/2/digests.json"} <= set(keys)

    again = Checkpointer(url, keep=3, async_save=False)
    assert again.resume_step(lambda _: None) == 2 and verify_step(url, 2) == []
    _, restored, step = load_params(url, as_numpy=True)
    assert step == 2
    for want, got in zip(jax.tree.leaves(saved[2]), jax.tree.leaves(restored)):
        assert np.array_equal(want, got)

    victim = max(
        (k for k in keys if k.startswith("engine/checkpoint/2/params/")),
        key=lambda k: client.head_object(Bucket=bucket, Key=k)["ContentLength"],
    )
    body = bytearray(client.get_object(Bucket=bucket, Key=victim)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=victim, Body=bytes(body))
    logs = []
    again = Checkpointer(url, keep=3, async_save=False)
    assert again.resume_step(logs.append) == 1
    assert any(f"checkpoint step 2 in {url} failed verification" in line for line in logs), logs
    assert ".aws/" not in capfd.readouterr().err  # TensorStore's "Failed to open file .../.aws/config"


class RefusingProxy:
    """An HTTP proxy on 127.0.0.1 in front of the moto server that, once `refuse` is set,
    answers every write (PUT, POST, DELETE) with S3's 403 AccessDenied, as a bucket does when
    a credential expires or a policy changes mid-run; reads pass through."""

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("http://").split(":")
        proxy = self
        self.refuse, self.refused = False, 0

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    body = b""
                    while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                        body += self.rfile.read(size)
                        self.rfile.readline()
                    while self.rfile.readline().strip():  # trailers, then the blank line
                        pass
                else:
                    body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.refuse and self.command in ("PUT", "POST", "DELETE"):
                    proxy.refused += 1
                    denied = (
                        b'<?xml version="1.0"?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>'
                    )
                    self.send_response(403)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(denied)))
                    self.end_headers()
                    self.wfile.write(denied)
                    return
                connection = http.client.HTTPConnection(host, int(port), timeout=60)
                skip = ("host", "transfer-encoding", "content-length", "expect")
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                headers["Content-Length"] = str(len(body))
                headers["Host"] = f"{host}:{port}"
                connection.request(self.command, self.path, body=body, headers=headers)
                reply = connection.getresponse()
                data = reply.read()
                self.send_response(reply.status, reply.reason)
                for key, value in reply.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                # A HEAD's length is the object's (no body follows); otherwise the body's.
                length = reply.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                connection.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def test_a_bucket_refusing_writes_mid_save_leaves_the_step_uncommitted_and_the_last_one_intact(
    bucket,  # noqa: F811
    s3_endpoint,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """The engine saving at an s3:// URL when the bucket starts refusing writes between two
    steps (TensorStore's s3 driver and s3fs both go through the proxy): the save fails with one
    sentence naming the URL and the step, that step never counts as committed, the step
    before it stays whole, and a later run resumes from it once writes are taken again."""
    proxy = RefusingProxy(s3_endpoint["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    _forget_s3_clients()
    try:
        url = f"s3://{bucket}/refused/checkpoint"
        params = nnx.to_pure_dict(nnx.split(Transformer(MODEL, rngs=nnx.Rngs(0)))[1])
        meta = {"model": MODEL.model_dump(mode="json"), "format": "trainflow.checkpoint/1"}
        ckpt = Checkpointer(url, keep=3, async_save=False)
        ckpt.save(1, _jitter(params, 1), {"mu": _jitter(params, 11)}, {**meta, "step": 1}, {"position": 1})
        proxy.refuse = True
        with pytest.raises(CheckpointWriteError) as failed:
            ckpt.save(2, _jitter(params, 2), {"mu": _jitter(params, 12)}, {**meta, "step": 2}, {"position": 2})
        message = str(failed.value)
        assert message.startswith(f"checkpoint step 2: could not write to {url} (") and proxy.refused > 0
        assert message.endswith("it is not committed, step 1, the newest committed, is kept"), message
        with contextlib.suppress(CheckpointWriteError):
            ckpt.close()
        proxy.refuse = False
        keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix="refused/")["Contents"]]
        assert "refused/checkpoint/2/digests.json" not in keys
        logs: list[str] = []
        again = Checkpointer(url, keep=3, async_save=False)
        assert again.resume_step(logs.append) == 1 and verify_step(url, 1) == []
        _, restored, step = load_params(url, as_numpy=True)
        assert step == 1
        for want, got in zip(jax.tree.leaves(_jitter(params, 1)), jax.tree.leaves(restored)):
            assert np.array_equal(want, got)
        again.close()
    finally:
        proxy.close()
        _forget_s3_clients()
