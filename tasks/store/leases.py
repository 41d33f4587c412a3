"""Leases: the lock of an artifact on a bucket, for runs on other machines.

A lease is the object `<artifact>/.lease`, written with a conditional create (`If-None-Match: *`
on S3 through boto3, whose fsspec layer has no conditional PUT; an exclusive create through
fsspec elsewhere, `ifGenerationMatch=0` on GCS), renewed by a thread while the stage runs and
taken over only after it expires -- or at once when its holder ran on the same machine and is
gone (tasks/store/processes.py: a killed run resumed where it ran).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from tasks.store.processes import holder_is_gone, this_process

LEASE = ".lease"
LEASE_SECONDS = float(os.environ.get("TRAINFLOW_LEASE_SECONDS", "60"))


class Bucket(Protocol):
    """What a lease uses of the bucket it lies in (tasks/store/objects.py RemoteBackend)."""

    protocol: str
    fs: Any
    """The bucket's fsspec file system."""

    def read_json(self, key: str) -> dict | None: ...


class Lease:
    """A lease object created with a conditional create, renewed by a thread while held."""

    def __init__(self, backend: Bucket, key: str, run_id: str | None = None, seconds: float | None = None):
        self.backend = backend
        self.key = key
        self.seconds = float(seconds if seconds is not None else LEASE_SECONDS)
        self.token = uuid.uuid4().hex
        self.run_id = run_id
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    @property
    def url(self) -> str:
        return f"{self.backend.protocol}://{self.key}"

    def _body(self) -> bytes:
        return json.dumps(
            {
                **this_process(),
                "run_id": self.run_id,
                "token": self.token,
                "expires": time.time() + self.seconds,
            }
        ).encode()

    def _client_put(self, body: bytes, if_none_match: bool) -> bool:
        """PUT the lease; with if_none_match, only if no object exists (False when one does)."""
        if self.backend.protocol != "s3":  # other backends: exclusive create where fsspec has it
            try:
                with self.backend.fs.open(self.key, "xb" if if_none_match else "wb") as f:
                    f.write(body)
                return True
            except FileExistsError:
                return False
        import botocore.exceptions

        bucket, key = self.key.split("/", 1)
        client = _boto_client()
        kwargs = {"IfNoneMatch": "*"} if if_none_match else {}
        try:
            client.put_object(Bucket=bucket, Key=key, Body=body, **kwargs)
            return True
        except botocore.exceptions.ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return False
            raise

    def holder(self) -> dict | None:
        self.backend.fs.invalidate_cache(self.key)
        return self.backend.read_json(self.key)

    def try_acquire(self) -> bool:
        if self._client_put(self._body(), if_none_match=True):
            return True
        info = self.holder()
        if info is None:  # released between our PUT and our read
            return self._client_put(self._body(), if_none_match=True)
        # Expired, or its holder ran on this machine and is gone (a killed run, resumed here):
        # take it over.
        if float(info.get("expires", 0)) < time.time() or holder_is_gone(info):
            try:
                self.backend.fs.rm_file(self.key)
            except FileNotFoundError:
                pass
            return self._client_put(self._body(), if_none_match=True)
        return False

    def acquire(
        self,
        blocking: bool = True,
        poll_seconds: float = 2.0,
        on_wait: Callable[[str], None] | None = None,
        wait_message_every: float = 30.0,
    ) -> bool:
        last = -float("inf")
        while not self.try_acquire():
            if not blocking:
                return False
            if on_wait and time.monotonic() - last >= wait_message_every:
                on_wait(f"waiting for {self.url.removesuffix('/' + LEASE)}: leased by {describe(self.holder())}")
                last = time.monotonic()
            time.sleep(poll_seconds)
        self._thread = threading.Thread(target=self._renew, name="lease-renew", daemon=True)
        self._thread.start()
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            info = self.holder()
            if not info or info.get("token") != self.token:
                self.lost = True  # taken over: our run was presumed dead
                return
            try:
                self._client_put(self._body(), if_none_match=False)
            except Exception:
                pass  # retried at the next tick; the lease lasts 3 ticks

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
            info = self.holder()
            if info and info.get("token") == self.token:
                try:
                    self.backend.fs.rm_file(self.key)
                except FileNotFoundError:
                    pass

    def is_held(self) -> bool:
        info = self.holder()
        return info is not None and float(info.get("expires", 0)) >= time.time()


def describe(info: dict | None) -> str:
    if not info:
        return "another run"
    left = float(info.get("expires", 0)) - time.time()
    return (
        f"pid {info.get('pid')} on {info.get('host')} (run {info.get('run_id') or '?'}), "
        f"lease expires in {max(left, 0):.0f}s"
    )


_CLIENTS: dict[str | None, Any] = {}


def _boto_client():
    """One boto3 S3 client per endpoint (the environment may point elsewhere later: a test's
    second server, a process that switches stores)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint not in _CLIENTS:
        import boto3

        _CLIENTS[endpoint] = boto3.client("s3", endpoint_url=endpoint)
    return _CLIENTS[endpoint]
