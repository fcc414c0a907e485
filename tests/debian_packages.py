"""Installing a missing test tool from Debian's packages, for the tests that need a real server
program (PgBouncer, Patroni, etcd, HAProxy)."""

from __future__ import annotations

import os
import shutil
import subprocess

# Test processes run side by side (pytest-xdist): one may install while another wants to. apt-get
# waits this long for dpkg's lock instead of failing at once ("Unable to acquire the dpkg
# frontend lock"), which would skip the second one's tests for no reason of their own.
LOCK_TIMEOUT_SECONDS = 300


def apt_install(*packages: str) -> tuple[bool, str]:
    """(True, "") once ``packages`` are installed, or (False, why not). Only as root on a machine
    with apt-get; `apt-get update` first only if the plain install fails (the lists may be
    missing or stale)."""
    hint = f"apt-get install {' '.join(packages)}"
    if os.geteuid() != 0:
        return False, f"not root to install them ({hint})"
    if not shutil.which("apt-get"):
        return False, f"no apt-get to install them ({hint})"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    wait = ["-o", f"DPkg::Lock::Timeout={LOCK_TIMEOUT_SECONDS}"]
    install = ["apt-get", *wait, "install", "-y", "-q", "--no-install-recommends", *packages]
    result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        subprocess.run(["apt-get", *wait, "update", "-q"], env=env, capture_output=True, text=True, check=False)
        result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or ["no output"]
        return False, f"{hint} failed ({result.returncode}): {tail[0]}"
    return True, ""
