"""A private Patroni cluster for the tests and the soak: Debian's ``patroni`` and ``etcd``
(etcd-server), found or installed, a single-node etcd (v3 API) and two Patroni nodes on free
loopback ports, with their configs, data and logs in one temp dir. Optionally Debian's
``haproxy`` in front, routing to whichever node Patroni's REST API calls primary.

    with PatroniCluster() as cluster:
        cluster.leader()              # "node1"
        cluster.switchover()          # patronictl switchover --force: node2 leads
        cluster.crash("node2")        # SIGKILL its Patroni and its PostgreSQL: the node is gone
        cluster.wait_leader("node1")  # once the leader key expired (ttl) and node1 promoted
        cluster.start_node("node2")   # back, rewound (pg_rewind) and streaming from node1

Every process is started here, as the ``postgres`` OS user when we are root (PostgreSQL refuses
root; Patroni runs PostgreSQL), and stopped here by its PID; nothing else is touched.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
from debian_packages import apt_install
from processes import children_of

from outboxpg.embedded import find_pg_bindir, free_port

__all__ = ["HAProxy", "PatroniCluster", "find_patroni", "find_haproxy"]

PACKAGES = {"patroni": "patroni", "patronictl": "patroni", "etcd": "etcd-server", "haproxy": "haproxy"}
SEARCH = "/usr/bin:/usr/sbin:/usr/local/bin:/usr/local/sbin"


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=SEARCH)


def ensure_binaries(*names: str) -> tuple[dict[str, str], str]:
    """({name: path}, "") or ({}, why not). Missing ones are installed from Debian's packages
    (tests/debian_packages.py)."""
    missing = [n for n in names if not _which(n)]
    if missing:
        installed, why = apt_install(*sorted({PACKAGES[n] for n in missing}))
        still = [n for n in names if not _which(n)]
        if still:
            return {}, f"{', '.join(still)} not installed: {why or 'installed, but not found'}"
    return {n: str(_which(n)) for n in names}, ""


def find_patroni() -> tuple[dict[str, str], str]:
    return ensure_binaries("patroni", "patronictl", "etcd")


def find_haproxy() -> tuple[str | None, str]:
    found, why = ensure_binaries("haproxy")
    return found.get("haproxy"), why


def _http(url: str, method: str = "GET", timeout: float = 1.0) -> tuple[int, bytes]:
    """(status, body) of one request; (0, b"") when nothing answers."""
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, log: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {_tail(log)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout:g} s: {_tail(log)}")


def _tail(path: Path, n: int = 1500) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"


def _stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
    """Stop a process we started, by its PID; SIGKILL if it does not go in time."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PatroniNode:
    def __init__(self, cluster: PatroniCluster, name: str) -> None:
        self.cluster, self.name = cluster, name
        self.port, self.rest_port = free_port(), free_port()
        self.dir = cluster.base / name
        self.datadir = self.dir / "data"
        self.config = self.dir / "patroni.yml"
        self.log = self.dir / "patroni.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def rest(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    def dsn_for(self, dbname: str) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"

    def write_config(self) -> None:
        c = self.cluster
        parameters = {"wal_level": "replica", "hot_standby": "on", "max_wal_senders": 10,
                      "max_replication_slots": 10, "wal_keep_size": "128MB", "max_connections": 200,
                      # A throwaway cluster: no fsync (a killed process loses nothing the kernel
                      # has), full_page_writes stays on: pg_rewind needs it.
                      "fsync": "off", "synchronous_commit": "on"}
        config: dict[str, Any] = {
            "scope": c.scope, "namespace": "/outboxpg-test/", "name": self.name,
            "log": {"level": "INFO", "format": "%(asctime)s %(levelname)s: %(message)s"},
            "restapi": {"listen": f"127.0.0.1:{self.rest_port}", "connect_address": f"127.0.0.1:{self.rest_port}"},
            "etcd3": {"hosts": f"127.0.0.1:{c.etcd_port}"},
            "bootstrap": {
                "dcs": {"ttl": c.ttl, "loop_wait": 1, "retry_timeout": 3, "maximum_lag_on_failover": 16 * 1024 * 1024,
                        "synchronous_mode": c.synchronous_mode,
                        "postgresql": {"use_pg_rewind": True, "use_slots": True, "parameters": parameters}},
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}, {"auth": "trust"}, "no-sync"],
                "pg_hba": ["local all all trust", "host replication replicator 127.0.0.1/32 trust",
                           "host all all 127.0.0.1/32 trust"],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{self.port}", "connect_address": f"127.0.0.1:{self.port}",
                "data_dir": str(self.datadir), "bin_dir": str(c.bindir), "pgpass": str(self.dir / "pgpass"),
                "authentication": {"superuser": {"username": "postgres", "password": "postgres"},
                                   "replication": {"username": "replicator", "password": "replicator"}},
                "parameters": {"unix_socket_directories": str(self.dir)},
                "basebackup": [{"checkpoint": "fast"}, "no-sync"],
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False, "nosync": False},
        }
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config.write_text(json.dumps(config, indent=1))   # JSON is YAML
        c.own(self.dir, self.config)

    def start(self) -> None:
        """Start this node's Patroni (it starts, bootstraps, clones or rewinds PostgreSQL)."""
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([self.cluster.bins["patroni"], str(self.config)], cwd=self.dir,
                                         stdout=log, stderr=subprocess.STDOUT, **self.cluster.as_user())
        self.cluster.own(self.log)

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.datadir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def is_primary(self) -> bool:
        return _http(f"{self.rest}/primary")[0] == 200

    def crash(self) -> None:
        """The node dies: SIGKILL its Patroni, its postmaster and every PostgreSQL process at
        once (killing Patroni alone would leave PostgreSQL running as a primary nobody watches)."""
        pids = []
        if self.proc is not None and self.proc.poll() is None:
            pids.append(self.proc.pid)
        if (pm := self.postmaster_pid()) is not None:
            pids += [pm, *children_of(pm)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        """SIGTERM Patroni (it stops PostgreSQL, fast); whatever PostgreSQL is left is stopped
        immediate by pg_ctl, as its owner. A crashed node's PostgreSQL is started and stopped
        once, so that it removes the shared memory its killed postmaster left behind."""
        _stop(self.proc, timeout=30)
        self.proc = None
        pid = self.postmaster_pid()
        if pid is None:
            return
        if not _alive(pid):
            self._pg_ctl("start", "-l", str(self.dir / "cleanup.log"),
                         "-o", f"-c listen_addresses='' -c port={self.port}")
        self._pg_ctl("stop", "-m", "immediate")

    def _pg_ctl(self, *args: str) -> None:
        subprocess.run([*self.cluster.run_prefix(), str(self.cluster.bindir / "pg_ctl"), "-D", str(self.datadir),
                        "-w", "-t", "30", *args], capture_output=True, check=False, timeout=60)


class PatroniCluster:
    """etcd and two Patroni nodes (``node1`` bootstraps and leads, ``node2`` streams from it)."""

    def __init__(self, *, synchronous_mode: bool = False, ttl: int = 8, run_as: str = "postgres",
                 bins: dict[str, str] | None = None) -> None:
        if bins is None:
            bins, why = find_patroni()
            if not bins:
                raise RuntimeError(why)
        self.bins = bins
        self.synchronous_mode, self.ttl = synchronous_mode, ttl
        self.bindir = find_pg_bindir()
        self._as_root, self._run_as = os.geteuid() == 0, run_as
        self.base = Path(tempfile.mkdtemp(prefix="outboxpg-patroni-"))
        self.scope = f"outboxpg-{os.getpid()}-{self.base.name[-6:]}"
        self.etcd_port, self.etcd_peer_port = free_port(), free_port()
        self.etcd: subprocess.Popen[bytes] | None = None
        self.nodes = {n: PatroniNode(self, n) for n in ("node1", "node2")}
        self.own(self.base)

    # -- running things as the postgres user ---------------------------------------------------

    def own(self, *paths: Path) -> None:
        if self._as_root:
            pw = pwd.getpwnam(self._run_as)
            for p in paths:
                os.chown(p, pw.pw_uid, pw.pw_gid)

    def as_user(self) -> dict[str, Any]:
        if not self._as_root:
            return {}
        pw = pwd.getpwnam(self._run_as)
        return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": [],
                "env": {**os.environ, "HOME": str(self.base), "USER": self._run_as}}

    def run_prefix(self) -> list[str]:
        return ["runuser", "-u", self._run_as, "--"] if self._as_root else []

    # -- the cluster ---------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> PatroniCluster:
        try:
            self._start_etcd()
            for node in self.nodes.values():
                node.write_config()
            self.nodes["node1"].start()
            # node1 takes the initialize key first and bootstraps; node2 waits for it, then clones it.
            deadline = time.monotonic() + timeout
            while "trying to bootstrap a new cluster" not in _tail(self.nodes["node1"].log, 100000):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"node1 did not bootstrap within {timeout:g} s: {self.logs()}")
                time.sleep(0.05)
            self.nodes["node2"].start()
            self.wait_leader("node1", timeout)
            self.wait_streaming("node2", timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_etcd(self) -> None:
        data, log = self.base / "etcd", self.base / "etcd.log"
        peer, client = f"http://127.0.0.1:{self.etcd_peer_port}", f"http://127.0.0.1:{self.etcd_port}"
        with log.open("wb") as out:
            self.etcd = subprocess.Popen(
                [self.bins["etcd"], "--name", "etcd1", "--data-dir", str(data), "--listen-client-urls", client,
                 "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"etcd1={peer}", "--initial-cluster-state", "new",
                 "--initial-cluster-token", self.scope], stdout=out, stderr=subprocess.STDOUT)
        _wait_port(self.etcd_port, self.etcd, "etcd", log)
        deadline = time.monotonic() + 20
        while _http(f"{client}/health")[1].find(b'"true"') < 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not healthy within 20 s: {_tail(log)}")
            time.sleep(0.05)

    def leader(self) -> str | None:
        """The node whose REST API says it is the primary (holds the leader key, runs read-write)."""
        return next((n for n, node in self.nodes.items() if node.proc is not None and node.is_primary()), None)

    def wait_leader(self, name: str | None = None, timeout: float = 60) -> str:
        """Wait until ``name`` (or any node) is the primary; its name."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.leader()
            if got is not None and (name is None or got == name):
                return got
            if time.monotonic() > deadline:
                raise RuntimeError(f"no primary{' ' + name if name else ''} within {timeout:g} s: {self.logs()}")
            time.sleep(0.05)

    def wait_streaming(self, name: str, timeout: float = 60, sync: bool = False) -> None:
        """Wait until ``name`` runs as a replica streaming from the leader (``sync``: as its
        synchronous standby)."""
        deadline = time.monotonic() + timeout
        path = "/sync" if sync else "/replica"
        while True:
            node = self.nodes[name]
            if _http(f"{node.rest}{path}")[0] == 200 and self._streaming(name):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not streaming{' (sync)' if sync else ''} within {timeout:g} s: "
                                   f"{self.logs()}")
            time.sleep(0.05)

    def _streaming(self, name: str) -> bool:
        leader = self.leader()
        if leader is None:
            return False
        try:
            with psycopg.connect(self.nodes[leader].dsn_for("postgres"), autocommit=True, connect_timeout=2) as c:
                row = c.execute("SELECT count(*) FROM pg_stat_replication WHERE application_name = %s "
                                "AND state = 'streaming'", (name,)).fetchone()
                return bool(row and row[0])
        except psycopg.Error:
            return False

    def patronictl(self, *args: str) -> str:
        node = self.nodes["node1"]
        out = subprocess.run([*self.run_prefix(), self.bins["patronictl"], "-c", str(node.config), *args],
                             capture_output=True, text=True, check=False, timeout=120, cwd=self.base)
        if out.returncode != 0:
            raise RuntimeError(f"patronictl {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
        return out.stdout

    def switchover(self, candidate: str | None = None) -> str:
        """``patronictl switchover --force`` to ``candidate`` (the other node); returns its output
        once the candidate is the primary."""
        leader = self.wait_leader()
        candidate = candidate or next(n for n in self.nodes if n != leader)
        out = self.patronictl("switchover", "--leader", leader, "--candidate", candidate, "--force", self.scope)
        self.wait_leader(candidate)
        return out

    def crash(self, name: str) -> None:
        self.nodes[name].crash()

    def start_node(self, name: str) -> None:
        self.nodes[name].start()

    def logs(self) -> str:
        return " | ".join(f"{n}: {_tail(node.log, 800)}" for n, node in self.nodes.items())

    def stop(self) -> None:
        for node in self.nodes.values():
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()   # both at once; node.stop() waits for each
        for node in self.nodes.values():
            try:
                node.stop()
            except Exception as e:  # noqa: BLE001 - stop the rest all the same
                print(f"stopping {node.name}: {e}")
        _stop(self.etcd)
        self.etcd = None
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> PatroniCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class HAProxy:
    """Debian's haproxy on a free port, routing to the node whose Patroni REST API answers
    ``OPTIONS /primary`` with 200 (Patroni's documented HAProxy pattern), checked every
    ``inter`` ms."""

    def __init__(self, binary: str, cluster: PatroniCluster, inter_ms: int = 500) -> None:
        self.binary, self.cluster = binary, cluster
        self.port = free_port()
        self.base = Path(tempfile.mkdtemp(prefix="outboxpg-haproxy-"))
        self.cfg, self.log = self.base / "haproxy.cfg", self.base / "haproxy.log"
        self.stats = self.base / "stats.sock"
        servers = "\n".join(f"    server {n} 127.0.0.1:{node.port} maxconn 100 check port {node.rest_port}"
                            for n, node in cluster.nodes.items())
        self.cfg.write_text(
            f"global\n    maxconn 200\n    stats socket {self.stats}\n"
            "defaults\n    mode tcp\n    timeout connect 2s\n    timeout client 30m\n    timeout server 30m\n"
            f"listen primary\n    bind 127.0.0.1:{self.port}\n"
            "    option httpchk OPTIONS /primary\n    http-check expect status 200\n"
            f"    default-server inter {inter_ms}ms fall 2 rise 1 on-marked-down shutdown-sessions\n"
            f"{servers}\n")
        self.proc: subprocess.Popen[bytes] | None = None

    def dsn_for(self, dbname: str) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"

    def start(self) -> HAProxy:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([self.binary, "-db", "-f", str(self.cfg)], stdout=out,
                                         stderr=subprocess.STDOUT)
        try:
            _wait_port(self.port, self.proc, "haproxy", self.log)
            self._wait_settled()
        except BaseException:
            self.stop()
            raise
        return self

    def routed(self) -> set[str]:
        """The servers haproxy's checks hold UP (``show stat``, its CSV's ``status`` column)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(str(self.stats))
            s.sendall(b"show stat\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        lines = out.decode().splitlines()
        header = lines[0].lstrip("# ").split(",")
        name, status = header.index("svname"), header.index("status")
        rows = [line.split(",") for line in lines[1:] if line]
        return {r[name] for r in rows if r[name] in self.cluster.nodes and r[status] == "UP"}

    def _wait_settled(self, timeout: float = 20) -> None:
        # A server starts UP until its checks say otherwise: a session opened through haproxy
        # before then may land on a standby and be shut down when that standby is marked down
        # (on-marked-down shutdown-sessions). Wait until the leader alone is routed.
        deadline = time.monotonic() + timeout
        while True:
            leader, routed = self.cluster.leader(), self.routed()
            if leader is not None and routed == {leader}:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"haproxy routes to {sorted(routed)}, not the leader {leader}, "
                                   f"after {timeout:g} s: {_tail(self.log)}")
            time.sleep(0.1)

    def stop(self) -> None:
        _stop(self.proc)   # SIGTERM: hard stop, open sessions closed
        self.proc = None
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> HAProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
