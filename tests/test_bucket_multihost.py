"""Two processes, a bucket, no disk shared with the runner: on s3:// (moto S3 on 127.0.0.1) and
on gs:// (the GCS emulator of tests/test_object_store_gcs.py), the same test.

A pretrain stage on an s3:// store, fsdp spanning 2 processes (2 x 2 simulated CPU devices,
tensor within each, jax.distributed with gloo): every rank reads its config and the
dataset's token shards at their URLs (no path of the runner's but the metrics folder, which
rank 0 alone writes), the engine writes its checkpoint at the artifact's URL, every process
its own OCDBT shards (`ocdbt.process_0/`, `ocdbt.process_1/`), and nothing of it is staged
on the runner's disk. The runner (no Prefect) is SIGKILLed once a step is in the bucket; its
orphaned ranks save and exit; the partial artifact is copied to a second prefix; one copy
resumes on 1 process x 4 devices, the other on 2 x 2, each from a fresh cache (another
machine), and both end bitwise equal to the uninterrupted 2-process run. A run whose
committing process is killed after every process wrote its shards of a step, before the
step's commit, leaves the previous step intact, and resumes from it to the same bits. A
consumer then reads the step it needs at the URL (nothing downloaded but the small files). SFT and GRPO
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import yaml

from engine.config import Strict
from engine.train.checkpoint import load_params, verify_step
from tasks.launch.run import LauncherSpec
from tasks.launch.spec import StageFailed
from tasks.registry import StageContext, StageHooks, StageKind
from tasks.runner import RAN, RESUMED, StageJob, execute_stage
from tasks.stages.pretrain import PretrainStage
from tasks.store.base import ArtifactStore
from tasks.store.objects import _filesystem, read_url
from tasks.store.records import flock_held
from tests.commit_kill import KILL_STEP
from tests.conftest import child_xla_flags
from tests.test_multihost import stdlib_bytes
from tests.test_object_store import bucket, s3_endpoint  # noqa: F401  (moto S3 fixtures)
from tests.test_object_store_gcs import BUCKET as GCS_BUCKET
from tests.test_object_store_gcs import gcs  # noqa: F401  (the GCS emulator fixture)

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


class PretrainKilledAtCommit(PretrainStage):
    """Pretraining whose committing process dies between step KILL_STEP's shards and its commit."""

    entry_point = "tests.commit_kill"


