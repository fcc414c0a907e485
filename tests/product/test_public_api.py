"""What users and scripts import keeps working after the package was arranged by role
(outboxpg.relay, outboxpg.cli): the names README.md and docs/ show, and the old module paths."""

from __future__ import annotations

import subprocess
import sys

import outboxpg
import outboxpg.errors
import outboxpg.events
import outboxpg.relay.nats_publisher
import outboxpg.relay.publishers
import outboxpg.relay.worker


def test_the_producer_api_is_at_the_top() -> None:
    assert {"Event", "enqueue", "enqueue_many"} <= set(outboxpg.__all__)


def test_old_module_paths_are_the_new_objects() -> None:
    from outboxpg.nats_publisher import NatsPublisher, supports_atomic_batch
    from outboxpg.publishers import FunctionPublisher, print_event
    from outboxpg.worker import RawJsonLoader, Worker, WorkerConfig
    from outboxpg.worker_cli import main

    assert Worker is outboxpg.relay.worker.Worker and WorkerConfig is outboxpg.relay.worker.WorkerConfig
    assert RawJsonLoader is outboxpg.relay.worker.RawJsonLoader
    assert FunctionPublisher is outboxpg.relay.publishers.FunctionPublisher
    assert print_event is outboxpg.relay.publishers.print_event
    assert NatsPublisher is outboxpg.relay.nats_publisher.NatsPublisher
    assert supports_atomic_batch is outboxpg.relay.nats_publisher.supports_atomic_batch
    from outboxpg.cli.outboxpg_worker import main as worker_main
    assert main is worker_main


def test_error_classes_live_in_errors_and_stay_importable_from_events() -> None:
    assert outboxpg.events.PermanentError is outboxpg.errors.PermanentError
    assert outboxpg.events.NotSent is outboxpg.errors.NotSent


def test_python_m_entry_points() -> None:
    for module, prog in (("outboxpg.cli", "outboxpg"), ("outboxpg.worker_cli", "outboxpg-worker")):
        r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout.split()[0], r.stderr) == (0, prog, ""), (module, r)


def test_the_soak_is_not_in_the_package() -> None:
    import importlib.util

    assert importlib.util.find_spec("outboxpg.soak") is None
