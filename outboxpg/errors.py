"""The error that the schema side raises and the ``outboxpg`` command catches. The other errors
live with who raises and catches them: the publisher protocol's (PermanentError, NotSent,
PublisherNotFound) in outboxpg.relay.publishers, the command lines' (CliError, exit codes) in
outboxpg.cli.errors; how any exception becomes text is outboxpg.text."""

from __future__ import annotations

__all__ = ["HandInstalled"]


class HandInstalled(Exception):
    """The outbox schema is there, but yoyo has no record of it (installed with psql)."""