def _launcher(processes: int, devices: int) -> LauncherSpec:
    env = {"XLA_FLAGS": child_xla_flags(devices), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    return LauncherSpec(kind="local-multi", processes=processes, env=env) if processes > 1 else LauncherSpec(env=env)


def _jobs(processes: int, devices: int, pretrain: PretrainStage | None = None) -> list[StageJob]:
    dataset = ByteDataset()
    pretrain = pretrain or PretrainStage()
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


def run(store_url: str, processes: int, devices: int, log=None, pretrain: PretrainStage | None = None) -> list[str]:
    """Both stages on the store (this process is the runner); the statuses."""
    store, hooks = ArtifactStore(store_url), StageHooks(log=log or (lambda line: None))
    return [execute_stage(job, store, hooks).status for job in _jobs(processes, devices, pretrain)]


def _staged_checkpoint_files(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.is_file() and "/checkpoint/" in p.as_posix()]


def _params(url: str) -> list[np.ndarray]:
    _, params, step = load_params(url, as_numpy=True)
    assert step == STEPS
    return [np.asarray(x) for x in jax.tree.leaves(params)]


@dataclass
class Bucket:
    """A bucket (or a prefix of one) of either backend, listed and copied within through fsspec."""

    url: str
    fs: Any

    @property
    def root(self) -> str:
        return self.url.split("://", 1)[1]

    def keys(self, prefix: str) -> list[str]:
        """The keys of the objects under `prefix`, relative to the bucket's URL."""
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(f"{self.root}/{prefix.rstrip('/')}")
        except FileNotFoundError:
            return []
        return [key.removeprefix(self.root + "/") for key in found]

    def copy(self, key: str, to: str) -> None:
        self.fs.copy(f"{self.root}/{key}", f"{self.root}/{to}")


@pytest.fixture(params=["s3", "gs"])
def store_bucket(request) -> Bucket:
    if request.param == "s3":
        url = f"s3://{request.getfixturevalue('bucket')}"
    else:
        request.getfixturevalue("gcs")
        url = f"gs://{GCS_BUCKET}/multihost"
    return Bucket(url, _filesystem(url))


def test_two_processes_checkpoint_to_the_bucket_and_resume_on_one_or_two_bitwise_equal(
    store_bucket: Bucket, tmp_path, monkeypatch
):
    b = store_bucket
    checkpoint = f"pretrain/{PRETRAIN_ID}/checkpoint"

    # The uninterrupted run, 2 processes x 2 devices.
    monkeypatch.setenv("TRAINFLOW_CACHE", str(tmp_path / "ref-cache"))
    reference = f"{b.url}/ref"
    assert run(reference, 2, 2) == [RAN, RAN]
    assert _staged_checkpoint_files(tmp_path / "ref-cache") == []  # no checkpoint byte on the runner's disk
    keys = b.keys(f"ref/{checkpoint}")
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
    killed = f"{b.url}/killed"
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
    while not any(k.endswith("/digests.json") for k in b.keys(f"killed/{checkpoint}")):
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
    for key in b.keys("killed"):  # a second copy of the partial artifact
        b.copy(key, "copy/" + key.removeprefix("killed/"))

    # Killed between the shards and the commit: every process wrote its shards of step KILL_STEP
    # and the committing process died before committing it. The step before it stays intact.
    torn = f"{b.url}/torn"
    monkeypatch.setenv("TRAINFLOW_CACHE", str(tmp_path / "torn-cache"))
    with pytest.raises(StageFailed):
        run(torn, 2, 2, pretrain=PretrainKilledAtCommit())
    steps = {key.split("/")[4] for key in b.keys(f"torn/{checkpoint}") if key.count("/") > 4}
    shards = b.keys(f"torn/{checkpoint}/{KILL_STEP}")
    for process in (0, 1):
        assert any(f"/params/ocdbt.process_{process}/" in key for key in shards), (process, shards)
    assert not any(key.endswith("/digests.json") for key in shards), shards  # never committed
    assert verify_step(f"{torn}/{checkpoint}", KILL_STEP - 2) == [] and str(KILL_STEP - 2) in steps
    assert not ArtifactStore(torn).is_complete("pretrain", PRETRAIN_ID)

    # Resumed from the bucket on another machine (a fresh cache): 1 process x 4 devices, and 2 x 2;
    # the torn run on 2 x 2, from the step before the one it did not commit.
    # The dataset is read at its URL too: its shards reach the engine's host cache, not the runner's.
    for prefix, (processes, devices) in {"killed": (1, 4), "copy": (2, 2), "torn": (2, 2)}.items():
        monkeypatch.setenv("TRAINFLOW_CACHE", str(tmp_path / f"{prefix}-resume"))
        monkeypatch.setenv("TRAINFLOW_ENGINE_CACHE", str(tmp_path / f"{prefix}-hosts"))
        lines: list[str] = []
        assert run(f"{b.url}/{prefix}", processes, devices, lines.append) == ["skipped", RESUMED], prefix
        # The engine's own line names the bucket (it restored there, from a step past 0).
        resumed = next(
            (m for m in map(re.compile(r"resumed from checkpoint step (\d+) in (\S+)").search, lines) if m), None
        )
        assert resumed and int(resumed.group(1)) >= 2, lines[-20:]
        assert prefix != "torn" or int(resumed.group(1)) == KILL_STEP - 2, resumed.group(0)
        assert resumed.group(2) == f"{b.url}/{prefix}/{checkpoint}", resumed.group(0)
        assert _staged_checkpoint_files(tmp_path / f"{prefix}-resume") == []
        assert not list((tmp_path / f"{prefix}-resume").rglob("*.array_record"))
        assert list((tmp_path / f"{prefix}-hosts").glob("*.array_record"))
        metrics = ArtifactStore(f"{b.url}/{prefix}").artifact_dir("pretrain", PRETRAIN_ID) / "metrics.jsonl"
        steps = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
        assert steps[-1] == STEPS
        resumed_store = ArtifactStore(f"{b.url}/{prefix}")
        assert resumed_store.verify(resumed_store.artifact_dir("pretrain", PRETRAIN_ID)) == []
        got = _params(f"{b.url}/{prefix}/{checkpoint}")
        assert len(got) == len(want) and all(np.array_equal(x, y) for x, y in zip(got, want)), prefix

    # A consumer reads the consumed step at the URL: only the small files come into its cache.
    monkeypatch.setenv("TRAINFLOW_CACHE", str(tmp_path / "consumer"))
    ref = ArtifactStore(reference).open_input("pretrain", PRETRAIN_ID)
    assert ref.checkpoint_dir == f"{reference}/{checkpoint}"
    assert _staged_checkpoint_files(tmp_path / "consumer") == []
