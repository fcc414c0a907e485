"""Processes of the machine, read from /proc: for the helpers that stop the servers they started."""

from __future__ import annotations

import contextlib
from pathlib import Path


def children_of(pid: int) -> list[int]:
    """The PIDs of ``pid``'s direct children. From each process's stat line (its parent's PID), not
    /proc/<pid>/task/*/children, which kernels without CONFIG_PROC_CHILDREN (this machine's) lack."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # pid (comm) state ppid ...: comm may hold spaces and parentheses; ppid follows the last ')'
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found
