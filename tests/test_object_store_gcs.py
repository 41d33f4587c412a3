"""The artifact store on gs:// against a real GCS protocol server (gcp-storage-emulator) on
127.0.0.1, started by this module; the environment points gcsfs at it (STORAGE_EMULATOR_HOST)
and TensorStore's GCS driver too (engine/train/bucket_paths.py). The engine writes its
checkpoints at the artifact's gs:// URL, as on GCS; nothing of them is staged on the runner's disk.

Four gaps of the emulator, each a departure from GCS, are corrected where the fixture starts it
(see `corrected_emulator`): media downloads without the object's generation headers, the
objects.move endpoint missing, a multipart upload's last byte dropped, and a listen queue of 5
connections.

The emulator ignores `ifGenerationMatch=0` (it overwrites), so the GCS lease is checked on the
request it sends, read from the emulator's request log; the lease race itself is tested end to
end on S3 (tests/test_object_store.py).
"""

import contextlib
import functools
import http.server
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import types
import warnings
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path

import pytest
import yaml

from tasks.store import objects as store_objects
from tasks.store.base import ArtifactStore
from tasks.store.objects import read_url
from tests.deps import need
from tests.test_object_store import Stalled, tiny_pipeline, trainflow

emulator = need("gcp_storage_emulator.server")
need("gcsfs")
from gcp_storage_emulator import settings  # noqa: E402  (after the skip: the emulator is a test extra)
from gcp_storage_emulator.exceptions import NotFound  # noqa: E402
from gcp_storage_emulator.handlers import objects  # noqa: E402

STEPS = 6
BUCKET = "trainflow-gcs"


