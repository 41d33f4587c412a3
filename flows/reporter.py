"""Reporting to the Prefect API without ever waiting on it.

Prefect observes a pipeline; it never holds it up. What a run sends to the API while its
stages work — progress and summary artifacts, the run loggers' records (the stages' log
lines among them), task-run events — goes through one bounded queue served by one
background thread, the `Reporter`:

- a stage hands a record over and goes on; when the queue is full the record is dropped;
- every request has a short timeout and no client retries;
- when the API does not answer, the reporter prints one warning naming the API URL and
  drops records until a health probe (at most one every 30 s) finds it answering again.

`observing()` routes Prefect's own senders through it for the length of a run: the run
loggers' API handler and the events client. A tagged task run also asks the API for its
tags' concurrency slots before it starts; while observing, an API that does not answer
lets it start without them (one warning) rather than fail the stage. Prefect's engine still
writes the flow run's states itself; flows/pipeline.py bounds how long the run waits for
the last one. Prefect's background services' errors about items they could not handle
while the API does not answer (its events worker reads the API to tag each event) become
that same one warning.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import httpx
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.context import SettingsContext, get_settings_context
from prefect.events.schemas.events import Event
from prefect.settings import (
    PREFECT_API_REQUEST_TIMEOUT,
    PREFECT_API_URL,
    PREFECT_CLIENT_MAX_RETRIES,
)

from flows.prefect_compat import (
    RUN_LOGGERS,
    SERVICES_LOGGER,
    APILogHandler,
    ConcurrencySlotAcquisitionError,
    is_service_failure,
    log_payload,
    logs_to_api,
    set_events_queue,
    set_task_run_concurrency,
    task_run_concurrency,
    wait_for_events_worker,
)
from flows.server import api_answers

CALL, LOG, EVENT = "call", "log", "event"
_BATCH = 200  # logs or events sent in one request


class Reporter:
    """One background thread sending queued records to the Prefect API at `api_url`."""

    def __init__(
        self,
        api_url: str,
        *,
        max_pending: int = 5000,
        timeout: float = 5.0,
        probe_every: float = 30.0,
        warn: Callable[[str], None] | None = None,
    ):
        self.api_url = api_url
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=max_pending)
        self._timeout, self._probe_every = timeout, probe_every
        self._warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
        self._down_since: float | None = None
        self._last_probe = 0.0
        self.dropped = 0
        self._warned: set[str] = set()
        self._closing = threading.Event()
        self._lock = threading.Lock()
        # The settings every report is sent under (this API, a short timeout, no retries), built
        # once: Prefect's `temporary_settings` validates the whole settings tree each time, and
        # per record that was most of the reporter's CPU (below).
        current = get_settings_context()
        self._profile = current.profile
        self._settings = current.settings.copy_with_update(
            updates={PREFECT_API_URL: api_url, PREFECT_CLIENT_MAX_RETRIES: 0, PREFECT_API_REQUEST_TIMEOUT: timeout}
        )
        self._client: SyncPrefectClient | None = None
        """The client logs and events are posted with, kept open by the reporter's thread."""
        self._thread = threading.Thread(target=self._serve, name="prefect-reporter", daemon=True)
        self._thread.start()

    @property
    def down(self) -> bool:
        return self._down_since is not None

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    # ---------------------------------------------------------------- what stages call (never blocks)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run `fn(*args, **kwargs)` on the reporter's thread, in the caller's context (so
        Prefect knows the flow and task run an artifact belongs to)."""
        self._put(CALL, (contextvars.copy_context(), fn, args, kwargs))

    def log(self, payload: dict) -> None:
        """A log record as the API's `LogCreate` JSON."""
        self._put(LOG, payload)

    def event(self, event: Event) -> None:
        self._put(EVENT, event)

    def _put(self, kind: str, item: Any) -> None:
        if self.down and not self._probe_due():
            self.dropped += 1
            return
        try:
            self._queue.put_nowait((kind, item))
        except queue.Full:
            self.dropped += 1

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for what is queued to be sent (or dropped); while
        observing, first for Prefect's events worker to hand its events over."""
        deadline = time.monotonic() + timeout
        if _observing_depth:
            wait_for_events_worker(timeout)
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued within `timeout` (nothing if the API is down), then stop the
        thread: at interpreter exit a daemon thread caught inside a request would abort it."""
        self.flush(0 if self.down else timeout)
        self._closing.set()
        self._thread.join(self._timeout + 1.0)

    def api_failed(self, reason: str) -> None:
        """Someone else found the API not answering: warn (once) and stop sending."""
        with self._lock:
            if self.down:
                return
            self._down_since = self._last_probe = time.monotonic()
        self._warn(
            f"trainflow: warning: the Prefect API at {self.api_url} is not answering ({reason}); "
            f"the run goes on without it, and its progress, logs and artifacts are not reported "
            f"until it answers again"
        )

    # ---------------------------------------------------------------- the reporter's thread

    def _probe_due(self) -> bool:
        return time.monotonic() - self._last_probe >= self._probe_every

    def _api_is_back(self) -> bool:
        self._last_probe = time.monotonic()
        if not api_answers(self.api_url, timeout=2.0):
            return False
        self._down_since = None
        self._warn(f"trainflow: the Prefect API at {self.api_url} answers again; reporting resumed")
        return True

    def _serve(self) -> None:
        try:
            self._serve_until_closed()
        finally:
            self._drop_client()

    def _serve_until_closed(self) -> None:
        while True:
            try:
                items = [self._queue.get(timeout=0.1)]
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            while len(items) < _BATCH:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                if self._closing.is_set() or (self.down and not (self._probe_due() and self._api_is_back())):
                    self.dropped += len(items)
                    continue
                self._send(items)
            except Exception as e:  # a bug here must not end the thread that all reports wait on
                self._warn_once(e)
            finally:
                for _ in items:
                    self._queue.task_done()

    def _send(self, items: list[tuple[str, Any]]) -> None:
        logs = [item for kind, item in items if kind == LOG]
        events = [item for kind, item in items if kind == EVENT]
        calls = [item for kind, item in items if kind == CALL]
        if logs:
            self._attempt(contextvars.Context(), self._post, "/logs/", logs)
        if events:
            self._attempt(contextvars.Context(), self._post, "/events", [e.model_dump(mode="json") for e in events])
        for context, fn, args, kwargs in calls:
            if self.down:
                self.dropped += 1
            else:
                self._attempt(context, fn, *args, **kwargs)

    def _post(self, path: Literal["/logs/", "/events"], body: list) -> None:
        """POST `body` with the reporter's client, opened on first use (under the reporter's
        settings, in `_attempt`) and kept: a new client per request (an SSL context, an httpx
        pool) cost as much CPU as the settings did."""
        if self._client is None:
            self._client = get_client(sync_client=True).__enter__()
        self._client.request("POST", path, json=body).raise_for_status()

    def _drop_client(self) -> None:
        """Close the kept client (the next post opens a new one)."""
        client, self._client = self._client, None
        if client is not None:
            try:
                client.__exit__(None, None, None)
            except Exception:  # closing what a dead API left half open: nothing to keep
                pass

    def _attempt(self, context: contextvars.Context, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """`fn` in `context`, with a short timeout and no retries for its API requests."""

        def quick():
            with SettingsContext(profile=self._profile, settings=self._settings):
                fn(*args, **kwargs)

        try:
            context.run(quick)
        except Exception as e:
            if unreachable(e):
                self._drop_client()
                self.api_failed(f"{type(e).__name__}: {e}".rstrip(": "))
            else:
                self._warn_once(e)

    def _warn_once(self, error: Exception) -> None:
        """A record the API refused (not a dead API): say so once per kind of error."""
        if type(error).__name__ not in self._warned:
            self._warned.add(type(error).__name__)
            self._warn(
                f"trainflow: warning: a report to the Prefect API at {self.api_url} failed "
                f"({type(error).__name__}: {error}); the run goes on"
            )


def unreachable(error: BaseException) -> bool:
    """Whether `error` says the API is not answering (as opposed to refusing a record)."""
    if isinstance(error, httpx.HTTPStatusError):
        return error.response.status_code >= 500
    return isinstance(error, (httpx.TransportError, OSError, TimeoutError))


_reporters: dict[str, Reporter] = {}
_reporters_lock = threading.Lock()


def reporter_for(api_url: str) -> Reporter:
    """The process's reporter to `api_url` (one thread per API, whatever the number of runs)."""
    with _reporters_lock:
        if api_url not in _reporters or _reporters[api_url].closed:
            _reporters[api_url] = Reporter(api_url)
            atexit.register(_reporters[api_url].close)
        return _reporters[api_url]


