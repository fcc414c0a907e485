"""docs/grafana-dashboard.json queries only what a worker exports. The names come from a live
/metrics scrape of a real `outboxpg-worker --metrics-port` (so the database gauges, which only
appear when sampling the database works, are there as in production); every metric name and
every label its queries use must be among them, and every exported metric is on the dashboard."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
from commands import Proc
from helpers import insert

from outboxpg.embedded import free_port

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
# Labels Prometheus adds to every scraped series, and the buckets' own.
TARGET_LABELS = {"instance", "job", "le"}

def exported(text: str) -> tuple[set[str], set[str]]:
    """The sample names (a counter's _total, a histogram's _bucket/_sum/_count, ...) and label names
    of a /metrics page, from its # TYPE lines and samples."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",), "summary": ("_sum", "_count", "_created", "")}
    names: set[str] = set()
    labels: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            family = family.removesuffix("_total") if kind == "counter" else family
            names |= {family + s for s in suffixes.get(kind, ("",))}
        elif line and not line.startswith("#") and "{" in line:
            labels |= set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', line.split("}", 1)[0]))
    return {n for n in names if n.startswith("outboxpg_")}, labels


def delivered(text: str) -> float:
    """The sum of outboxpg_events_delivered_total over its label sets on a /metrics page."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("outboxpg_events_delivered_total{"))


def queries(dashboard: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return out




def test_every_metric_the_dashboard_queries_is_exported(dsn: str, conn: psycopg.Connection[Any],
                                                        tmp_path: Path) -> None:
    for n in range(3):
        insert(conn, "order", f"o-{n}", "created")
    port = free_port()
    w = Proc(tmp_path, "--dsn", dsn, "--publisher", "outboxpg.relay.publishers:print_event", "--metrics-port", str(port))
    try:
        # The worker counts an event delivered after its complete commits, so the rows can read
        # 'published' a moment before the counter (and its labels) shows them: scrape until it does.
        end = time.monotonic() + 20
        while True:
            published = conn.execute("SELECT count(*) FROM outbox WHERE state = 'published'").fetchone()
            text = ""
            if published == (3,):
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                if delivered(text) == 3:
                    break
            assert time.monotonic() < end, (published, text, w.text())
            time.sleep(0.05)
    finally:
        assert w.stop() == 0, w.text()
    names, labels = exported(text)
    assert "outboxpg_backlog_events" in names and "outboxpg_events_delivered_total" in names, text

    dashboard = json.loads(DASHBOARD.read_text())
    exprs = queries(dashboard)
    assert len(exprs) >= 10
    used: set[str] = set()
    for expr in exprs:
        metrics = set(re.findall(r"\boutboxpg_[a-z_]+", expr))
        assert metrics, f"a query without an outboxpg metric: {expr}"
        assert metrics <= names, f"{expr}: {sorted(metrics - names)} not exported by the worker"
        used |= metrics
        # Labels: in matchers {x=...}, in by (...) / without (...), and in legends {{x}}.
        matched = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=~?\s*"', expr))
        grouped = {w.strip() for g in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr) for w in g.split(",")}
        unknown = (matched | grouped) - labels - TARGET_LABELS
        assert not unknown, f"{expr}: labels {sorted(unknown)} not exported"
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))
            assert legend <= labels | TARGET_LABELS, (p["title"], legend)
    # And the other way round: each metric the worker exports has a place on the dashboard.
    families = {re.sub(r"_(bucket|sum|count|created)$", "", n) for n in names if not n.endswith("_created")}
    shown = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    assert families <= shown, f"not on the dashboard: {sorted(families - shown)}"


def test_the_dashboard_is_importable_json_with_unique_panel_ids() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] and dashboard["title"]
    for p in dashboard["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
