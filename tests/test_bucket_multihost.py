"""Two processes, a bucket, no disk shared with the runner (moto S3 on 127.0.0.1).

A pretrain stage on an s3:// store, fsdp spanning 2 processes (2 x 2 simulated CPU devices,
tensor within each, jax.distributed with gloo): every rank reads its config and the
dataset's token shards at their URLs (no path of the runner's but the metrics folder, which
rank 0 alone writes), the engine writes its checkpoint at the artifact's URL, every process
its own OCDBT shards (`ocdbt.process_0/`, `ocdbt.process_1/`), and nothing of it is staged
on the runner's disk. The runner (no Prefect) is SIGKILLed once a step is in the bucket; its
orphaned ranks save and exit; the partial artifact is copied to a second prefix; one copy
resumes on 1 process x 4 devices, the other on 2 x 2, each from a fresh cache (another
machine), and both end bitwise equal to the uninterrupted 2-process run. A consumer then
reads the step it needs at the URL (nothing downloaded but the small files). SFT and GRPO
on 2 processes read their tokenizer and a corpus input's JSONL at the URL too
(tests/test_bucket_posttrain.py, a file of its own so that the two run side by side under
`pytest -n 2 --dist loadfile`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from engine.config import Strict
from engine.train.checkpoint import load_params
from tasks.artifacts import ArtifactStore
from tasks.launch.run import LauncherSpec
from tasks.registry import StageContext, StageHooks, StageKind
from tasks.runner import RAN, RESUMED, StageJob, execute_stage
from tasks.stages.pretrain import PretrainStage
from tasks.store.objects import read_url
from tasks.store.records import flock_held
from tests.conftest import child_xla_flags
from tests.test_multihost import stdlib_bytes
from tests.test_object_store import boto3, bucket, s3_endpoint  # noqa: F401  (moto S3 fixtures)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
STEPS = 8  # a step committed at 2 to kill after, then enough steps to resume through
DATASET_ID, PRETRAIN_ID = "d0d0d0d0d0d0d0d0", "c0c0c0c0c0c0c0c0"


class BytesConfig(Strict):
    documents: int = 40


class ByteDataset(StageKind):
    """A dataset artifact of standard-library sources as byte tokens (no tokenizer training)."""

    task = "test-bytes"
    output = "dataset"
    config_schema = BytesConfig

    def run(self, ctx: StageContext) -> dict:
        stdlib_bytes(ctx.out_dir / "data", documents=ctx.config.documents, length=2000, validation=4)
        return {"documents": ctx.config.documents}


def _launcher(processes: int, devices: int) -> LauncherSpec:
    env = {"XLA_FLAGS": child_xla_flags(devices), "JAX_PLATFORMS": "cpu"}
    return LauncherSpec(kind="local-multi", processes=processes, env=env) if processes > 1 else LauncherSpec(env=env)


def _jobs(processes: int, devices: int) -> list[StageJob]:
    dataset = ByteDataset()
    pretrain = PretrainStage()
    config = pretrain.resolve_config(
        {
            "model": {"preset": "tiny", "vocab_size": 260, "max_seq_len": 64},
            # fsdp spans the 2 processes, tensor each one's 2 devices: a 2-way reduction is exact in
            # either order, so 1 x 4 and 2 x 2 give the same bits (4-way fsdp differs in the last bit).
            "mesh": {"data": 1, "fsdp": 2, "tensor": 2},
            "steps": STEPS,
            "log_every": 1,
            "data": {"seq_len": 32, "batch_size": 8, "eval_batches": 1},
            "checkpoint": {"every_steps": 2, "async_save": False},
            "optimizer": {"learning_rate": 1e-2},
        },
        "test",
    )
    return [
        StageJob("bytes", dataset, dataset.config_schema(), {}, {}, DATASET_ID),
        StageJob(
            "pretrain",
            pretrain,
            config,
            {},
            {"dataset": ("bytes", DATASET_ID)},
            PRETRAIN_ID,
            launcher=_launcher(processes, devices),
        ),
    ]


def run(store_url: str, processes: int, devices: int, log=None) -> list[str]:
    """Both stages on the store (this process is the runner); the statuses."""
    store, hooks = ArtifactStore(store_url), StageHooks(log=log or (lambda line: None))
    return [execute_stage(job, store, hooks).status for job in _jobs(processes, devices)]


def _staged_checkpoint_files(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.is_file() and "/checkpoint/" in p.as_posix()]


def _params(url: str) -> list[np.ndarray]:
    _, params, step = load_params(url, as_numpy=True)
    assert step == STEPS
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def _keys(client, bucket_name: str, prefix: str) -> list[str]:
    keys, token = [], None
    while True:
        page = client.list_objects_v2(
            Bucket=bucket_name, Prefix=prefix, **({"ContinuationToken": token} if token else {})
        )
        keys += [o["Key"] for o in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return keys
        token = page["NextContinuationToken"]


def test_two_processes_checkpoint_to_the_bucket_and_resume_on_one_or_two_bitwise_equal(
    bucket,  # noqa: F811
    s3_endpoint,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    client = boto3.client("s3")
    checkpoint = f"pretrain/{PRETRAIN_ID}/checkpoint"

    # The uninterrupted run, 2 processes x 2 devices.
    monkeypatch.setenv("TRAINFLOW_CACHE", str(tmp_path / "ref-cache"))
    reference = f"s3://{bucket}/ref"
    assert run(reference, 2, 2) == [RAN, RAN]
    assert _staged_checkpoint_files(tmp_path / "ref-cache") == []  # no checkpoint byte on the runner's disk
    keys = _keys(client, bucket, f"ref/{checkpoint}/")
    for process in (0, 1):  # each process wrote its own shards of the step, at the URL
        assert any(f"/{STEPS}/params/ocdbt.process_{process}/" in key for key in keys), process
    store = ArtifactStore(reference)
    manifest = store.manifest("pretrain", PRETRAIN_ID)
    listed = {k.removeprefix(f"ref/pretrain/{PRETRAIN_ID}/") for k in keys}
    assert {rel for rel in manifest["files"] if rel.startswith("checkpoint/")} == listed
    assert set(manifest["versions"]) >= listed
    assert store.verify(store.artifact_dir("pretrain", PRETRAIN_ID)) == []
    want = _params(f"{reference}/{checkpoint}")
    # Every rank read its config at the artifact's URL, and in it only URLs: the dataset's shards,
    # the checkpoint; the one local path is the metrics folder, which rank 0 alone writes.
    config = yaml.safe_load(read_url(f"{reference}/pretrain/{PRETRAIN_ID}/train.yaml"))
    assert config["data"]["path"] == f"{reference}/bytes/{DATASET_ID}/data"
    assert config["checkpoint"]["directory"] == f"{reference}/{checkpoint}"
    assert config["metrics_dir"] == str(store.artifact_dir("pretrain", PRETRAIN_ID))

    # Killed: the runner SIGKILLed once a step is committed in the bucket; its ranks save and exit.
    killed = f"s3://{bucket}/killed"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINFLOW_CACHE": str(tmp_path / "killed-cache")}
    env.pop("XLA_FLAGS", None)
    driver = subprocess.Popen(
        [sys.executable, "-c", f"from tests.test_bucket_multihost import run; run({killed!r}, 2, 2)"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not any(k.endswith("/digests.json") for k in _keys(client, bucket, f"killed/{checkpoint}/")):
        assert driver.poll() is None and time.monotonic() < deadline, "no checkpoint step reached the bucket"
        time.sleep(0.1)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    lock = next((tmp_path / "killed-cache").glob(f"*/pretrain/{PRETRAIN_ID}/.lock"))
    deadline = time.monotonic() + 120
    while flock_held(lock):  # the orphaned ranks (SIGTERM from their dead parent) save and exit
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert _staged_checkpoint_files(tmp_path / "killed-cache") == []
    killed_store = ArtifactStore(killed)
    assert not killed_store.is_complete("pretrain", PRETRAIN_ID)
    for key in _keys(client, bucket, "killed/"):  # a second copy of the partial artifact
        client.copy_object(
            Bucket=bucket, Key="copy/" + key.removeprefix("killed/"), CopySource={"Bucket": bucket, "Key": key}
        )

    # Resumed from the bucket on another machine (a fresh cache): 1 process x 4 devices, and 2 x 2.
    # The dataset is read at its URL too: its shards reach the engine's host cache, not the runner's.
    for prefix, (processes, devices) in {"killed": (1, 4), "copy": (2, 2)}.items():
        monkeypatch.setenv("TRAINFLOW_CACHE", str(tmp_path / f"{prefix}-resume"))
        monkeypatch.setenv("TRAINFLOW_ENGINE_CACHE", str(tmp_path / f"{prefix}-hosts"))
        lines: list[str] = []
        assert run(f"s3://{bucket}/{prefix}", processes, devices, lines.append) == ["skipped", RESUMED], prefix
        # The engine's own line names the bucket (it restored there, from a step past 0).
        resumed = next(
            (m for m in map(re.compile(r"resumed from checkpoint step (\d+) in (\S+)").search, lines) if m), None
        )
        assert resumed and int(resumed.group(1)) >= 2, lines[-20:]
        assert resumed.group(2) == f"s3://{bucket}/{prefix}/{checkpoint}", resumed.group(0)
        assert _staged_checkpoint_files(tmp_path / f"{prefix}-resume") == []
        assert not list((tmp_path / f"{prefix}-resume").rglob("*.array_record"))
        assert list((tmp_path / f"{prefix}-hosts").glob("*.array_record"))
        metrics = ArtifactStore(f"s3://{bucket}/{prefix}").artifact_dir("pretrain", PRETRAIN_ID) / "metrics.jsonl"
        steps = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
        assert steps[-1] == STEPS
        resumed_store = ArtifactStore(f"s3://{bucket}/{prefix}")
        assert resumed_store.verify(resumed_store.artifact_dir("pretrain", PRETRAIN_ID)) == []
        got = _params(f"s3://{bucket}/{prefix}/{checkpoint}")
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want)), prefix

    # A consumer reads the consumed step at the URL: only the small files come into its cache.
    monkeypatch.setenv("TRAINFLOW_CACHE", str(tmp_path / "consumer"))
    ref = ArtifactStore(reference).open_input("pretrain", PRETRAIN_ID)
    assert ref.checkpoint_dir == f"{reference}/{checkpoint}"
    assert _staged_checkpoint_files(tmp_path / "consumer") == []