# --------------------------------------------------------------------------- Prefect's senders


class _QueuedLogs(APILogHandler):
    """Prefect's API log handler, with the reporter in place of Prefect's log worker."""

    def __init__(self, reporter: Reporter, level: int):
        super().__init__(level)
        self._reporter = reporter

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if not logs_to_api() or not getattr(record, "send_to_api", True):
                return
            self._reporter.log(log_payload(self, record))
        except Exception:
            self.handleError(record)

    def flush(self) -> None:  # nothing to wait for: the reporter sends on its own
        pass


class _EventQueue:
    """What Prefect's forwarding events client puts events into (task-run states travel as
    events): the reporter."""

    def __init__(self, reporter: Reporter):
        self._reporter = reporter

    def put(self, item: tuple[str, Event]) -> None:
        self._reporter.event(item[1])


def _slots_or_none(reporter: Reporter):
    """Prefect's task-run concurrency (the slots of the run's tags), except that a run whose
    API does not answer goes on without them: a concurrency limit cannot be honoured then,
    and a stage must not fail for want of a record. (`observing` makes it what Prefect's task
    engine enters, through flows/prefect_compat.py, for the length of a run.)"""

    @contextmanager
    def slots(names, *args, **kwargs) -> Iterator[None]:
        if names and not reporter.down and not api_answers(reporter.api_url, timeout=2.0):
            reporter.api_failed("its health check failed")
        if names and reporter.down:  # asking would only fail, after Prefect's retries
            yield
            return
        held = task_run_concurrency(names, *args, **kwargs)
        try:
            held.__enter__()
        except ConcurrencySlotAcquisitionError as e:
            if not unreachable(e.__cause__ or e):
                raise
            reporter.api_failed(f"concurrency slots for {', '.join(names)}: {e.__cause__ or e}")
            yield
            return
        try:
            yield
        except BaseException:
            if not _release_quietly(held, reporter, *sys.exc_info()):
                raise
        else:
            _release_quietly(held, reporter, None, None, None)

    return slots


