"""The artifact store on gs:// against a real GCS protocol server (gcp-storage-emulator) on
127.0.0.1, started by this module; the environment points gcsfs at it (STORAGE_EMULATOR_HOST).

The emulator ignores `ifGenerationMatch=0` (it overwrites), so the GCS lease is checked on the
request it sends, read from the emulator's request log; the lease race itself is tested end to
end on S3 (tests/test_object_store.py).
"""

import json
import logging
import os
import socket

import pytest

from tests.test_object_store import tiny_pipeline, trainflow

emulator = pytest.importorskip("gcp_storage_emulator.server")
pytest.importorskip("gcsfs")

STEPS = 6
BUCKET = "trainflow-gcs"


class RequestLog(logging.Handler):
    """The emulator's request lines ("POST /upload/storage/v1/b/... HTTP/1.1")."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator on a free loopback port with one bucket, and the environment (this module
    only) that points gcsfs at it. gcsfs's experimental zonal/HNS layer stalls on the emulator."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    requests = RequestLog()
    logger = logging.getLogger(emulator.__name__)
    logger.addHandler(requests)
    level = logger.level
    logger.setLevel(logging.INFO)
    env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
           "TRAINFLOW_CACHE": str(tmp_path_factory.mktemp("gcs-cache")),
           "TRAINFLOW_LEASE_SECONDS": "3"}  # renewed every second: the test sees renewals
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield requests
    finally:
        logger.removeHandler(requests)
        logger.setLevel(level)
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def finished(prefect_server, gcs, tmp_path_factory):
    store = f"gs://{BUCKET}/runs/x"
    pipeline = tiny_pipeline(tmp_path_factory.mktemp("pipeline"))
    trainflow("run", pipeline, "--store", store, f"pretrain.steps={STEPS}")
    return store, pipeline


def test_tiny_pipeline_on_gcs_complete_verified_with_lineage(finished):
    store, pipeline = finished
    status = json.loads(trainflow("status", pipeline, "--store", store, f"pretrain.steps={STEPS}", "--json").stdout)
    assert status["store"] == store
    assert {row["stage"]: row["state"] for row in status["stages"]} == {"tokenize": "complete", "pretrain": "complete"}
    rows = json.loads(trainflow("ls", "--store", store, "--json").stdout)
    pretrain = next(r for r in rows if r["stage"] == "pretrain")
    out = trainflow("verify", f"{store}/pretrain/{pretrain['id']}").stdout
    assert out.startswith(f"OK {store}/pretrain/{pretrain['id']}")
    tree = json.loads(trainflow("lineage", pretrain["id"], "--store", store, "--json").stdout)
    assert tree["status"] == "complete" and tree["parents"][0]["stage"] == "tokenize"
    assert tree["path"] == f"{store}/pretrain/{pretrain['id']}"  # the bucket's URL, not the staging copy
    assert tree["parents"][0]["status"] == "complete"
    text = trainflow("lineage", pretrain["id"], "--store", store).stdout
    assert f"pretrain/{pretrain['id']}" in text and "└─ dataset: tokenize/" in text


def test_rerun_on_gcs_skips_everything(finished):
    store, pipeline = finished
    proc = trainflow("run", pipeline, "--store", store, f"pretrain.steps={STEPS}")
    statuses = {line.split()[0]: line.split()[2] for line in proc.stdout.splitlines()
                if line.split()[:1] in (["tokenize"], ["pretrain"]) and len(line.split()) > 2}
    assert statuses == {"tokenize": "skipped", "pretrain": "skipped"}, proc.stdout[-2000:]


def test_gcs_lease_is_created_only_if_absent(finished, gcs):
    """Each stage's lease was created with ifGenerationMatch=0 (GCS answers 412 when the object
    exists; the emulator does not, hence the request check) and renewed without it."""
    leases = [line for line in gcs.lines if "/.lease" in line and "upload_id=" not in line
              and line.startswith('"POST /upload/storage/v1/b/')]
    creates = [line for line in leases if "ifGenerationMatch=0" in line]
    renewals = [line for line in leases if "ifGenerationMatch" not in line]
    assert any("/tokenize/" in line for line in creates) and any("/pretrain/" in line for line in creates), leases
    assert any("/pretrain/" in line for line in renewals), leases
