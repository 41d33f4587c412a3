"""Each Prefect internal flows/prefect_compat.py relies on is still where it was, does what it
did, and is used nowhere else: a Prefect release that moves one fails here, by name, instead
of leaving the reporter's patch silently doing nothing. No server is started; seconds."""

from __future__ import annotations

import ast
import inspect
import logging
from pathlib import Path

import prefect
import prefect._internal.concurrency
import prefect._internal.concurrency.services
import prefect.concurrency._sync
import prefect.task_engine
import pytest
import yaml
from prefect.events.worker import EventsWorker

from flows import prefect_compat
from flows.prefect_compat import (
    PAYLOAD_SIZE,
    PRIVATE,
    RUN_LOGGERS,
    SERVICE_FAILED,
    SERVICES_LOGGER,
    TASK_ENGINE_CONCURRENCY,
    APILogHandler,
    ProcessPoolForwardingEventsClient,
    is_service_failure,
    log_payload,
    set_events_queue,
    set_task_run_concurrency,
    task_run_concurrency,
)
from flows.reporter import observing

ROOT = Path(__file__).resolve().parents[1]
VERSION = f"Prefect {prefect.__version__}"


def test_the_task_engine_enters_the_concurrency_the_adapter_swaps():
    assert getattr(prefect.task_engine, TASK_ENGINE_CONCURRENCY, None) is task_run_concurrency, (
        f"{VERSION}: prefect.task_engine.{TASK_ENGINE_CONCURRENCY} is no longer prefect.concurrency._sync.concurrency"
    )
    assert task_run_concurrency is prefect.concurrency._sync.concurrency
    # The engine looks the name up when a task run starts (a module global), so a swap reaches it.
    source = inspect.getsource(prefect.task_engine)
    assert f"with {TASK_ENGINE_CONCURRENCY}(" in source, f"{VERSION}: the task engine no longer calls it"
    assert 'names=[f"tag:{tag}" for tag in self.task_run.tags]' in source, f"{VERSION}: its slots are not the tags'"


def test_setting_the_concurrency_swaps_it_and_refuses_a_moved_name(monkeypatch):
    def slots(*args, **kwargs):
        raise AssertionError("not entered here")

    monkeypatch.setattr(prefect.task_engine, TASK_ENGINE_CONCURRENCY, task_run_concurrency)
    set_task_run_concurrency(slots)
    assert prefect.task_engine._concurrency is slots
    set_task_run_concurrency(task_run_concurrency)
    assert prefect.task_engine._concurrency is task_run_concurrency

    monkeypatch.delattr(prefect.task_engine, TASK_ENGINE_CONCURRENCY)
    with pytest.raises(RuntimeError, match=r"Prefect .* has no prefect\.task_engine\._concurrency"):
        set_task_run_concurrency(slots)


def test_the_events_worker_takes_the_forwarding_client():
    assert EventsWorker._client_override is None
    queue = []

    class Queue:
        put = queue.append

    set_events_queue(Queue())
    try:
        client_type, kwargs = EventsWorker._client_override
        assert client_type is ProcessPoolForwardingEventsClient and dict(kwargs)["event_queue"].put == queue.append
        # instance() builds the override: the worker's client is the forwarding one.
        assert "_client_override" in inspect.getsource(EventsWorker.instance), f"{VERSION}: instance() ignores it"
        client = ProcessPoolForwardingEventsClient(**dict(kwargs))
        assert inspect.iscoroutinefunction(client._emit)
    finally:
        set_events_queue(None)
    assert EventsWorker._client_override is None


def test_the_services_logger_and_their_failure_message():
    assert prefect._internal.concurrency.logger.name == SERVICES_LOGGER, f"{VERSION}: the services log elsewhere"
    source = inspect.getsource(prefect._internal.concurrency.services)
    assert f'"{SERVICE_FAILED} ' in source, f"{VERSION}: the services' failure lines read differently"
    failed = logging.LogRecord(
        SERVICES_LOGGER, logging.ERROR, __file__, 1, SERVICE_FAILED + " to process item %r", (), None
    )
    assert is_service_failure(failed)
    assert not is_service_failure(logging.LogRecord(SERVICES_LOGGER, logging.ERROR, __file__, 1, "other", (), None))


def test_the_run_loggers_send_to_the_api_through_the_handler_the_reporter_replaces():
    config = yaml.safe_load((Path(prefect.__file__).parent / "logging/logging.yml").read_text())
    api_handlers = {
        name for name, spec in config["handlers"].items() if spec.get("class", "").endswith("APILogHandler")
    }
    for name in RUN_LOGGERS:
        assert set(config["loggers"][name].get("handlers", [])) & api_handlers, f"{VERSION}: {name} has no API handler"
    record = logging.LogRecord("prefect.task_runs", logging.INFO, __file__, 1, "hello", (), None)
    record.flow_run_id = "00000000-0000-0000-0000-000000000000"
    assert PAYLOAD_SIZE in APILogHandler().prepare(record), f"{VERSION}: prepare() no longer adds {PAYLOAD_SIZE}"
    payload = log_payload(APILogHandler(), record)
    assert payload["message"] == "hello" and PAYLOAD_SIZE not in payload


def test_observing_swaps_every_sender_and_puts_them_back():
    original = prefect.task_engine._concurrency
    with observing("http://127.0.0.1:9/api") as reporter:
        assert prefect.task_engine._concurrency is not original
        assert EventsWorker._client_override[0] is ProcessPoolForwardingEventsClient
        assert logging.getLogger(SERVICES_LOGGER).filters
    reporter.close(timeout=0)
    assert prefect.task_engine._concurrency is original and EventsWorker._client_override is None


def private_prefect_names(source: str, filename: str) -> list[str]:
    """`file:line: name` for each private Prefect module or attribute the source names."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.startswith("prefect.")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prefect"):
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and "prefect" in ast.unparse(node.value):
            names = [ast.unparse(node)]
        found += [
            f"{filename}:{node.lineno}: {name}" for name in names if any(p.startswith("_") for p in name.split("."))
        ]
    return found


def test_no_other_module_names_a_private_prefect_name():
    found = []
    for package in ("engine", "tasks", "flows"):
        for path in sorted((ROOT / package).rglob("*.py")):
            filename = path.relative_to(ROOT).as_posix()
            if filename != "flows/prefect_compat.py":
                found += private_prefect_names(path.read_text(), filename)
    assert not found, "private Prefect names outside flows/prefect_compat.py:\n" + "\n".join(found)
    assert private_prefect_names("import prefect.task_engine\nprefect.task_engine._concurrency = f\n", "x.py")
    assert private_prefect_names("from prefect.concurrency._sync import concurrency\n", "x.py")


def test_every_private_name_is_listed():
    # The table the module docstring promises: each internal name above, with what it is for.
    assert len(PRIVATE) >= 6 and all(PRIVATE.values())
    assert set(prefect_compat.__all__) <= set(dir(prefect_compat))