def _release_quietly(held, reporter: Reporter, *exc_info) -> bool:
    try:
        return bool(held.__exit__(*exc_info))
    except Exception as e:  # the slots' release: the API went away during the stage
        if not unreachable(e.__cause__ or e):
            raise
        reporter.api_failed(f"releasing concurrency slots: {e}")
        return False


class _ServiceErrorsOfADeadApi(logging.Filter):
    """Prefect's background services log an error for each item they could not handle: its
    events worker reads the run's flow and flow run from the API to tag each event, so on a
    loaded machine, where it lags behind, every event it takes up after the API died is an
    error line (and at exit, one more for the items still queued). Where the API does not
    answer, those are the reporter's one warning; otherwise they pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not is_service_failure(record):
            return True
        with _reporters_lock:
            reporters = list(_reporters.values())
        for reporter in reporters:
            if reporter.down:
                return False
            if not api_answers(reporter.api_url, timeout=2.0):
                reporter.api_failed("its events could not be prepared")
                return False
        return True


_service_errors = _ServiceErrorsOfADeadApi()
_observing: list[tuple[logging.Logger, logging.Handler, logging.Handler]] = []
_observing_depth = 0
_observing_lock = threading.Lock()


@contextmanager
def observing(api_url: str) -> Iterator[Reporter]:
    """For the length of a run, send the run loggers' records and Prefect's events through
    the reporter to `api_url`; yields the reporter. Re-entrant."""
    global _observing_depth
    reporter = reporter_for(api_url)
    with _observing_lock:
        # Stays on after the run: Prefect's services drain their queues at exit.
        if _service_errors not in logging.getLogger(SERVICES_LOGGER).filters:
            logging.getLogger(SERVICES_LOGGER).addFilter(_service_errors)
        if _observing_depth == 0:
            for name in RUN_LOGGERS:
                logger = logging.getLogger(name)
                for handler in list(logger.handlers):
                    if isinstance(handler, APILogHandler):
                        queued = _QueuedLogs(reporter, handler.level)
                        queued.setFormatter(handler.formatter)
                        logger.removeHandler(handler)
                        logger.addHandler(queued)
                        _observing.append((logger, handler, queued))
            set_events_queue(_EventQueue(reporter))
            set_task_run_concurrency(_slots_or_none(reporter))
        _observing_depth += 1
    try:
        yield reporter
    finally:
        with _observing_lock:
            _observing_depth -= 1
            if _observing_depth == 0:
                set_events_queue(None)
                set_task_run_concurrency(task_run_concurrency)
                while _observing:
                    logger, handler, replacement = _observing.pop()
                    logger.removeHandler(replacement)
                    logger.addHandler(handler)
