"""The distributed half of the soak (``bin/soak --distributed``): hosts, a replicated PostgreSQL
and a 3-node JetStream cluster, each started here and removed here, by name or PID.

``Hosts``           one network namespace per worker ("host"), a veth pair to the root namespace
                    on a private /30 each, and two service addresses on the root namespace's ``lo``
                    (one PostgreSQL listens on, one the NATS nodes listen on). A host's link to one
                    service is cut by a blackhole route for that address inside its namespace, and
                    restored by putting the route back (iptables/nft are not needed).
``ReplicatedPg``    a primary and a streaming standby with synchronous replication
                    (``synchronous_standby_names`` = the standby): a COMMIT is acknowledged only once
                    the standby has the WAL, so promoting the standby loses no acknowledged commit.
                    ``fail_over()`` stops the primary (immediate), promotes the standby and builds a
                    new standby on the old primary's port: the multi-host DSN stays valid.
``NatsCluster``     three nats-servers with JetStream, routes on loopback ports; a node is killed
                    (SIGKILL) and started again on its store.

Names carry the soak's PID (netns ``outboxpg-soak-<pid>-h<k>``, links ``osk<pid>h<k>``, ``lo``
address label ``lo:osk<pid>``); ``sweep_stale()`` removes those of soaks that are no longer running
(a soak killed with SIGKILL cannot clean up after itself).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg

from outboxpg.embedded import EmbeddedPostgres, EmbeddedStandby, find_nats_server, free_port


class Unavailable(RuntimeError):
    """The machine cannot run the distributed soak (not root, no ``ip netns``): the reason, one line."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_available() -> None:
    """Raise Unavailable, saying why, unless we are root and ``ip netns`` works here."""
    if os.geteuid() != 0:
        raise Unavailable("--distributed needs root (it makes network namespaces and veth pairs)")
    if shutil.which("ip") is None:
        raise Unavailable("--distributed needs the `ip` command (iproute2)")
    probe = f"outboxpg-soak-{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        raise Unavailable(f"`ip netns add` does not work here: {made.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


def sweep_stale() -> list[str]:
    """Remove the namespaces, links and lo addresses of soaks whose PID is gone; what was removed."""
    removed: list[str] = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(r"outboxpg-soak-(\d+)-(h\d+|probe)", name)
        if m and not _alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            removed.append(f"netns {name}")
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        m = re.match(r"\d+: (osk(\d+)h\d+)[@:]", line)
        if m and not _alive(int(m.group(2))):
            _ip("link", "del", m.group(1), check=False)
            removed.append(f"link {m.group(1)}")
    for line in _ip("-o", "-4", "addr", "show", "dev", "lo", check=False).stdout.splitlines():
        m = re.search(r"inet (\S+) .*lo:osk(\d+)", line)
        if m and not _alive(int(m.group(2))):
            _ip("addr", "del", m.group(1), "dev", "lo", check=False)
            removed.append(f"lo address {m.group(1)}")
    return removed


class Hosts:
    """``count`` network namespaces, each joined to the root namespace by a veth pair on a /30."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.pid = os.getpid()
        self.net = self._free_net()
        self.pg_addr = f"10.{self.net}.255.1"       # PostgreSQL listens here (and on 127.0.0.1)
        self.nats_addr = f"10.{self.net}.255.2"     # the NATS nodes listen here
        self.label = f"lo:osk{self.pid}"
        self.made_netns: list[str] = []
        self.made_links: list[str] = []
        self.made_addrs: list[str] = []

    @staticmethod
    def _free_net() -> int:
        """A second octet N such that no address of the machine is in 10.N.0.0/16."""
        taken = _ip("-o", "-4", "addr", "show", check=False).stdout
        for n in range(200, 250):
            if f"inet 10.{n}." not in taken:
                return n
        raise RuntimeError("no free 10.N.0.0/16 (N in 200..249) for the soak's hosts")

    def netns(self, k: int) -> str:
        return f"outboxpg-soak-{self.pid}-h{k + 1}"

    def gateway(self, k: int) -> str:
        return f"10.{self.net}.0.{4 * k + 1}"

    def address(self, k: int) -> str:
        return f"10.{self.net}.0.{4 * k + 2}"

    def start(self) -> Hosts:
        try:
            for addr in (self.pg_addr, self.nats_addr):
                _ip("addr", "add", f"{addr}/32", "dev", "lo", "label", self.label)
                self.made_addrs.append(addr)
            for k in range(self.count):
                ns, outer, inner = self.netns(k), f"osk{self.pid}h{k + 1}", f"osk{self.pid}n{k + 1}"
                _ip("netns", "add", ns)
                self.made_netns.append(ns)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                self.made_links.append(outer)
                _ip("link", "set", inner, "netns", ns)
                _ip("addr", "add", f"{self.gateway(k)}/30", "dev", outer)
                _ip("link", "set", outer, "up")
                _ip("-n", ns, "addr", "add", f"{self.address(k)}/30", "dev", inner)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", inner, "up")
                for service in (self.pg_addr, self.nats_addr):
                    self.restore(k, service)
        except BaseException:
            self.stop()
            raise
        return self

    def cut(self, k: int, service_addr: str) -> None:
        """Host k loses its route to ``service_addr``: its packets there are dropped (a blackhole
        route); established connections hang rather than reset, as in a partition."""
        _ip("-n", self.netns(k), "route", "replace", "blackhole", f"{service_addr}/32")

    def restore(self, k: int, service_addr: str) -> None:
        _ip("-n", self.netns(k), "route", "replace", f"{service_addr}/32", "via", self.gateway(k))

    def exec_prefix(self, k: int) -> list[str]:
        return ["ip", "netns", "exec", self.netns(k)]

    def stop(self) -> None:
        for ns in reversed(self.made_netns):
            _ip("netns", "del", ns, check=False)          # takes the veth inside, and so its peer
        for link in self.made_links:
            _ip("link", "del", link, check=False)         # in case the peer was not moved yet
        for addr in self.made_addrs:
            _ip("addr", "del", f"{addr}/32", "dev", "lo", check=False)
        self.made_netns, self.made_links, self.made_addrs = [], [], []

    def __enter__(self) -> Hosts:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class ReplicatedPg:
    """A primary and a synchronous streaming standby, both on ``listen`` and 127.0.0.1."""

    def __init__(self, listen: str, hba_net: str) -> None:
        self.listen, self.hba_net = listen, hba_net
        self.generation = 1
        self.primary = EmbeddedPostgres(settings=self._settings())
        self.standby: EmbeddedStandby | None = None
        self.ports = (self.primary.port, 0)

    def _settings(self) -> dict[str, str]:
        return {"listen_addresses": f"127.0.0.1,{self.listen}"}

    def start(self) -> ReplicatedPg:
        self.primary.start()
        try:
            # The workers come from the hosts' addresses; initdb -A trust only trusts 127.0.0.1.
            hba = self.primary.datadir / "pg_hba.conf"
            with hba.open("a") as f:
                f.write(f"host all all {self.hba_net} trust\n")
            with psycopg.connect(self.primary.dsn, autocommit=True) as c:
                c.execute("SELECT pg_reload_conf()")
            self._new_standby(port=None)
            self.ports = (self.primary.port, self.standby.port if self.standby else 0)
        except BaseException:
            self.stop()
            raise
        return self

    def _new_standby(self, port: int | None) -> None:
        name = f"standby{self.generation}"
        self.standby = EmbeddedStandby(self.primary, name=name, port=port, settings=self._settings())
        self.standby.start()
        self._synchronous(name)

    def _synchronous(self, name: str) -> None:
        """Commits on the primary wait for standby ``name`` ('' = for none)."""
        with psycopg.connect(self.primary.dsn, autocommit=True) as c:
            c.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{name}'")
            c.execute("SELECT pg_reload_conf()")

    def dsn(self, host: str) -> str:
        """Both servers, the one accepting writes wins (libpq's failover)."""
        return (f"host={host},{host} port={self.ports[0]},{self.ports[1]} user=postgres dbname=postgres "
                "target_session_attrs=read-write connect_timeout=3")

    def fail_over(self, outage: float) -> str:
        """Stop the primary (immediate), wait ``outage`` s, promote the standby, build a new
        standby on the old primary's port. Returns what took how long."""
        assert self.standby is not None
        old, new = self.primary, self.standby
        t0 = time.monotonic()
        old.halt("immediate")
        time.sleep(outage)
        t1 = time.monotonic()
        new.promote()
        self.primary, self.standby = new, None
        # Its postgresql.auto.conf may name a standby (copied by pg_basebackup): alone, it must
        # not wait for one.
        self._synchronous("")
        promoted = time.monotonic() - t1
        old.stop()                      # removes its directory; its port is free again
        self.generation += 1
        t2 = time.monotonic()
        self._new_standby(port=old.port)
        return (f"primary :{old.port} stopped (immediate), down {outage:.1f}s, :{new.port} promoted in "
                f"{promoted:.2f}s, new standby :{old.port} in {time.monotonic() - t2:.1f}s "
                f"(total {time.monotonic() - t0:.1f}s)")

    def stop(self) -> None:
        for server in (self.standby, self.primary):
            if server is not None:
                try:
                    server.stop()
                except Exception as e:  # noqa: BLE001 - stop the other one all the same
                    print(f"[soak] stopping PostgreSQL :{server.port}: {e}", flush=True)

    def __enter__(self) -> ReplicatedPg:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class NatsCluster:
    """Three nats-servers with JetStream in one cluster; clients on ``host``, routes on 127.0.0.1."""

    def __init__(self, host: str, size: int = 3) -> None:
        self.host = host
        self.binary = find_nats_server()
        self.base = Path(tempfile.mkdtemp(prefix="outboxpg-soak-nats-"))
        self.name = f"soak-{os.getpid()}"
        self.client_ports = [free_port() for _ in range(size)]
        self.route_ports = [free_port() for _ in range(size)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size

    @property
    def url(self) -> str:
        return ",".join(f"nats://{self.host}:{p}" for p in self.client_ports)

    def server_name(self, i: int) -> str:
        return f"n{i + 1}"

    def start_node(self, i: int) -> None:
        routes = ",".join(f"nats://127.0.0.1:{p}" for j, p in enumerate(self.route_ports) if j != i)
        node_dir = self.base / self.server_name(i)
        node_dir.mkdir(exist_ok=True)
        self.procs[i] = subprocess.Popen(
            [self.binary, "-a", self.host, "-p", str(self.client_ports[i]), "-n", self.server_name(i),
             "-js", "-sd", str(node_dir / "store"), "--cluster_name", self.name,
             "--cluster", f"nats://127.0.0.1:{self.route_ports[i]}", "--routes", routes,
             "-l", str(node_dir / "nats-server.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            proc = self.procs[i]
            if proc is None or proc.poll() is not None:
                raise RuntimeError(f"nats-server {self.server_name(i)} exited; see {node_dir}/nats-server.log")
            try:
                with socket.create_connection((self.host, self.client_ports[i]), timeout=0.5) as s:
                    if s.recv(4096).startswith(b"INFO"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nats-server {self.server_name(i)} did not start within 20 s")

    def kill_node(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        self.procs[i] = None

    def index_of(self, server_name: str) -> int:
        return [self.server_name(i) for i in range(len(self.procs))].index(server_name)

    def start(self) -> NatsCluster:
        try:
            for i in range(len(self.procs)):
                self.start_node(i)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for i, proc in enumerate(self.procs):
            if proc is None:
                continue
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self.procs[i] = None
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


async def stream_leader(nats_url: str, stream: str) -> str | None:
    """The server name of ``stream``'s current leader (None if it has none right now)."""
    import nats

    nc = await nats.connect(servers=nats_url.split(","), connect_timeout=2, max_reconnect_attempts=1)
    try:
        info: Any = await nc.jetstream().stream_info(stream)
        cluster = info.cluster
        return str(cluster.leader) if cluster is not None and cluster.leader else None
    finally:
        await nc.close()
