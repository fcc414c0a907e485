"""Failover under a real orchestrator: Patroni (Debian's ``patroni``, etcd from ``etcd-server``)
runs a primary and a standby on this machine, and switches over and fails over while producers
commit and a real ``outboxpg-worker`` delivers to nats-server (tests/patroni.py starts it all).

- synchronous_mode on, the worker on a multi-host DSN with target_session_attrs=read-write: a
  ``patronictl switchover`` and then a failover (the leader node crashed: its Patroni and every
  PostgreSQL process SIGKILLed): every acknowledged event is in the stream exactly once, in order
  per aggregate; an event committed on the new leader is delivered within 2 s of it accepting
  writes, each time;
- asynchronous replication, the worker behind HAProxy (Patroni's REST check) with
  ``--standby-flushed any``: the leader crashed, the old node rejoins (pg_rewind): every event in
  the stream is on the new leader (no published event lost), every acknowledged event that
  survived is in the stream exactly once, in order; nothing is published while the new leader
  has no standby, and an event is delivered within 2 s of the old leader streaming again.

Marked slow and in the soak group: each case starts etcd, two Patroni nodes and their
PostgreSQL, and waits out the leader key's TTL (8 s) once.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import insert
from jetstream import StreamHandle, make_stream, read_stream

from outboxpg.cli.errors import EXIT_CONNECT

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("soak")]

WORKER = str(Path(sys.executable).parent / "outboxpg-worker")


@pytest.fixture
def patroni_bins() -> dict[str, str]:
    from patroni import find_patroni

    bins, why = find_patroni()
    if not bins:
        pytest.skip(why)
    return bins


@pytest.fixture
def haproxy_bin() -> str:
    from patroni import find_haproxy

    binary, why = find_haproxy()
    if binary is None:
        pytest.skip(why)
    return binary


def multi_host(cluster: Any) -> str:
    ports = ",".join(str(n.port) for n in cluster.nodes.values())
    return (f"host=127.0.0.1,127.0.0.1 port={ports} user=postgres dbname=app "
            "target_session_attrs=read-write connect_timeout=2")


def install(cluster: Any, prefix: str) -> None:
    """The app database on the leader, the outbox schema in it (outboxpg migrate), fast retries."""
    leader = cluster.nodes[cluster.wait_leader()]
    with psycopg.connect(leader.dsn_for("postgres"), autocommit=True) as c:
        c.execute("CREATE DATABASE app")
    out = subprocess.run([str(Path(sys.executable).parent / "outboxpg"), "migrate", "--dsn", leader.dsn_for("app")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    with psycopg.connect(leader.dsn_for("app"), autocommit=True) as c:
        c.execute("UPDATE outbox_settings SET subject_prefix = %s, backoff_base = '50 milliseconds', "
                  "backoff_cap = '200 milliseconds'", (prefix,))


@dataclass
class Producers:
    """Threads committing one event per transaction over the multi-host DSN; each writes its own
    aggregates in turn. ``acked``: (msg_id, aggregate) of every COMMIT that returned, in order;
    ``unknown``: events whose COMMIT broke (they may or may not have committed)."""
    dsn: str
    count: int = 2
    acked: list[tuple[str, str]] = field(default_factory=list)
    unknown: set[str] = field(default_factory=set)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Producers:
        for i in range(self.count):
            t = threading.Thread(target=self._run, args=(i,), daemon=True)
            t.start()
            self.threads.append(t)
        return self

    def _run(self, i: int) -> None:
        conn: psycopg.Connection[Any] | None = None
        n = 0
        while not self.stop.is_set():
            aggregate, msg_id = f"p{i}-{n % 4}", str(uuid.uuid4())
            try:
                if conn is None:
                    conn = psycopg.connect(self.dsn, autocommit=True)
            except psycopg.Error:
                time.sleep(0.05)   # no server accepts writes yet: nothing was sent
                continue
            try:
                insert(conn, "acct", aggregate, msg_id=msg_id)   # autocommit: the INSERT is the transaction
            except psycopg.Error:
                with self.lock:
                    self.unknown.add(msg_id)
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.05)
                continue
            with self.lock:
                self.acked.append((msg_id, f"acct/{aggregate}"))
            n += 1
            time.sleep(0.01)
        if conn is not None:
            conn.close()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def writable(dsn: str, timeout: float) -> float:
    """Wait until the server at ``dsn`` accepts writes (promoted); time.time() of that moment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with psycopg.connect(dsn, autocommit=True, connect_timeout=1) as c:
                while time.monotonic() < deadline:
                    if not c.execute("SELECT pg_is_in_recovery()").fetchone()[0]:   # type: ignore[index]
                        return time.time()
                    time.sleep(0.01)
        except psycopg.Error:
            time.sleep(0.01)
    raise AssertionError(f"{dsn} did not accept writes within {timeout:g} s")


