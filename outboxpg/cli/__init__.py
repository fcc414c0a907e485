"""The command lines: ``outboxpg`` (outboxpg.cli.outboxpg: migrate, sql, status, dead, maintain,
demo) and ``outboxpg-worker`` (outboxpg.cli.outboxpg_worker: runs the relay), and what they
share (common: DSN, connecting, one-line errors; options: flags and environment variables from
one declaration; render: plain-text tables).

``outboxpg.cli.main`` is the ``outboxpg`` command, as it was before the package existed; it is
imported on first use, so that ``outboxpg-worker`` does not load the other command.
"""

from typing import Any

__all__ = ["CliError", "build_parser", "main"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from outboxpg.cli import outboxpg

        return getattr(outboxpg, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
