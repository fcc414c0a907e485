"""A private PgBouncer for the tests: Debian's ``pgbouncer`` binary, found or installed, run on
a free loopback port with its own ini and userlist in a temp dir, in front of the test
PostgreSQL. Stopped by its own PID; nothing else is touched.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import psycopg
from debian_packages import apt_install

from outboxpg.embedded import free_port

__all__ = ["PgBouncer", "find_pgbouncer"]


def _which() -> str | None:
    if env := os.environ.get("OUTBOXPG_PGBOUNCER"):
        return env
    # /usr/sbin is not on every user's PATH.
    return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/local/sbin")


def find_pgbouncer() -> tuple[str | None, str]:
    """(path of the pgbouncer binary, "") or (None, why there is none).

    When it is missing, Debian's package is installed (tests/debian_packages.py).
    """
    if found := _which():
        return found, ""
    installed, why = apt_install("pgbouncer")
    if installed and (found := _which()):
        return found, ""
    return None, f"pgbouncer not installed: {why or 'installed, but not found'}"


class PgBouncer:
    """``with PgBouncer(binary, pg_host, pg_port, user) as pgb: psycopg.connect(pgb.dsn_for(db))``.

    Every database name is passed through to the PostgreSQL behind it (the ``*`` entry), so each
    test's own database is reachable. PgBouncer refuses to run as root: then it runs as
    ``run_as`` (postgres), started with Popen(user=...) so that the PID we hold is its own.
    """

    def __init__(self, binary: str, pg_host: str, pg_port: int, user: str, password: str | None = None, *,
                 pool_mode: str = "transaction", pool_size: int = 20, run_as: str = "postgres") -> None:
        self.binary = binary
        self.port = free_port()
        self.user = user
        self.pool_mode = pool_mode
        self._as_root = os.geteuid() == 0
        self._run_as = run_as
        self._base = Path(tempfile.mkdtemp(prefix="outboxpg-pgbouncer-"))
        self.ini = self._base / "pgbouncer.ini"
        self.logfile = self._base / "pgbouncer.log"
        self.proc: subprocess.Popen[bytes] | None = None
        secret = (password or "").replace('"', '""')
        (self._base / "userlist.txt").write_text(f'"{user}" "{secret}"\n')
        self.ini.write_text(
            "[databases]\n"
            f"* = host={pg_host} port={pg_port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            # The test PostgreSQL trusts local logins; the userlist still names who may log in,
            # and gives PgBouncer the server password when the server wants one.
            "auth_type = trust\n"
            f"auth_file = {self._base / 'userlist.txt'}\n"
            f"admin_users = {user}\n"
            f"pool_mode = {pool_mode}\n"
            f"default_pool_size = {pool_size}\n"
            "max_client_conn = 200\n"
            f"logfile = {self.logfile}\n"
            f"pidfile = {self._base / 'pgbouncer.pid'}\n")

    def dsn_for(self, dbname: str) -> str:
        return f"host=127.0.0.1 port={self.port} user={self.user} dbname={dbname}"

    def server_pids(self, dbname: str) -> set[int]:
        """The backend pids of PgBouncer's server connections to ``dbname`` (SHOW SERVERS on the
        admin console, which speaks only the simple query protocol: a ClientCursor)."""
        with psycopg.connect(self.dsn_for("pgbouncer"), autocommit=True, cursor_factory=psycopg.ClientCursor) as c:
            cur = c.execute("SHOW SERVERS")
            names = [d.name for d in cur.description or ()]
            rows = [dict(zip(names, r)) for r in cur.fetchall()]
        return {int(r["remote_pid"]) for r in rows if r["database"] == dbname}

    def start(self) -> PgBouncer:
        kwargs: dict[str, object] = {}
        if self._as_root:
            pw = pwd.getpwnam(self._run_as)
            for path in (self._base, *self._base.iterdir()):
                os.chown(path, pw.pw_uid, pw.pw_gid)
            kwargs = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        self.proc = subprocess.Popen([self.binary, str(self.ini)], stdout=subprocess.DEVNULL,
                                     stderr=(self._base / "stderr.log").open("wb"), **kwargs)  # type: ignore[call-overload]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with {self.proc.returncode}: {self.log()[-1500:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"pgbouncer did not listen within 20 s: {self.log()[-1500:]}")

    def log(self) -> str:
        parts = [p.read_text(errors="replace") for p in (self.logfile, self._base / "stderr.log") if p.exists()]
        return "\n".join(parts)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)     # immediate shutdown
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        shutil.rmtree(self._base, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
