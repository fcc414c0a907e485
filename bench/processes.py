"""Stopping the processes a benchmark started: SIGTERM, 30 s, then SIGKILL; by PID, only ours."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any


def stop(p: subprocess.Popen[Any], procs: list[Any] | None = None) -> None:
    """Stop ``p`` if it still runs and forget it in ``procs`` (the benchmark's list of its own)."""
    if p.poll() is None:
        os.kill(p.pid, signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
    if procs is not None and p in procs:
        procs.remove(p)
