"""What users and scripts import: the names README.md and docs/ show, each at one path
(outboxpg.relay, outboxpg.cli)."""

from __future__ import annotations

import subprocess
import sys

import outboxpg
import outboxpg.errors
import outboxpg.events
import outboxpg.relay.publishers
import outboxpg.relay.worker


def test_the_producer_api_is_at_the_top() -> None:
    assert {"Event", "enqueue", "enqueue_many"} <= set(outboxpg.__all__)


def test_each_thing_has_one_import_path() -> None:
    """The compatibility modules of the package's first layout are gone (nothing was released
    with them), and so are the modules that were split or moved: one path each."""
    import importlib.util

    for gone in ("outboxpg.worker", "outboxpg.worker_cli", "outboxpg.publishers", "outboxpg.nats_publisher",
                 "outboxpg.relay.nats_publisher", "outboxpg.relay.streams", "outboxpg.locks"):
        assert importlib.util.find_spec(gone) is None, gone


PUBLIC = {
    "outboxpg.relay.worker": ["Worker"],
    "outboxpg.relay.publishers": ["FunctionPublisher", "NotSent", "PermanentError", "Publisher", "print_event"],
    "outboxpg.relay.nats.publisher": ["NatsPublisher"],
    "outboxpg.relay.nats.connection": ["parse_servers", "supports_atomic_batch"],
    "outboxpg.relay.nats.streams": ["check_stream", "ensure_stream"],
    "outboxpg.events": ["OutboxEvent", "runs_of"],
}


def test_the_documented_modules_define_their_names() -> None:
    """Each public name of the relay is defined in the module the docs import it from, not
    re-exported from another; WorkerConfig is the one exception (declared in relay/config.py,
    imported from outboxpg.relay.worker)."""
    import importlib

    for module, names in PUBLIC.items():
        loaded = importlib.import_module(module)
        for name in names:
            assert name in loaded.__all__ and getattr(loaded, name).__module__ == module, (module, name)
    assert "WorkerConfig" in outboxpg.relay.worker.__all__


def test_errors_live_with_who_raises_and_catches_them() -> None:
    """The publisher protocol's errors are the relay's; the command lines' are the CLI's; the
    schema's HandInstalled stays in outboxpg.errors, where outboxpg.schema imports it from."""
    import outboxpg.cli.errors

    assert {"PermanentError", "NotSent", "PublisherNotFound"} <= set(outboxpg.relay.publishers.__all__)
    assert {"CliError", "EXIT_USAGE"} <= set(outboxpg.cli.errors.__all__)
    assert outboxpg.errors.__all__ == ["HandInstalled"]
    for module in (outboxpg.events, outboxpg.errors):
        assert not hasattr(module, "PermanentError") and not hasattr(module, "NotSent"), module


def test_python_m_entry_points() -> None:
    for module, prog in (("outboxpg.cli", "outboxpg"), ("outboxpg.cli.outboxpg_worker", "outboxpg-worker")):
        r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout.split()[0], r.stderr) == (0, prog, ""), (module, r)


def test_the_soak_is_not_in_the_package() -> None:
    import importlib.util

    assert importlib.util.find_spec("outboxpg.soak") is None
