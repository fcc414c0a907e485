"""What a database holds of the outbox (outboxpg.catalog.snapshot: statements.CATALOG), to compare
two installs by: a fresh one, one installed with psql, one upgraded from a release, one rolled
back."""

from __future__ import annotations

import psycopg

from outboxpg.catalog import Snapshot, snapshot


def catalog(dsn: str) -> Snapshot:
    with psycopg.connect(dsn) as c:
        return snapshot(c)


def differences(a: Snapshot, b: Snapshot) -> list[str]:
    """The rows of each part of the catalog that only one side has (for an assertion's message)."""
    out = []
    for key in a:
        out += [f"{key}: only in the first: {row}" for row in a[key] if row not in b[key]]
        out += [f"{key}: only in the second: {row}" for row in b[key] if row not in a[key]]
    return out
