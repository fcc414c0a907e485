"""The Node.js worker of docs/how-to/other-language.md (examples/node) against a real
database: `npm ci` in a copy of the example, then `node worker.js`. It covers a partly failed
batch (the published prefix completed, the first failure failed, the rest of its run released),
ids above 2^53 (bigint, not Number), payload::text (the stored bytes), one lease token per claim,
and a lease lost while publishing (outbox_fail returns NULL, outbox_complete a lower count).
Skipped only when `node` is not installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from helpers import insert
from psycopg.conninfo import conninfo_to_dict

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "node"
Conn = psycopg.Connection[Any]

pytestmark = pytest.mark.skipif(shutil.which("node") is None,
                                reason="node is not installed: the Node.js example (examples/node) cannot run")


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of examples/node with its dependencies installed from package-lock.json (npm ci;
    from npm's cache when it has them, else from the registry)."""
    npm = shutil.which("npm")
    assert npm, "node is installed but npm is not: cannot install the example's dependencies"
    dest = tmp_path_factory.mktemp("node") / "example"
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("node_modules"))
    r = subprocess.run([npm, "ci", "--prefer-offline", "--no-audit", "--no-fund"], cwd=dest, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return dest


def database_url(dsn: str) -> str:
    d = conninfo_to_dict(dsn)
    auth = quote(d["user"]) + (":" + quote(d["password"]) if d.get("password") else "")
    return f"postgresql://{auth}@{d['host']}:{d['port']}/{quote(d['dbname'])}"


def node(example: Path, dsn: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(["node", "worker.js"], cwd=example, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**{k: v for k, v in os.environ.items() if not k.startswith("PG")},
                                            "DATABASE_URL": database_url(dsn), **env})


def finish(p: subprocess.Popen[str]) -> list[dict[str, Any]]:
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, (out, err)
    assert err == "", err
    return [json.loads(line) for line in out.splitlines()]


def test_a_partly_failed_batch_is_reported_run_by_run(example: Path, dsn: str, conn: Conn) -> None:
    # Ids above 2^53: parsed as Number they would come out changed (9007199254740993 -> ...992).
    conn.execute("SELECT setval('outbox_id_seq', 9007199254740992)")
    ids = [insert(conn, "order", f"o-{n % 2}", "updated",
                  json.dumps({"n": n, "fail": n == 3, "note": "stored as jsonb"})) for n in range(1, 7)]
    one, two, three, four, five, six = ids
    assert one == 9007199254740993
    stored = dict(conn.execute("SELECT id, payload::text FROM outbox").fetchall())

    lines = finish(node(example, dsn))
    claimed = [line for line in lines if "claimed" in line]
    assert len(claimed) == 1 and [int(i) for i in claimed[0]["claimed"]] == ids, lines
    published = [line for line in lines if "published" in line]
    # o-1: 1 published, 3 failed, so 5 was not sent; o-0: 2, 4, 6. Each aggregate in id order.
    assert sorted(int(p["published"]) for p in published) == [one, two, four, six]
    for agg in ([one], [two, four, six]):
        assert [int(p["published"]) for p in published if int(p["published"]) in agg] == agg
    for p in published:   # the stored JSON text, byte for byte, and the broker's dedup key
        assert p["payload"] == stored[int(p["published"])]
        assert p["msg_id"] == conn.execute("SELECT msg_id::text FROM outbox WHERE id = %s",
                                           (int(p["published"]),)).fetchone()[0]
        assert p["subject"] == "outbox.order.updated"
    assert [line for line in lines if "failed" in line] == [
        {"failed": str(three), "state": "pending", "error": f"stand-in broker refused event {three}"}]
    assert [line for line in lines if "released" in line] == [{"released": [str(five)], "count": 1}]
    assert not [line for line in lines if "lease_lost" in line]

    rows = {i: (s, a, e) for i, s, a, e in conn.execute("SELECT id, state::text, attempts, last_error FROM outbox")}
    assert rows == {one: ("published", 1, None), two: ("published", 1, None), four: ("published", 1, None),
                    six: ("published", 1, None),
                    three: ("pending", 1, f"stand-in broker refused event {three}"),
                    five: ("pending", 0, None)}   # released: no attempt counted; it comes after 3
    assert conn.execute("SELECT aggregate_id, head_id FROM outbox_heads").fetchall() == [("o-1", three)]


def test_a_lease_lost_while_publishing_changes_nothing(example: Path, dsn: str, conn: Conn) -> None:
    # The takeover counts a failed attempt and retries after the backoff: an hour, so that the
    # example's next claim finds nothing and it exits.
    conn.execute("UPDATE outbox_settings SET backoff_base = '1 hour', backoff_cap = '1 hour'")
    ok = insert(conn, "order", "o-ok", "created", '{"fail": false}')
    bad = insert(conn, "order", "o-bad", "created", '{"fail": true}')
    # A publisher slower than the lease: another claim takes the events over meanwhile.
    p = node(example, dsn, LEASE="1 second", PUBLISH_DELAY_MS="4000")
    end = time.monotonic() + 20
    while conn.execute("SELECT count(*) FROM outbox WHERE state = 'processing' AND locked_until < now()"
                       ).fetchone()[0] < 2:
        assert p.poll() is None and time.monotonic() < end, p.communicate()
        time.sleep(0.05)
    conn.execute("SELECT * FROM outbox_claim(10, '1 minute', 'another-worker')")   # reclaims the expired runs
    after = conn.execute("SELECT id, state::text, attempts, lease_token, last_error FROM outbox ORDER BY id").fetchall()
    assert [row[1:4] for row in after] == [("pending", 1, None)] * 2

    lines = finish(p)
    lost = [line for line in lines if "lease_lost" in line]
    assert {"lease_lost": True, "id": str(bad),
            "note": "outbox_fail returned NULL: another worker holds the event now"} in lost, lines
    assert any("completed 0 of 1" in line.get("note", "") for line in lost), lines
    assert not [line for line in lines if "failed" in line or "released" in line]
    # Nothing the slow worker reported changed a row: the takeover's state stands.
    assert conn.execute("SELECT id, state::text, attempts, lease_token, last_error FROM outbox ORDER BY id"
                        ).fetchall() == after
    assert [row[0] for row in after] == [ok, bad]