class RequestLog(logging.Handler):
    """The emulator's request lines ("POST /upload/storage/v1/b/... HTTP/1.1")."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []
        self.times: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.times.append(record.created)


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


def with_generation_headers(download):
    """The emulator's object download with the object's `x-goog-generation` and
    `x-goog-metageneration` headers, which GCS sends with an object's bytes and the emulator
    leaves out. TensorStore's GCS driver takes a read's generation from that header, 0 when
    it is absent (SetObjectMetadataFromHeaders), and refuses a write conditioned on generation
    0 (IsValidStorageGeneration: "Malformed StorageGeneration"): without the header, a handle
    that read an OCDBT manifest it had not written itself (another process's, or one written
    before a restart) could not rewrite it."""

    def download_with_generation(request, response, storage, *args, **kwargs):
        try:  # read before the bytes: the header names a generation no newer than they are
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except NotFound:
            obj = None
        download(request, response, storage, *args, **kwargs)
        if obj is not None and response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            response["x-goog-generation"] = obj["generation"]
            response["x-goog-metageneration"] = obj["metageneration"]

    return download_with_generation


def move(request, response, storage, *args, **kwargs):
    """objects.move (`POST .../o/SOURCE/moveTo/o/DESTINATION`), which GCS has and the emulator
    answers 501: gcsfs's rename (an engine step's digests.json) retried that with backoff for
    ~36 s before falling back to a copy and a delete, which this does in one request."""
    bucket, source = request.params["bucket_name"], request.params["object_id"]
    try:
        moved = objects._copy(request.base_url, storage, bucket, source, bucket, request.params["dest_object_id"])
    except NotFound:
        response.status = HTTPStatus.NOT_FOUND
        return
    objects._delete(storage, bucket, source)
    response.json(moved)


class OneRequestAtATime(emulator.RequestHandler):
    """The emulator's request handler, its requests served one at a time (the emulator's
    storage is not thread-safe) while their connections are read on threads of their own; a
    connection that sends nothing for a minute is closed."""

    timeout = 60
    lock = threading.Lock()

    def handle_one_request(self):
        # Reading the request line and headers happens outside the lock, so a client slow to
        # send (or one holding an idle connection open) never blocks the others' requests.
        try:
            self.raw_requestline = self.rfile.readline(65537)
        except TimeoutError:  # a connection idle for `timeout` seconds
            self.raw_requestline = b""
        if not self.raw_requestline:
            self.close_connection = True
            return
        if not self.parse_request():
            return
        method = getattr(self, "do_" + self.command, None)
        if method is None:
            self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"Unsupported method ({self.command!r})")
            return
        with self.lock:
            method()
        self.wfile.flush()


class ConcurrentEmulatorServer(http.server.ThreadingHTTPServer):
    """The emulator's HTTP server as GCS is: every connection accepted and read at once, with
    a listen queue as deep as a real server's. The emulator's own (http.server's HTTPServer)
    serves one connection at a time from a queue of 5: under a loaded suite, the bursts of
    connections a stage opens at once (gcsfs's batched puts, the fetch threads, TensorStore)
    overflowed it and the kernel dropped their SYNs (each retried after 1, 2, 4 ... s), and a
    connection the server had accepted but whose client was slow to send held every other
    one back. GCS accepts and serves every connection."""

    request_queue_size = 1024
    daemon_threads = True

    def __init__(self, address, handler):  # handler: partial(emulator.RequestHandler, storage)
        super().__init__(address, functools.partial(OneRequestAtATime, *handler.args))


@contextlib.contextmanager
def corrected_emulator():
    """The emulator's routes, multipart reader and listen queue with the corrections above, for
    as long as the context lasts (the emulator's module globals, read on every request)."""
    handlers, download, read_data = emulator.HANDLERS, objects.download, emulator._read_data
    http_server = emulator.server
    corrected = with_generation_headers(download)
    moves = tuple(
        (
            rf"^{prefix}/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/(?P<dest_object_id>.*[^/]+)$",
            {"POST": move},
        )
        for prefix in (settings.API_ENDPOINT, "")
    )
    emulator.HANDLERS = moves + tuple(
        (regex, {method: corrected if handler is download else handler for method, handler in routes.items()})
        for regex, routes in handlers
    )
    objects.download = corrected  # objects.get serves `?alt=media` through this name
    emulator._read_data = exact_multipart_uploads(read_data)
    emulator.server = types.SimpleNamespace(HTTPServer=ConcurrentEmulatorServer)  # the one name APIThread.run reads
    try:
        yield
    finally:
        emulator.HANDLERS, objects.download, emulator._read_data = handlers, download, read_data
        emulator.server = http_server


@dataclass
class Emulator:
    url: str
    requests: RequestLog
    cache: Path
    """TRAINFLOW_CACHE: the runner's disk (staging directories, consumed inputs)."""


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The corrected emulator on a free loopback port with one bucket, and the environment (this
    module only) that points gcsfs and TensorStore at it. gcsfs's experimental zonal/HNS layer
    stalls on the emulator."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url, cache = f"http://127.0.0.1:{port}", tmp_path_factory.mktemp("gcs-cache")
    env = {
        "STORAGE_EMULATOR_HOST": url,
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "TRAINFLOW_CACHE": str(cache),
        "TRAINFLOW_LEASE_SECONDS": "3",  # renewed every second: the test sees renewals
        "TRAINFLOW_STAGED_CHECKPOINTS": "",  # the engine writes its checkpoints at the URL
        # A TensorStore request that stalls (no byte for a minute) fails and is retried, as
        # against GCS, instead of waiting for ever.
        "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": "60",
        "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES": "1",
    }
    saved = {k: os.environ.get(k) for k in env}
    logger = logging.getLogger(emulator.__name__)
    requests, level = RequestLog(), logger.level
    with corrected_emulator():
        server = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
        server.start()
        logger.addHandler(requests)
        logger.setLevel(logging.INFO)
        os.environ.update(env)
        try:
            yield Emulator(url, requests, cache)
        finally:
            logger.removeHandler(requests)
            logger.setLevel(level)
            server.stop()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


STALL_BUDGET = pytest.mark.timeout(1800)
"""The tests on `finished`: its setup is the first run (300 s) and, where that stalls, the
resumed run (1200 s), beyond pytest-timeout's 900 s per test (pyproject.toml). Under load
here (four test processes on two cores) the first run stalled in its final checkpoint save
and the resumed one was still taking over its lease at 900 s."""


@pytest.fixture(scope="module")
def finished(prefect_server, gcs, tmp_path_factory):
    store = f"gs://{BUCKET}/runs/x"
    pipeline = tiny_pipeline(tmp_path_factory.mktemp("pipeline"))
    run = ("run", pipeline, "--store", store, f"pretrain.steps={STEPS}")
    try:
        trainflow(*run, timeout=300)
    except Stalled as stalled:
        # A run that stalls against the emulator (seen in CI, never reproduced here: once in a
        # few suites) is killed and run again, as a user resumes a failed run; the second must
        # finish, resuming what the first left in the bucket. The stall is reported, not hidden.
        first = f"{emulator_tail(gcs)}\n{stalled}"
        warnings.warn(f"the first gs:// run stalled and was resumed: {first[:6000]}", stacklevel=1)
        try:  # a resume waits out the killed run's lease first (its holder's heartbeat stopped)
            trainflow(*run, timeout=1200)
        except AssertionError as e:  # the emulator's side first: the output after it is long
            raise AssertionError(f"{emulator_tail(gcs)}\n{e}\n\nthe first run:\n{first[:6000]}") from None
    except AssertionError as e:
        raise AssertionError(f"{emulator_tail(gcs)}\n{e}") from None
    return store, pipeline


def emulator_tail(gcs: Emulator, lines: int = 40) -> str:
    """The emulator's last requests (status, time and seconds each waited for and held the
    emulator) and every error it logged: where a run stalls against it, which request it
    made last and how the emulator answered."""
    log = gcs.requests
    errors = [line for line in log.lines if not line.startswith('"')]
    stamped = [f"{time.strftime('%H:%M:%S', time.localtime(t))} {line}" for t, line in zip(log.times, log.lines)]
    return (
        f"the GCS emulator's last {lines} requests of {len(log.lines)} (now {time.strftime('%H:%M:%S')}):\n"
        + "\n".join(stamped[-lines:])
        + f"\nthe emulator's errors ({len(errors)}):\n"
        + "\n".join(errors[-20:])
    )


@STALL_BUDGET
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


def _checkpoint_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and "/checkpoint/" in p.as_posix()]


@STALL_BUDGET
def test_pretrain_on_gcs_writes_its_checkpoint_at_the_url_and_none_on_the_runners_disk(finished, gcs):
    """The engine was handed the artifact's gs:// URL and wrote the step there itself (its OCDBT
    shards, digests.json); the manifest records exactly those objects; the runner's disk (the
    store's staging directories, the cache) holds no checkpoint file."""
    store, pipeline = finished
    rows = json.loads(trainflow("ls", "--store", store, "--json").stdout)
    url = f"{store}/pretrain/{next(r for r in rows if r['stage'] == 'pretrain')['id']}"
    config = yaml.safe_load(read_url(f"{url}/train.yaml"))
    assert config["checkpoint"]["directory"] == f"{url}/checkpoint"
    fs = store_objects._filesystem(store)
    fs.invalidate_cache()
    prefix = url.removeprefix("gs://") + "/"
    listed = {key.removeprefix(prefix) for key in fs.find(prefix + "checkpoint")}
    assert f"checkpoint/{STEPS}/digests.json" in listed, sorted(listed)
    assert any(key.startswith(f"checkpoint/{STEPS}/params/ocdbt.process_0/") for key in listed), sorted(listed)
    manifest = ArtifactStore(store).manifest(*url.rsplit("/", 2)[-2:])
    assert manifest is not None
    assert {rel for rel in manifest["files"] if rel.startswith("checkpoint/")} == listed
    assert _checkpoint_files(gcs.cache) == []
    assert _checkpoint_files(pipeline.parent) == []


@STALL_BUDGET
def test_rerun_on_gcs_skips_everything(finished):
    store, pipeline = finished
    proc = trainflow("run", pipeline, "--store", store, f"pretrain.steps={STEPS}")
    statuses = {
        line.split()[0]: line.split()[2]
        for line in proc.stdout.splitlines()
        if line.split()[:1] in (["tokenize"], ["pretrain"]) and len(line.split()) > 2
    }
    assert statuses == {"tokenize": "skipped", "pretrain": "skipped"}, proc.stdout[-2000:]


@STALL_BUDGET
def test_gcs_lease_is_created_only_if_absent(finished, gcs):
    """Each stage's lease was created with ifGenerationMatch=0 (GCS answers 412 when the object
    exists; the emulator does not, hence the request check) and renewed without it."""
    leases = [
        line
        for line in gcs.requests.lines
        if "/.lease" in line and "upload_id=" not in line and line.startswith('"POST /upload/storage/v1/b/')
    ]
    creates = [line for line in leases if "ifGenerationMatch=0" in line]
    renewals = [line for line in leases if "ifGenerationMatch" not in line]
    assert any("/tokenize/" in line for line in creates) and any("/pretrain/" in line for line in creates), leases
    assert any("/pretrain/" in line for line in renewals), leases


def test_small_binary_files_keep_their_last_byte_whatever_it_is(gcs, tmp_path):
    """The bytes a checkpoint file may end with, a carriage return included, round-trip through
    the store's gs:// file system (the emulator's multipart reader, above, keeps them)."""
    fs = store_objects._filesystem(f"gs://{BUCKET}")
    for i, tail in enumerate((b"\r", b"\n", b"\r\n", b"\x00")):
        local = tmp_path / f"f{i}"
        local.write_bytes(b"\x08\x01manifest" + tail)
        fs.put_file(str(local), f"{BUCKET}/bytes/f{i}")
        assert fs.cat_file(f"{BUCKET}/bytes/f{i}") == local.read_bytes(), tail


OCDBT_WRITE = """
import sys, tensorstore as ts
store = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "gcs", "bucket": sys.argv[1], "path": "ocdbt/"}})
store.result().write(sys.argv[2], b"value").result()
print(sorted(key.decode() for key in store.result().list().result()))
"""


def test_a_process_rewrites_an_ocdbt_manifest_that_another_process_wrote(gcs):
    """As Orbax's processes and a resumed run do: each write is a fresh process that reads the
    manifest (its generation from the download's headers) and rewrites it conditioned on that
    generation. Without the emulator's generation headers the second write failed."""
    env = {**os.environ, "TENSORSTORE_GCS_HTTP_URL": gcs.url}
    for i, want in enumerate((["a"], ["a", "b"], ["a", "b", "c"])):
        proc = subprocess.run(
            [sys.executable, "-c", OCDBT_WRITE, BUCKET, "abc"[i]], env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split("\n")[-2] == str(want)


def test_a_rename_in_the_bucket_is_one_move(gcs):
    """gcsfs renames with objects.move (how an engine step's digests.json lands); the emulator
    moves the bytes in that one request."""
    fs = store_objects._filesystem(f"gs://{BUCKET}")
    fs.pipe_file(f"{BUCKET}/moves/digests.json.tmp", b"{}\r")
    before = len(gcs.requests.lines)
    fs.mv(f"{BUCKET}/moves/digests.json.tmp", f"{BUCKET}/moves/digests.json")
    assert fs.cat_file(f"{BUCKET}/moves/digests.json") == b"{}\r"
    assert not fs.exists(f"{BUCKET}/moves/digests.json.tmp")
    moves = [line for line in gcs.requests.lines[before:] if "/moveTo/o/" in line]
    assert len(moves) == 1 and '" 200 ' in moves[0], gcs.requests.lines[before:]
