"""The chaos soak, short: about 40 s of producers and faults on servers of its own, then the checker.

The long versions are `bin/soak --minutes 3 --seed 42` and `bin/soak --distributed --seconds 180
--seed N`; their figures are in RELIABILITY.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "tools" / "soak.py"   # what bin/soak runs
sys.path.insert(0, str(SOAK.parent))
from soak import FAULT_KINDS  # noqa: E402


@pytest.mark.slow
@pytest.mark.xdist_group("soak")   # never beside the other soak (bin/test: --dist loadgroup)
@pytest.mark.timeout(240)
def test_short_soak_loses_nothing_duplicates_nothing_reorders_nothing():
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(SOAK), "--seconds", "28", "--seed", "7"],
                       capture_output=True, text=True, timeout=220)
    elapsed = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("SOAK_RESULT "))
    result = json.loads(line.removeprefix("SOAK_RESULT "))
    assert all(result["invariants"].values()), result["invariants"]
    # The seeded schedule injects every kind of fault at least once, even in a short run.
    for kind in FAULT_KINDS:
        assert result["faults"].get(kind, 0) >= 1, (kind, result["faults"])
    assert result["injected_publish_failures"] > 0
    assert result["committed"] > 200 and result["delivered"] == result["committed"]
    assert result["lost"] == result["out_of_order"] == result["duplicates_stored"] == 0
    # Deliberate rollbacks and transactions cut by PostgreSQL restarts happened, and none leaked.
    assert result["transactions"].get("rolled_back", 0) > 0
    assert result["unrecovered_faults"] == 0
    assert elapsed < 150, f"soak took {elapsed:.0f}s"


def _distributed_unavailable() -> str | None:
    """Why this machine cannot run the distributed soak (None: it can)."""
    from soak_distributed import Unavailable, check_available

    try:
        check_available()
    except Unavailable as e:
        return str(e)
    return None


@pytest.mark.slow
@pytest.mark.xdist_group("soak")   # never beside the other soak (bin/test: --dist loadgroup)
@pytest.mark.timeout(300)
def test_short_distributed_soak_each_distributed_fault_once():
    """--distributed: a 3-node JetStream cluster (R3), a primary with a synchronous standby, the
    workers on hosts of their own (network namespaces). Each distributed fault kind once: a
    follower and the stream leader SIGKILLed and restarted, the primary stopped (immediate) and
    the standby promoted, a host cut from PostgreSQL and from NATS for longer than the lease, a
    slow publisher, poison near max_payload, a held snapshot. Nothing lost, reordered or stored
    twice; the poison event over max_payload dead; every namespace and link removed afterwards."""
    from soak import DISTRIBUTED_KINDS

    if reason := _distributed_unavailable():
        pytest.skip(reason)
    proc = subprocess.Popen([sys.executable, str(SOAK), "--distributed", "--seconds", "30", "--seed", "11",
                             "--kinds", ",".join(DISTRIBUTED_KINDS)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=280)
    assert proc.returncode == 0, out[-6000:]
    line = next(x for x in out.splitlines() if x.startswith("SOAK_RESULT "))
    result = json.loads(line.removeprefix("SOAK_RESULT "))
    assert all(result["invariants"].values()), result["invariants"]
    for kind in DISTRIBUTED_KINDS:
        assert result["faults"].get(kind, 0) >= 1, (kind, result["faults"])
    assert "(stream leader)" in out, out[-6000:]      # the leader itself was among the nodes killed
    assert result["lost"] == result["out_of_order"] == result["duplicates_stored"] == 0
    assert result["committed"] > 200 and result["delivered"] == result["committed"]
    assert result["poison_dead"] == 1 and result["unrecovered_faults"] == 0
    assert result["seed"] == 11 and set(result["latency_worst_around"]) == set(DISTRIBUTED_KINDS)
    # The soak removed what it made, found by the names that carry its PID.
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    lo = subprocess.run(["ip", "-o", "addr", "show", "dev", "lo"], capture_output=True, text=True).stdout
    assert f"outboxpg-soak-{proc.pid}-" not in netns and f"osk{proc.pid}h" not in links and f"osk{proc.pid}" not in lo
