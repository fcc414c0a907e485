"""RabbitMQ for the tests: names of their own on the machine's broker (``AMQP_URL``, cleaned up
by the test), and a private broker (``PrivateRabbitMQ``) a test may stop and start.

The private broker is ``rabbitmq-server`` run from a temp dir: its own node name, AMQP port and
distribution port (free ones), its own config (never /etc/rabbitmq's), data and logs, no
plugins, its own Erlang cookie (HOME is the temp dir). It registers with the epmd already
listening on 4369 when there is one; otherwise with an epmd of its own on a free port, which
``close()`` stops. Stopped by the PID it wrote (SIGTERM: RabbitMQ shuts down cleanly), started
again on the same port and data, so durable exchanges and queues and persistent messages
survive the restart. A start takes about 6 s on the 2-core machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from processes import children_of

AMQP_URL = os.environ.get("OUTBOXPG_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"


def unique(prefix: str) -> str:
    """A name for an exchange or a queue of this test's own."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def private_broker_missing() -> str | None:
    """Why a private broker cannot be started here, or None."""
    if not Path(RABBITMQ_SERVER).exists():
        return f"RabbitMQ's server is not installed ({RABBITMQ_SERVER} is missing)"
    return None


class PrivateRabbitMQ:
    def __init__(self, max_message_size: int | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="outboxpg-rabbitmq-"))
        self.name = f"outboxpg{uuid.uuid4().hex[:8]}@localhost"
        self.port = free_port()
        self.dist_port = free_port()
        self.epmd_port: int | None = None if listening(4369) else free_port()
        conf = [f"listeners.tcp.default = 127.0.0.1:{self.port}", "loopback_users = none"]
        if max_message_size is not None:
            conf.append(f"max_message_size = {max_message_size}")
        (self.dir / "rabbitmq.conf").write_text("\n".join(conf) + "\n")
        (self.dir / "env.conf").write_text("")
        (self.dir / "enabled_plugins").write_text("[].\n")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def _env(self) -> dict[str, str]:
        d = str(self.dir)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update(HOME=d, RABBITMQ_NODENAME=self.name, RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
                   RABBITMQ_NODE_PORT=str(self.port), RABBITMQ_DIST_PORT=str(self.dist_port),
                   RABBITMQ_MNESIA_BASE=f"{d}/mnesia", RABBITMQ_LOG_BASE=f"{d}/log",
                   RABBITMQ_CONFIG_FILE=f"{d}/rabbitmq.conf", RABBITMQ_CONF_ENV_FILE=f"{d}/env.conf",
                   RABBITMQ_ADVANCED_CONFIG_FILE=f"{d}/advanced.config",
                   RABBITMQ_ENABLED_PLUGINS_FILE=f"{d}/enabled_plugins", RABBITMQ_PID_FILE=f"{d}/pid",
                   ERL_EPMD_ADDRESS="127.0.0.1")
        if self.epmd_port is not None:
            env["ERL_EPMD_PORT"] = str(self.epmd_port)
        return env

    def start(self, timeout: float = 60.0) -> None:
        assert self.process is None, "started already"
        if listening(self.port):   # not ours to take for a broker that started
            raise RuntimeError(f"port {self.port} of the private rabbitmq-server is taken before it starts")
        with open(self.dir / "server.out", "ab") as out:
            self.process = subprocess.Popen([RABBITMQ_SERVER], env=self._env(), stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not listening(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = (self.dir / "server.out").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"private rabbitmq-server did not start on port {self.port}:\n{tail}")
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the broker: SIGTERM to the Erlang VM (by its PID file, and as the child of the
        script we started, should the file not be written yet), then wait for the script to end
        and the port to close; SIGKILL to the whole session after ``timeout``. A port still
        open after that is an error, not a broker taken for stopped."""
        process, self.process = self.process, None
        if process is None:
            return
        pid_file = self.dir / "pid"
        vms = set(children_of(process.pid))
        with contextlib.suppress(FileNotFoundError, ValueError):
            vms.add(int(pid_file.read_text().strip()))
        for pid in vms:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)   # its own session: the script and the VM it started
            process.wait(10)
        with contextlib.suppress(FileNotFoundError):
            pid_file.unlink()
        deadline = time.monotonic() + 10
        while listening(self.port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"private rabbitmq-server still listening on port {self.port} after it stopped")
            time.sleep(0.05)

    def close(self) -> None:
        self.stop()
        if self.epmd_port is not None:
            subprocess.run(["epmd", "-port", str(self.epmd_port), "-kill"], capture_output=True, timeout=10,
                           check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
