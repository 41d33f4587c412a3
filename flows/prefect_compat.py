"""Every Prefect internal trainflow touches, in one place, each checked by a test.

flows/reporter.py keeps a run from waiting on the Prefect API by routing Prefect's own
senders through its queue. Prefect has public API for part of that (the concurrency slot
error, the API log handler, the settings); the rest — the name its task engine calls for a
task run's concurrency slots, the events worker's client override, the logger and message
of its background services — is internal, and a release that renames one would make a
patch silently do nothing. So each internal name is spelled here once, `PRIVATE` lists
them, tests/test_prefect_compat.py fails (naming the name and the Prefect version) when one
has moved, and the setters below refuse to set an attribute that is not there. Nothing else
in trainflow imports a private Prefect name (tests/test_prefect_compat.py checks that too).

Written against Prefect 3.9 (pyproject pins >=3.9.1,<3.10).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import prefect
import prefect.task_engine

# Private: the context manager Prefect's task engine enters for a task run's tag slots.
from prefect.concurrency._sync import concurrency as task_run_concurrency

# Public: the slot error re-exported by prefect.concurrency.asyncio, the API log handler,
# the settings context.
from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError
from prefect.context import get_settings_context

# Internal (no public way to redirect a run's events): the events worker and the client
# that forwards events into a queue, which Prefect itself uses for process pools.
from prefect.events.worker import EventsWorker, ProcessPoolForwardingEventsClient
from prefect.logging.handlers import APILogHandler

__all__ = [
    "APILogHandler",
    "ConcurrencySlotAcquisitionError",
    "PRIVATE",
    "RUN_LOGGERS",
    "SERVICES_LOGGER",
    "is_service_failure",
    "log_payload",
    "logs_to_api",
    "set_events_queue",
    "set_task_run_concurrency",
    "task_run_concurrency",
    "wait_for_events_worker",
]

TASK_ENGINE_CONCURRENCY = "_concurrency"
"""The name prefect.task_engine calls (`with _concurrency(names=[tag:...], ...)`) for a task
run's concurrency slots; swapping the module attribute swaps what every task run enters."""
SERVICES_LOGGER = "prefect._internal.concurrency"
"""The logger of Prefect's background services (the events and log workers)."""
SERVICE_FAILED = "Service %r failed"
"""How each of their 'could not handle an item' errors begins (the record's unformatted msg)."""
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs", "prefect.extra")
"""The loggers whose records Prefect sends to the API (its logging.yml gives each an APILogHandler)."""
PAYLOAD_SIZE = "__payload_size__"
"""The key APILogHandler.prepare adds for its own log worker's batching; not part of a log."""

PRIVATE: dict[str, str] = {
    "prefect.task_engine._concurrency": "swapped for the run: slots without waiting on a dead API",
    "prefect.concurrency._sync.concurrency": "what the task engine enters, restored after the run",
    "prefect.events.worker.EventsWorker.set_client_override": "a run's events go to the reporter's queue",
    "prefect.events.worker.ProcessPoolForwardingEventsClient": "the client that puts events into that queue",
    "prefect._internal.concurrency (logger)": "its services' errors while the API is down become one warning",
    "APILogHandler.prepare -> __payload_size__": "a log record as the API takes it",
}
"""Each internal name this module relies on -> what for (tests/test_prefect_compat.py checks each)."""


def _moved(name: str) -> RuntimeError:
    return RuntimeError(
        f"Prefect {prefect.__version__} has no {name}, which flows/prefect_compat.py relies on "
        "(written for Prefect 3.9); update flows/prefect_compat.py for this Prefect"
    )


def set_task_run_concurrency(slots: Callable[..., Any]) -> None:
    """Make `slots` what Prefect's task engine enters for a task run's tag slots
    (`task_run_concurrency` puts Prefect's own back)."""
    if not hasattr(prefect.task_engine, TASK_ENGINE_CONCURRENCY):
        raise _moved(f"prefect.task_engine.{TASK_ENGINE_CONCURRENCY}")
    setattr(prefect.task_engine, TASK_ENGINE_CONCURRENCY, slots)


def set_events_queue(event_queue: Any | None) -> None:
    """Send the events of this process's runs into `event_queue` (its `put((kind, event))`)
    instead of Prefect's events client; None puts Prefect's client back."""
    if event_queue is None:
        EventsWorker.set_client_override(None)
    else:
        EventsWorker.set_client_override(ProcessPoolForwardingEventsClient, event_queue=event_queue)


def wait_for_events_worker(timeout: float) -> None:
    """Wait up to `timeout` seconds for Prefect's events worker to hand over what it holds
    (in a thread: its wait has no timeout of its own)."""
    handed_over = threading.Thread(target=EventsWorker.instance().wait_until_empty, daemon=True)
    handed_over.start()
    handed_over.join(timeout)


def logs_to_api() -> bool:
    """Whether Prefect's settings send logs to the API (PREFECT_LOGGING_TO_API_ENABLED)."""
    return bool(get_settings_context().settings.logging.to_api.enabled)


def log_payload(handler: APILogHandler, record: logging.LogRecord) -> dict[str, Any]:
    """The log the API takes for `record`, as Prefect's API handler makes it."""
    payload = handler.prepare(record)
    payload.pop(PAYLOAD_SIZE, None)
    return payload


def is_service_failure(record: logging.LogRecord) -> bool:
    """A Prefect background service's error about an item it could not handle."""
    return isinstance(record.msg, str) and record.msg.startswith(SERVICE_FAILED)
