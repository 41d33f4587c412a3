"""A stage reads what it consumes: of an upstream checkpoint artifact with 3 kept steps, the
newest step's params and meta -- not its optimizer or data state, not the other steps --
checked by stamp or sha256 as far as it is read (tasks/store/consume.py), on a local store
and on a bucket (moto S3); `trainflow verify` still re-hashes everything.

The producer is a real Orbax checkpoint of a tiny Transformer, written by the engine's
Checkpointer in an in-process stage kind; bytes read are counted by the kernel
(/proc/self/io rchar) on the local store and by the cache's contents on the bucket.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from engine.config import Strict
from engine.contract import CHECKPOINT_DIR
from engine.models.config import ModelConfig
from engine.models.transformer import Transformer
from engine.train.checkpoint import Checkpointer, load_params
from tasks.registry import StageContext, StageKind, register_stage
from tasks.runner import StageJob, execute_stage
from tasks.store.base import ArtifactStore
from tasks.store.consume import STAMPS, consumed_files
from tasks.store.records import ArtifactError, verify_artifact
from tests.test_object_store import boto3, bucket, s3_endpoint  # noqa: F401  (moto S3 fixtures)

MODEL = ModelConfig(
    vocab_size=509, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, max_seq_len=64
)
STEPS = (10, 20, 30)


class ThreeStepsConfig(Strict):
    seed: int = 0


class ThreeSteps(StageKind):
    """A checkpoint artifact with three kept steps, each with params, an Adam-sized
    optimizer state (two more copies of the params) and a data state."""

    task = "test-three-steps"
    output = "checkpoint"
    config_schema = ThreeStepsConfig

    def run(self, ctx: StageContext) -> dict:
        params = nnx.to_pure_dict(nnx.split(Transformer(MODEL, rngs=nnx.Rngs(ctx.config.seed)))[1])
        ckpt = Checkpointer(ctx.out_dir / CHECKPOINT_DIR, keep=3, async_save=False)
        done = ckpt.latest_step() or 0  # resumed: the steps already saved are skipped
        for step in STEPS:
            params = _jitter(params, step)
            if step <= done:
                continue
            adam = {"mu": _jitter(params, step + 1), "nu": _jitter(params, step + 2)}
            meta = {"step": step, "model": MODEL.model_dump(mode="json"), "format": "trainflow.checkpoint/1"}
            ckpt.save(step, params, adam, meta, {"position": step * 8})
        ckpt.close()
        return {"steps": STEPS[-1]}


register_stage(ThreeSteps, replace=True)


def _jitter(tree, salt: int):
    rng = np.random.default_rng(salt)
    return {
        k: _jitter(v, salt)
        if isinstance(v, dict)
        else (np.asarray(v) + rng.normal(size=np.shape(v))).astype(np.float32)
        for k, v in tree.items()
    }


def _job() -> StageJob:
    kind = ThreeSteps()
    config = kind.config_schema()
    return StageJob("producer", kind, config, {}, {}, "0123456789abcdef")


def _rchar() -> int:
    return int(
        next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar")).split()[1]
    )


def _sizes(files: dict) -> int:
    return sum(entry["size"] for entry in files.values())


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _biggest(directory: Path, under: str) -> Path:
    return max((p for p in (directory / under).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.fixture(scope="module")
def local_artifact(tmp_path_factory) -> tuple[ArtifactStore, Path, dict]:
    store = ArtifactStore(tmp_path_factory.mktemp("store"))
    execute_stage(_job(), store)
    ref = store.open_input("producer", _job().artifact_id)
    return store, ref.path, ref.manifest


def test_consumed_files_are_the_newest_steps_params_and_meta(local_artifact):
    _, _, manifest = local_artifact
    files = manifest["files"]
    consumed = consumed_files(files)
    steps = {rel.split("/")[1] for rel in consumed if rel.startswith(CHECKPOINT_DIR + "/")}
    items = {rel.split("/")[2] for rel in consumed if rel.count("/") >= 3}
    assert steps == {str(STEPS[-1])} and items == {"params", "meta"}
    assert f"checkpoint/{STEPS[-1]}/digests.json" in consumed
    # 3 steps x (params + 2 copies in opt_state): the consumer reads under a ninth of it.
    assert _sizes(consumed) < _sizes(files) / 8


@pytest.mark.skipif(not Path("/proc/self/io").is_file(), reason="counts bytes read with /proc/self/io")
def test_a_local_consumer_reads_only_what_it_consumes_and_refuses_changed_params(local_artifact):
    store, directory, manifest = local_artifact
    consumed = _sizes(consumed_files(manifest["files"]))
    artifact_id = _job().artifact_id

    before = _rchar()  # the stamps the commit wrote vouch for every file: no payload byte is read
    store.open_input("producer", artifact_id)
    assert _rchar() - before < 64 << 10

    (directory / STAMPS).unlink()  # e.g. a copied store: the consumed files are hashed, nothing else
    before = _rchar()
    store.open_input("producer", artifact_id)
    read = _rchar() - before
    assert consumed <= read < consumed + (64 << 10), (read, consumed)
    before = _rchar()
    store.open_input("producer", artifact_id)  # stamps renewed by that check
    assert _rchar() - before < 64 << 10

    _, params, step = load_params(directory / CHECKPOINT_DIR, as_numpy=True)
    assert step == STEPS[-1]

    # An unconsumed file changed: the consumer does not read it, `verify` does.
    opt_state = _biggest(directory, f"{CHECKPOINT_DIR}/{STEPS[-1]}/opt_state")
    original = opt_state.read_bytes()
    _flip(opt_state)
    store.open_input("producer", artifact_id)
    assert any("opt_state" in p and "sha256 differs" in p for p in verify_artifact(directory))
    opt_state.write_bytes(original)

    # A consumed file changed, its mtime put back: the stamp (ctime) no longer holds, it is re-hashed.
    victim = _biggest(directory, f"{CHECKPOINT_DIR}/{STEPS[-1]}/params")
    stat = victim.stat()
    original = victim.read_bytes()
    _flip(victim)
    os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(ArtifactError, match=r"changed since it was finished: checkpoint/30/params/.*sha256 differs"):
        store.open_input("producer", artifact_id)
    victim.write_bytes(original)
    store.open_input("producer", artifact_id)


def test_a_bucket_consumer_reads_the_checkpoint_at_the_url_checked_by_its_versions(
    bucket,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """On a bucket, a consumer's engine reads the consumed step at the URL: nothing of the
    checkpoint comes into the cache, one LIST finds every consumed object at the version the
    manifest recorded at commit. An object rewritten since (another version) is streamed
    through sha256: other bytes are refused, naming it. `local_checkpoint` (what `trainflow
    generate` asks) downloads the consumed files, hashed as they arrive, and only those."""
    url = f"s3://{bucket}/consume"
    execute_stage(_job(), ArtifactStore(url))  # staged in the fixture's cache, uploaded
    monkeypatch.setenv("TRAINFLOW_CACHE", str(tmp_path / "fresh"))  # another machine
    store = ArtifactStore(url)
    artifact_id = _job().artifact_id
    ref = store.open_input("producer", artifact_id)
    consumed = consumed_files(ref.manifest["files"])
    assert set(ref.manifest["versions"]) == set(ref.manifest["files"])
    assert ref.checkpoint_dir == f"{url}/producer/{artifact_id}/{CHECKPOINT_DIR}"
    assert not (ref.path / CHECKPOINT_DIR).exists()
    _, params, step = load_params(ref.checkpoint_dir, as_numpy=True)
    assert step == STEPS[-1]
    assert store.verify(ref.path) == []  # every object, streamed from the bucket

    local = store.open_input("producer", artifact_id, local_checkpoint=True)
    cached = {
        p.relative_to(local.path).as_posix(): p.stat().st_size
        for p in local.path.rglob("*")
        if p.is_file() and p.name not in ("artifact.json", ".lock") and not p.name.startswith(STAMPS)
    }
    assert cached == {rel: entry["size"] for rel, entry in consumed.items()}
    assert local.checkpoint_dir == str(local.path / CHECKPOINT_DIR)
    shutil.rmtree(local.path)

    # A consumed object rewritten in the bucket with its own bytes: a new version, re-hashed, accepted.
    client = boto3.client("s3")
    victim = max(
        (rel for rel in consumed if "/params/" in rel), key=lambda rel: consumed[rel]["size"]
    )  # the params' data file
    key = f"consume/producer/{artifact_id}/{victim}"
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    assert store.open_input("producer", artifact_id).checkpoint_dir.startswith("s3://")
    # ... with other bytes of the same size: refused, naming the object.
    body[len(body) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    assert hashlib.sha256(body).hexdigest() != consumed[victim]["sha256"]
    with pytest.raises(ArtifactError, match=rf"{victim}: sha256 differs.*trainflow verify {url}/producer/"):
        store.open_input("producer", artifact_id)
    with pytest.raises(ArtifactError, match=rf"{victim}: sha256 differs"):
        store.open_input("producer", artifact_id, local_checkpoint=True)
    assert not (ref.path / victim).exists()  # nothing unverified left in the cache