async def marker_delivered(stream: StreamHandle, dsn: str, since: float, log: Path | None = None) -> float:
    """Commit a marker event on the new leader (``dsn``) and wait for it in the stream: seconds
    from ``since`` (time.time() when the leader became writable) to JetStream storing it."""
    with psycopg.connect(dsn, autocommit=True) as c:
        msg_id = str(uuid.uuid4())
        insert(c, "marker", "m", msg_id=msg_id)
    subject = f"{stream.prefix}.marker.created"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            m = await stream.js.get_last_msg(stream.name, subject)
            if m.headers and m.headers.get("Nats-Msg-Id") == msg_id and m.time is not None:
                return m.time.timestamp() - since
        except Exception:  # noqa: BLE001 - not there yet
            pass
        await asyncio.sleep(0.02)
    raise AssertionError("the marker committed on the new leader was not delivered within 20 s"
                         + (f"; the worker's log:\n{log.read_text(errors='replace')[-4000:]}" if log else ""))


async def all_in_stream(stream: StreamHandle, want: set[str], timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    while True:
        messages = await read_stream(stream)
        if want <= {m.msg_id for m in messages}:
            return messages
        if time.monotonic() > deadline:
            missing = want - {m.msg_id for m in messages}
            raise AssertionError(f"{len(missing)} acknowledged events not delivered within {timeout:g} s")
        await asyncio.sleep(0.5)


def check_exactly_once_in_order(messages: list[Any], acked: list[tuple[str, str]]) -> None:
    """Each msg_id once; per aggregate, the acknowledged events in the stream in the order their
    COMMITs returned, and Outbox-Id increasing."""
    ids = [m.msg_id for m in messages]
    assert len(set(ids)) == len(ids), "a msg_id stored twice"
    acked_set = {m for m, _ in acked}
    by_aggregate: dict[str, list[str]] = {}
    for msg_id, aggregate in acked:
        by_aggregate.setdefault(aggregate, []).append(msg_id)
    in_stream: dict[str, list[str]] = {}
    last: dict[str, int] = {}
    for m in messages:
        assert m.outbox_id > last.get(m.aggregate, 0), f"{m.aggregate}: Outbox-Id {m.outbox_id} out of order"
        last[m.aggregate] = m.outbox_id
        if m.msg_id in acked_set:
            in_stream.setdefault(m.aggregate, []).append(m.msg_id)
    assert in_stream == by_aggregate


@pytest.fixture
def worker_log(tmp_path: Path) -> Path:
    return tmp_path / "worker.log"


def start_worker(dsn: str, nats_url: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    """The worker, once it has started (its ``event=start``). A worker exits at start when it
    cannot connect (exit 3), and its supervisor starts it again: so does this, up to 3 times a
    second apart. On a loaded machine, Patroni's REST API can miss two of haproxy's checks in a
    row, and haproxy then closes new sessions until the leader is routed again."""
    for attempt in range(4):
        if attempt:
            time.sleep(1)
        worker = subprocess.Popen([WORKER, "--dsn", dsn, "--nats-url", nats_url, "--lease", "4",
                                   "--publish-timeout", "1", "--maintenance-interval", "0", "--name", "relay-1",
                                   *extra], stdout=subprocess.DEVNULL, stderr=log.open("ab"))
        deadline = time.monotonic() + 30
        while (worker.poll() is None and time.monotonic() < deadline
               and "event=start " not in log.read_text(errors="replace")):
            time.sleep(0.05)
        if worker.returncode != EXIT_CONNECT:
            break
    return worker


def stop_worker(worker: subprocess.Popen[bytes]) -> None:
    worker.terminate()
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


@pytest.fixture
def sync_cluster(patroni_bins: dict[str, str]) -> Iterator[Any]:
    from patroni import PatroniCluster

    with PatroniCluster(synchronous_mode=True, bins=patroni_bins) as cluster:
        cluster.wait_streaming("node2", sync=True)
        yield cluster


async def test_switchover_and_failover_deliver_every_acknowledged_event_once_in_order(
        sync_cluster: Any, nats_server: Any, worker_log: Path) -> None:
    cluster = sync_cluster
    stream = await make_stream(nats_server.url)
    install(cluster, stream.prefix)
    dsn = multi_host(cluster)
    worker = await asyncio.to_thread(start_worker, dsn, nats_server.url, worker_log)
    producers = Producers(dsn).start()
    took: dict[str, float] = {}
    try:
        await asyncio.sleep(1)
        # Switchover: node1 hands over to node2 (it stops, node2 promotes, node1 follows node2).
        await asyncio.to_thread(cluster.switchover, "node2")
        since = await asyncio.to_thread(writable, cluster.nodes["node2"].dsn_for("app"), 30)
        took["switchover"] = await marker_delivered(stream, cluster.nodes["node2"].dsn_for("app"), since, worker_log)
        await asyncio.to_thread(cluster.wait_streaming, "node1", 60, True)
        await asyncio.sleep(1)
        # Failover: node2 crashes; its leader key expires (ttl), node1 (its synchronous
        # standby: it has every acknowledged commit) promotes.
        await asyncio.to_thread(cluster.crash, "node2")
        since = await asyncio.to_thread(writable, cluster.nodes["node1"].dsn_for("app"), 60)
        took["failover"] = await marker_delivered(stream, cluster.nodes["node1"].dsn_for("app"), since, worker_log)
        await asyncio.sleep(1)
        producers.finish()
        acked = list(producers.acked)
        messages = await all_in_stream(stream, {m for m, _ in acked}, 30)
        assert worker.poll() is None, worker_log.read_text()[-3000:]
    finally:
        producers.finish()
        stop_worker(worker)
        await stream.nc.close()
    log = worker_log.read_text()
    print(f"acked {len(acked)}, unknown outcome {len(producers.unknown)}, stream {len(messages)}; "
          f"delivery after the new leader was writable: {took}")
    assert worker.returncode == 0, log[-3000:]
    check_exactly_once_in_order([m for m in messages if not m.aggregate.startswith("marker/")], acked)
    assert set(took) == {"switchover", "failover"}
    assert all(t <= 2.0 for t in took.values()), f"{took}\n{log[-3000:]}"
    assert all(line.startswith("20") for line in log.splitlines()), log[-3000:]


@pytest.fixture
def async_cluster(patroni_bins: dict[str, str]) -> Iterator[Any]:
    from patroni import PatroniCluster

    with PatroniCluster(synchronous_mode=False, bins=patroni_bins) as cluster:
        yield cluster


async def test_standby_flushed_behind_haproxy_loses_no_published_event_when_the_leader_crashes(
        async_cluster: Any, haproxy_bin: str, nats_server: Any, worker_log: Path) -> None:
    from patroni import HAProxy

    cluster = async_cluster
    stream = await make_stream(nats_server.url)
    install(cluster, stream.prefix)
    with HAProxy(haproxy_bin, cluster) as haproxy:
        worker = await asyncio.to_thread(start_worker, haproxy.dsn_for("app"), nats_server.url, worker_log,
                                         "--standby-flushed", "any")
        producers = Producers(multi_host(cluster)).start()
        try:
            await asyncio.sleep(3)
            await asyncio.to_thread(cluster.crash, "node1")
            since = await asyncio.to_thread(writable, cluster.nodes["node2"].dsn_for("app"), 60)
            await asyncio.sleep(1)
            # No standby: nothing is published. node1 comes back, is rewound, streams: delivery resumes.
            await asyncio.to_thread(cluster.start_node, "node1")
            await asyncio.to_thread(cluster.wait_streaming, "node1", 60)
            rejoined = time.time()
            try:
                resumed = await marker_delivered(stream, cluster.nodes["node2"].dsn_for("app"), rejoined)
            except AssertionError as exc:   # what the worker was doing meanwhile, for the next reader
                raise AssertionError(f"{exc}\n{worker_log.read_text()[-4000:]}") from None
            await asyncio.sleep(1)
            producers.finish()
            with psycopg.connect(cluster.nodes["node2"].dsn_for("app"), autocommit=True) as c:
                survived = {r[0] for r in c.execute("SELECT msg_id FROM outbox")}
            acked = [(m, a) for m, a in producers.acked if m in survived]
            messages = await all_in_stream(stream, {m for m, _ in acked}, 30)
            assert worker.poll() is None, worker_log.read_text()[-3000:]
        finally:
            producers.finish()
            stop_worker(worker)
            await stream.nc.close()
    log = worker_log.read_text()
    lost = len(producers.acked) - len(acked)
    print(f"acked {len(producers.acked)} (lost with the old leader: {lost}), unknown {len(producers.unknown)}, "
          f"stream {len(messages)}, new leader writable {rejoined - since:.1f}s before node1 streamed again, "
          f"delivery {resumed:.2f}s after that")
    assert worker.returncode == 0, log[-3000:]
    published = {m.msg_id for m in messages}
    assert published <= survived, f"{len(published - survived)} published events lost in the failover"
    check_exactly_once_in_order([m for m in messages if not m.aggregate.startswith("marker/")], acked)
    assert "event=standby_flush_waiting standby=any connected=0" in log, log[-3000:]
    assert resumed <= 2.0, f"delivered {resumed:.2f}s after a standby streamed again\n{log[-3000:]}"
