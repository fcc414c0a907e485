"""The Patroni half of the soak (``bin/soak --patroni``): PostgreSQL run by a real Patroni
cluster (Debian's ``patroni`` and ``etcd-server``: tests/patroni.py starts etcd and two nodes,
and installs the packages when missing and root), with ``synchronous_mode`` on, so that no
acknowledged commit is lost in a failover and the ledger needs no allowance for lost ones. The
workers, the producers and the checker connect with the multi-host DSN Patroni users give
(``target_session_attrs=read-write``).

Two fault kinds:

``patroni_switchover``  ``patronictl switchover --force`` to the replica; then wait until the old
                        leader streams again as the synchronous standby.
``patroni_failover``    the leader's node crashes (its Patroni, its postmaster and every backend
                        SIGKILLed at once); the replica promotes once the leader key's TTL ran
                        out; the crashed node's Patroni is started again, rewinds and streams.

Each also commits a marker event on the new leader the moment it accepts writes and notes how
long until the marker is published (the worker's delay after the new leader, not the TTL).
"""

from __future__ import annotations

import importlib
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

TESTS = Path(__file__).resolve().parent.parent / "tests"
PATRONI_KINDS = ("patroni_switchover", "patroni_failover")


class Unavailable(RuntimeError):
    """Patroni or etcd cannot be found or installed here: why, one line."""


def helpers() -> Any:
    """tests/patroni.py (the one Patroni cluster helper, shared with the test suite)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    return importlib.import_module("patroni")


def start_cluster() -> Any:
    """A started PatroniCluster (synchronous_mode on, node2 its synchronous standby); a context manager."""
    mod = helpers()
    bins, why = mod.find_patroni()
    if not bins:
        raise Unavailable(why)
    cluster = mod.PatroniCluster(synchronous_mode=True, bins=bins)
    cluster.start()
    try:
        cluster.wait_streaming("node2", 60, True)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def dsn(cluster: Any, dbname: str = "postgres") -> str:
    ports = ",".join(str(n.port) for n in cluster.nodes.values())
    return (f"host=127.0.0.1,127.0.0.1 port={ports} user=postgres dbname={dbname} "
            "target_session_attrs=read-write connect_timeout=3")


def _writable(node_dsn: str, timeout: float = 90) -> float:
    """Wait until the server accepts writes; time.monotonic() of that moment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with psycopg.connect(node_dsn, autocommit=True, connect_timeout=1) as c:
                while time.monotonic() < deadline:
                    row = c.execute("SELECT pg_is_in_recovery()").fetchone()
                    if row is not None and not row[0]:
                        return time.monotonic()
                    time.sleep(0.01)
        except psycopg.Error:
            time.sleep(0.01)
    raise RuntimeError(f"{node_dsn}: not writable within {timeout:g} s")


def _marker(node_dsn: str, since: float, commit: Any) -> str:
    """Commit a marker event on the new leader, wait until it is published; how long after ``since``."""
    from outboxpg import enqueue

    msg_id = str(uuid.uuid4())
    with psycopg.connect(node_dsn) as c:
        enqueue(c, "marker", "patroni", "leader", {"at": time.time()}, msg_id=msg_id)
        c.commit()
    commit([(msg_id, "marker/patroni")], time.time(), "marker_committed")
    deadline = time.monotonic() + 60
    with psycopg.connect(node_dsn, autocommit=True) as c:
        while time.monotonic() < deadline:
            row = c.execute("SELECT state::text FROM outbox WHERE msg_id = %s", (msg_id,)).fetchone()
            if row is not None and row[0] == "published":
                return f"marker published {time.monotonic() - since:.2f}s after the new leader accepted writes"
            time.sleep(0.02)
    return "marker NOT published within 60 s of the new leader accepting writes"


def inject(kind: str, cluster: Any, commit: Any) -> str:
    """Inject ``kind``; ``commit(events, at, how)`` is the ledger's. Returns what happened."""
    t0 = time.monotonic()
    leader = cluster.wait_leader(None, 60)
    other = next(n for n in cluster.nodes if n != leader)
    new_dsn = cluster.nodes[other].dsn_for("postgres")
    if kind == "patroni_switchover":
        cluster.switchover(other)
        since = _writable(new_dsn)
        what = f"{leader} -> {other} (patronictl switchover), writable after {since - t0:.2f}s"
    elif kind == "patroni_failover":
        cluster.crash(leader)
        since = _writable(new_dsn)
        what = f"{leader} crashed, {other} writable after {since - t0:.2f}s"
    else:
        raise ValueError(kind)
    what += "; " + _marker(new_dsn, since, commit)
    if kind == "patroni_failover":
        cluster.start_node(leader)
    cluster.wait_streaming(leader, 90, True)
    return what + f"; {leader} sync standby again after {time.monotonic() - t0:.1f}s"
