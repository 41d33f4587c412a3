"""The artifact store on gs:// against a real GCS protocol server (gcp-storage-emulator) on
127.0.0.1, started by this module; the environment points gcsfs at it (STORAGE_EMULATOR_HOST).
Checkpoints are staged (TRAINFLOW_STAGED_CHECKPOINTS, see the fixture): TensorStore's GCS
driver does not accept this emulator's responses.

The emulator ignores `ifGenerationMatch=0` (it overwrites), so the GCS lease is checked on the
request it sends, read from the emulator's request log; the lease race itself is tested end to
end on S3 (tests/test_object_store.py).
"""

import json
import logging
import os
import socket

import pytest

from tasks import objectstore
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


def exact_multipart_uploads(read_data):
    """The emulator's request-body reader, with gcsfs's small-file uploads (multipart/related,
    parts framed by "\\n") split at their boundary exactly. The emulator hands them to the
    email parser, which takes a last content byte of "\\r" for part of the line ending before
    the boundary and drops it: a binary file ending in 0x0D (an OCDBT manifest, now and then)
    was stored a byte short. Real GCS keeps every byte; so does this."""

    def read(request_handler, query):
        content_type = request_handler.headers.get("Content-Type") or ""
        if not content_type.startswith("multipart/related"):
            return read_data(request_handler, query)
        raw = emulator._decode_raw_data(emulator._read_raw_data(request_handler), request_handler)
        boundary = b"--" + content_type.split("boundary=", 1)[1].strip('"').encode()
        _, meta_part, content_part = raw.split(boundary)[:3]
        newline = b"\r\n" if meta_part.startswith(b"\r\n") else b"\n"
        _, meta = meta_part[len(newline) :].split(newline * 2, 1)
        headers, content = content_part[len(newline) :].split(newline * 2, 1)
        assert content.endswith(newline), "a part ends with a line ending before the next boundary"
        part_type = next(
            (
                line.split(b":", 1)[1].strip().decode()
                for line in headers.split(newline)
                if line.lower().startswith(b"content-type:")
            ),
            "application/octet-stream",
        )
        return {"meta": json.loads(meta), "content": content[: -len(newline)], "content-type": part_type}

    return read


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator on a free loopback port with one bucket, and the environment (this module
    only) that points gcsfs at it. gcsfs's experimental zonal/HNS layer stalls on the emulator."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    read_data = emulator._read_data
    emulator._read_data = exact_multipart_uploads(read_data)
    server.start()
    requests = RequestLog()
    logger = logging.getLogger(emulator.__name__)
    logger.addHandler(requests)
    level = logger.level
    logger.setLevel(logging.INFO)
    env = {
        "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "TRAINFLOW_CACHE": str(tmp_path_factory.mktemp("gcs-cache")),
        "TRAINFLOW_LEASE_SECONDS": "3",  # renewed every second: the test sees renewals
        # TensorStore's GCS driver rejects the emulator's upload responses ("Malformed
        # StorageGeneration" writing an OCDBT manifest), so here the engine's checkpoints are
        # staged and uploaded by the runner; the engine at the URL is tested on moto's S3.
        "TRAINFLOW_STAGED_CHECKPOINTS": "1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield requests
    finally:
        logger.removeHandler(requests)
        logger.setLevel(level)
        server.stop()
        emulator._read_data = read_data
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
    statuses = {
        line.split()[0]: line.split()[2]
        for line in proc.stdout.splitlines()
        if line.split()[:1] in (["tokenize"], ["pretrain"]) and len(line.split()) > 2
    }
    assert statuses == {"tokenize": "skipped", "pretrain": "skipped"}, proc.stdout[-2000:]


def test_gcs_lease_is_created_only_if_absent(finished, gcs):
    """Each stage's lease was created with ifGenerationMatch=0 (GCS answers 412 when the object
    exists; the emulator does not, hence the request check) and renewed without it."""
    leases = [
        line
        for line in gcs.lines
        if "/.lease" in line and "upload_id=" not in line and line.startswith('"POST /upload/storage/v1/b/')
    ]
    creates = [line for line in leases if "ifGenerationMatch=0" in line]
    renewals = [line for line in leases if "ifGenerationMatch" not in line]
    assert any("/tokenize/" in line for line in creates) and any("/pretrain/" in line for line in creates), leases
    assert any("/pretrain/" in line for line in renewals), leases


def test_small_binary_files_keep_their_last_byte_whatever_it_is(gcs, tmp_path):
    """The bytes a checkpoint file may end with, a carriage return included, round-trip through
    the store's gs:// file system (the emulator's multipart reader, above, keeps them)."""
    fs = objectstore._filesystem(f"gs://{BUCKET}")
    for i, tail in enumerate((b"\r", b"\n", b"\r\n", b"\x00")):
        local = tmp_path / f"f{i}"
        local.write_bytes(b"\x08\x01manifest" + tail)
        fs.put_file(str(local), f"{BUCKET}/bytes/f{i}")
        assert fs.cat_file(f"{BUCKET}/bytes/f{i}") == local.read_bytes(), tail
