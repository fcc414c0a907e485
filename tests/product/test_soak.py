"""The chaos soak, short: about 40 s of producers and faults on servers of its own, then the checker.

The long version is `bin/soak --minutes 3 --seed 42`; its figures are in RELIABILITY.md.
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
@pytest.mark.timeout(240)
def test_short_soak_loses_nothing_duplicates_nothing_reorders_nothing():
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(SOAK), "--seconds", "40", "--seed", "7"],
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
