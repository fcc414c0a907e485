"""Where the machine's CPU goes during a benchmark, read from /proc (Linux only).

Shared by the benchmarks: ``CpuMeter`` splits the CPU time of a measurement by process class,
``backend_cpu_s`` reads one server backend's CPU, ``QuietWaiter`` waits for a quiet second.

Classes of processes (decided when a process is first seen):
  worker         a child of this process whose command line names ``outboxpg-worker``
  bench          this process and its other children (producers, pgbench, an in-process relay),
                 and the PostgreSQL backends listed in ``bench_backends`` (the bench's own
                 monitoring connections)
  pg             the other PostgreSQL backends of database ``dbname``
  pg_background  PostgreSQL's shared background processes (walwriter, checkpointer, ...); shared
                 with whoever else uses the server, but mostly driven by the run's writes
  nats           the process listening on ``nats_port`` (when given)
  other          everything else: other users of the machine ("foreign" load)

CPU time per event, rather than events/s, is the figure to compare designs by: outside load
hardly changes how much CPU a process spends on an event, while it changes events/s a lot.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

__all__ = ["HZ", "CLASSES", "CpuMeter", "backend_cpu_s", "process_cpu_s", "QuietWaiter", "listening_pids",
           "speed_reference_ms"]

HZ = os.sysconf("SC_CLK_TCK")
CLASSES = ("worker", "bench", "pg", "pg_background", "nats", "other")
OURS = ("worker", "bench", "pg")


def _stat(pid: int | str) -> tuple[int, int, int]:
    """(ppid, user+system ticks, start time in ticks since boot) of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19])


def listening_pids(port: int) -> set[int]:
    """Processes with a TCP socket listening on ``port`` (needs to see their /proc/<pid>/fd)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:   # 0A: LISTEN
                        inodes.add(f"socket:[{cols[9]}]")
        except (OSError, StopIteration):
            continue
    pids: set[int] = set()
    if not inodes:
        return pids
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                if os.readlink(fd.path) in inodes:
                    pids.add(int(entry.name))
                    break
        except OSError:
            continue
    return pids


class CpuMeter:
    """Splits the machine's CPU time during a measurement into the classes above, by sampling
    /proc every ``interval`` s (so that processes that exit meanwhile are counted too).

    ``result`` after exit: ``cpu_s`` (CPU seconds by class), ``busy_pct`` / ``mine_pct`` /
    ``pg_background_pct`` / ``foreign_pct`` (shares of the machine's capacity; mine = worker +
    bench + pg; foreign = all busy time not accounted to a known class, nats included unless a
    nats port was given), ``mine_cpu_s``, ``pg_background_cpu_s``, ``wall_s``.
    """

    HZ = HZ

    def __init__(self, dbname: str, *, nats_port: int | None = None,
                 bench_backends: set[int] | None = None, interval: float = 0.1) -> None:
        self.dbname = dbname
        self.interval = interval   # a scan of /proc costs a few ms: sample no more often than needed
        self.me = os.getpid()
        self.bench_backends = bench_backends or set()
        self.nats_pids = listening_pids(nats_port) if nats_port else set()
        self._procs: dict[tuple[int, int], list[Any]] = {}   # (pid, start) -> [class, first, last]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.result: dict[str, Any] = {}

    @staticmethod
    def _busy() -> int:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v) - v[3] - v[4]   # all but idle and iowait

    @staticmethod
    def _steal() -> int:
        """Ticks the hypervisor gave to other guests while this one wanted to run."""
        with open("/proc/stat") as f:
            v = f.readline().split()[1:]
        return int(v[7]) if len(v) > 7 else 0

    def _classify(self, pid: int, ppid: int) -> str:
        if pid in self.nats_pids:
            return "nats"
        if pid in self.bench_backends:
            return "bench"
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = ""
        if pid == self.me:
            return "bench"
        if ppid == self.me:
            return "worker" if "outboxpg-worker" in cmd else "bench"
        if cmd.startswith("postgres:") or "/bin/postgres" in cmd:
            if f" {self.dbname} " in cmd:
                return "pg"
            if "(" not in cmd and "[local]" not in cmd:   # no client address: a background process
                return "pg_background"
        return "other"

    def _sample(self) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                ppid, ticks, start = _stat(entry.name)
            except (OSError, IndexError, ValueError):
                continue
            pid = int(entry.name)
            rec = self._procs.get((pid, start))
            if rec is None:
                first = 0 if start >= self._t0_ticks else ticks   # started during the measurement
                self._procs[(pid, start)] = [self._classify(pid, ppid), first, ticks]
            else:
                rec[2] = ticks

    def start(self) -> "CpuMeter":
        with open("/proc/uptime") as f:
            self._t0_ticks = int(float(f.read().split()[0]) * HZ)
        self._busy0 = self._busy()
        self._steal0 = self._steal()
        self._wall0 = time.perf_counter()
        self._sample()

        def loop() -> None:
            while not self._stop.wait(self.interval):
                self._sample()
        self._thread = threading.Thread(target=loop, name="bench-cpumeter", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread:
            self._thread.join()
        self._sample()
        wall = time.perf_counter() - self._wall0
        capacity = wall * (os.cpu_count() or 1) * HZ
        total = self._busy() - self._busy0
        by = dict.fromkeys(CLASSES, 0)
        for cls, first, last in self._procs.values():
            by[cls] += max(0, last - first)
        mine = sum(by[c] for c in OURS)
        known = mine + by["pg_background"] + by["nats"]
        other = max(0, total - known)
        self.result = {k: round(100 * v / capacity, 1) for k, v in
                       (("busy_pct", total), ("mine_pct", mine), ("pg_background_pct", by["pg_background"]),
                        ("nats_pct", by["nats"]), ("foreign_pct", other))}
        self.result["mine_cpu_s"] = mine / HZ
        self.result["pg_background_cpu_s"] = by["pg_background"] / HZ
        self.result["cpu_s"] = {k: v / HZ for k, v in by.items()} | {"other": other / HZ}
        self.result["wall_s"] = wall
        self.result["steal_pct"] = round(100 * (self._steal() - self._steal0) / capacity, 1)
        return self.result

    def __enter__(self) -> "CpuMeter":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def foreign(self) -> float:
        return float(self.result.get("foreign_pct", 0.0))

    def per_event_us(self, events: int) -> dict[str, float]:
        """CPU microseconds per event by class (after stop())."""
        return {k: 1e6 * v / max(events, 1) for k, v in self.result["cpu_s"].items()}


def speed_reference_ms() -> float:
    """Milliseconds a fixed piece of pure-Python work takes (best of 5): on a VM, outside load
    can slow every process alike without showing as foreign CPU or steal (the host's other
    guests), and then every CPU-per-event figure rises together. Lower is faster."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        sum(range(300_000))
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far; 0.0 once it is gone."""
    try:
        return _stat(pid)[1] / HZ
    except (OSError, IndexError, ValueError):
        return 0.0


def backend_cpu_s(conn: Any) -> float | None:
    """CPU seconds the server process behind a psycopg connection has used so far (None: the
    server is not on this machine)."""
    try:
        return _stat(conn.info.backend_pid)[1] / HZ
    except (OSError, IndexError, ValueError):
        return None


class QuietWaiter:
    """Before a measurement, wait (within an overall budget) for a second in which other users of
    the machine take less than ``threshold`` % of its CPU; the figures say how much they took."""

    def __init__(self, dbname: str, budget_s: float, threshold: float = 10.0, **meter: Any) -> None:
        self.dbname, self.budget, self.threshold, self.meter = dbname, budget_s, threshold, meter
        self.waited = 0.0

    def __call__(self) -> float:
        """Returns the foreign CPU share of the last second waited (or -1 if none was)."""
        foreign = -1.0
        while self.waited < self.budget:
            t0 = time.perf_counter()
            with CpuMeter(self.dbname, **self.meter) as m:
                time.sleep(1.0)
            self.waited += time.perf_counter() - t0
            foreign = m.foreign
            if foreign < self.threshold:
                break
        return foreign
