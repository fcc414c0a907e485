"""The commands shown with their output in README.md and the pages of docs/ still print that output
(issue 10: "docs that match").

Every plain or `console` code block of those files (DOCS, below) carries a marker on the line
before it:

  <!-- doc-check: run SCENARIO -->            its `$ command` lines are run, in order, in one bash
                                              session, in a fresh database built by SCENARIO
                                              (below), and each one's output compared with the
                                              lines under it
  <!-- doc-check: run SCENARIO: COMMAND -->   an output-only block: COMMAND prints it
  <!-- doc-check: excerpt PATH -->            the block's lines appear, in order and together, in PATH
  <!-- doc-check: skip REASON -->             not checked, and why (timing, another machine, ...)

A new output block without a marker fails test_every_output_block_is_marked, so nothing can be
added unchecked without saying why. Compared modulo what changes from run to run (see
normalise(): timestamps, ages, uuids, ports, pids, partition dates, column padding); a line that
is just `...` stands for any number of lines (output abridged in the docs). A command's exit code
is compared when the doc shows it as `(exit code N)`.

The database of a scenario is named `shop` in the docs and has a unique name here: commands run
with PGHOST/PGPORT/PGUSER/PGDATABASE, `$DSN` and `$OUTBOXPG_DSN` pointing at it, and its real name
is replaced by `shop` in the output. Literal values a reader would write differently (a host
`db`, a login) are mapped in SUBSTITUTIONS, per scenario, in plain sight.

OUTBOXPG_DOCS_UPDATE=1 bin/test tests/product/test_docs.py rewrites the checked blocks with what the
commands print now (review the diff before committing it). A command whose output the doc abridges
(a `...` line) keeps as many of its first and last lines as the doc showed, around one `...`.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from pytest_postgresql.janitor import DatabaseJanitor

from outboxpg import schema
from outboxpg.embedded import EmbeddedNats

ROOT = Path(__file__).resolve().parents[2]
# README.md and every page of docs/ but the two that tooling writes and checks on its own
# (docs/sql-api.md, generated from the catalog; docs/migrations.md, the schema's release workflow).
DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")
                             if p.name not in ("sql-api.md", "migrations.md")))
MARKER = re.compile(r"^<!-- doc-check: (run|excerpt|skip)\b\s*(.*?)\s*-->$")
UPDATE = os.environ.get("OUTBOXPG_DOCS_UPDATE") == "1"
# The virtual environment the tests run in (bin/test's .venv), as printed paths name it.
VENV = sys.prefix if sys.prefix != sys.base_prefix else "\0no venv"
SEP = "\x1edoc-check-exit"


# -- the blocks ---------------------------------------------------------------------------------

@dataclass
class Block:
    doc: str
    line: int            # 1-based line of the opening fence
    lang: str
    kind: str | None     # run, excerpt, skip; None: no marker
    arg: str
    body: list[str]

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(doc: str) -> list[Block]:
    lines = (ROOT / doc).read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if m:
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            mark = MARKER.match(lines[i - 1]) if i else None
            out.append(Block(doc, i + 1, m.group(1), mark.group(1) if mark else None,
                             mark.group(2) if mark else "", lines[i + 1:j]))
            i = j
        i += 1
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]
RUN = [b for b in ALL if b.kind == "run"]


def test_every_output_block_is_marked() -> None:
    """Plain and console blocks show output: each is checked, or says why not."""
    unmarked = [b.where for b in ALL if b.lang in ("", "console") and b.kind is None]
    assert not unmarked, f"output blocks without a <!-- doc-check: ... --> marker: {unmarked}"
    for b in ALL:
        if b.kind == "skip":
            assert len(b.arg) > 20, f"{b.where}: a skip needs its reason"


@pytest.mark.parametrize("block", [b for b in ALL if b.kind == "excerpt"], ids=lambda b: b.where)
def test_excerpt_is_in_its_file(block: Block) -> None:
    text = (ROOT / block.arg).read_text()
    assert "\n".join(block.body) in text, f"{block.where}: not (any more) a part of {block.arg}"


# -- links --------------------------------------------------------------------------------------

# Every markdown file of the project but those of dependencies and tools' caches.
MARKDOWN = sorted(p for p in ROOT.rglob("*.md")
                  if not any(part.startswith(".") or part == "node_modules" for part in p.relative_to(ROOT).parts))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes of a file's headings: lower case, punctuation but '-' and '_'
    dropped, spaces as '-'; a repeated one gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().split("\n"):
        if line.startswith("```"):
            in_code = not in_code
        m = re.match(r"^#{1,6} (.*)", line)
        if m and not in_code:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(doc: Path) -> None:
    """Relative links lead to a file of the checkout, and an anchor to a heading of it."""
    broken = []
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)   # not inside code blocks
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


# -- comparing ----------------------------------------------------------------------------------

_VOLATILE = [
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"), "<uuid>"),
    (re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(:\d\d(\.\d+)?)?([+-]\d\d(:\d\d)?)?"), "<time>"),
    (re.compile(r"<time>,\d+"), "<time>"),                                   # log lines' milliseconds
    (re.compile(r"\b\d+ days? \d\d:\d\d:\d\d(\.\d+)?|\b\d\d:\d\d:\d\d(\.\d+)?"), "<interval>"),
    (re.compile(r"\b\d+(\.\d+)? (ms|s|min|h)\b"), "<age>"),
    (re.compile(r"_p\d{8}T\d{6}"), "_p<date>"),
    (re.compile(r"(127\.0\.0\.1|localhost)(:|, port |\", port )\d+"), r"\1\2<port>"),
    (re.compile(r"\bpid \d+"), "pid <pid>"),
    (re.compile(r"pg_terminate_backend\(\d+\)"), "pg_terminate_backend(<pid>)"),
    (re.compile(r'"port":\d+'), '"port":<port>'),
    (re.compile(r"\b\d+(\.\d+)?ms\b"), "<age>"),
    (re.compile(r'"(checked_at|last_claim_at|dead_at|created_at)":"[^"]*"'), r'"\1":"<time>"'),
    (re.compile(r'"(\w+_seconds)":[0-9.]+'), r'"\1":<seconds>'),
    (re.compile(r'"(\w*pid)":\d+'), r'"\1":<pid>'),
    (re.compile(r"\b(\w+_ms)=[0-9.]+"), r"\1=<ms>"),
    (re.compile(r"\(default: [\w.-]+:\d+\)"), "(default: <host>:<pid>)"),   # outboxpg-worker --name
]


def normalise(text: str) -> list[str]:
    out = []
    for line in text.rstrip("\n").split("\n"):
        for pattern, repl in _VOLATILE:
            line = pattern.sub(repl, line)
        line = re.sub(r"-{2,}", "--", line)      # psql's and the CLI's rules follow the widest value
        line = re.sub(r"\s+", " ", line).strip()
        out.append(line)
    return out


def matches(expected: list[str], actual: list[str]) -> bool:
    """Line by line; a line '...' stands for any number of lines."""
    pattern = "".join(r"(?:[^\n]*\n)*?" if e == "..." else re.escape(e) + r"\n" for e in expected)
    return re.fullmatch(pattern, "".join(a + "\n" for a in actual)) is not None


# -- scenarios ----------------------------------------------------------------------------------

@dataclass
class Env:
    dsn: str
    dbname: str
    pg: Any
    nats_url: str
    tmp: Path
    more: list[DatabaseJanitor]   # further databases of the scenario, <dbname>_<suffix>
    cleanups: list[Callable[[], None]]   # run after the block, newest first

    def own_nats(self) -> str:
        """A nats-server of the scenario's own (its streams and subjects collide with nobody's):
        its URL replaces the docs' nats://127.0.0.1:4222."""
        server = EmbeddedNats().start()
        self.cleanups.append(lambda: server.stop(remove=True))
        self.nats_url = server.url
        return server.url

    def database(self, suffix: str) -> str:
        """Another database for the scenario: <dbname>_<suffix> (shown as <suffix> in the output)."""
        janitor = DatabaseJanitor(user=self.pg.user, host=self.pg.host, port=self.pg.port,
                                  password=self.pg.password, dbname=f"{self.dbname}_{suffix}")
        janitor.init()
        self.more.append(janitor)
        return make_conninfo(self.dsn, dbname=f"{self.dbname}_{suffix}")


# Everywhere: the docs' database `shop` is the scenario's own.
GLOBAL_SUBSTITUTIONS = {"-d shop": "-d {PGDATABASE}", "dbname=shop": "dbname={PGDATABASE}"}

Scenario = Callable[[Env], None]
SCENARIOS: dict[str, Scenario] = {}
# What the docs write where a reader has their own values: doc text -> the test's.
SUBSTITUTIONS: dict[str, Callable[[Env], dict[str, str]]] = {}


def scenario(name: str, subs: Callable[[Env], dict[str, str]] | None = None) -> Callable[[Scenario], Scenario]:
    def register(f: Scenario) -> Scenario:
        SCENARIOS[name] = f
        if subs:
            SUBSTITUTIONS[name] = subs
        return f
    return register


def connect(env: Env) -> psycopg.Connection[Any]:
    return psycopg.connect(env.dsn, autocommit=True)


@scenario("blank")
def _blank(env: Env) -> None:
    """A database without the outbox schema (docs/how-to/install.md: psql, then --adopt)."""


@scenario("demo")
def _demo(env: Env) -> None:
    """README's bin/demo: it starts servers of its own; the scenario's database is not used."""


def _own_nats(env: Env) -> dict[str, str]:
    return {"nats://127.0.0.1:4222": env.nats_url}


@scenario("app", _own_nats)
def _app(env: Env) -> None:
    """README "Use it in your app" and docs/tutorial.md: a database without the schema, and a
    nats-server of the scenario's own (the docs' stream OUTBOX on outbox.> collides with nobody's)."""
    env.own_nats()


# docs/tutorial.md: each step starts where the one before it left the database.
TUTORIAL_EVENTS = ("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES "
                   """('order', 'o-1', 'created', '{"total": 42}'), ('order', 'o-2', 'created', '{"total": 7}'), """
                   """('order', 'o-1', 'paid', '{"amount": 42}')""")
SCENARIOS["tutorial"] = _app
SUBSTITUTIONS["tutorial"] = _own_nats


@scenario("tutorial-migrated", _own_nats)
def _tutorial_migrated(env: Env) -> None:
    """docs/tutorial.md after step 1: the schema installed."""
    env.own_nats()
    _migrate(env)


@scenario("tutorial-written", _own_nats)
def _tutorial_written(env: Env) -> None:
    """docs/tutorial.md after step 2: its three events written."""
    _tutorial_migrated(env)
    with connect(env) as c:
        c.execute(TUTORIAL_EVENTS)


@scenario("tutorial-delivered", _own_nats)
def _tutorial_delivered(env: Env) -> None:
    """docs/tutorial.md after step 3: its three events delivered into the stream OUTBOX."""
    _tutorial_written(env)
    with connect(env) as c:
        def delivered() -> bool:
            return c.execute("SELECT count(*) FROM outbox WHERE state = 'published'").fetchone() == (3,)
        asyncio.run(_deliver(env, "outbox", delivered, keep_stream=True))


@scenario("producer-login", lambda env: {"user=app": "user={PGDATABASE}_app"})
def _producer_login(env: Env) -> None:
    """docs/how-to/operate.md "The wrong login": a login `app` (shown so: its real name is
    <dbname>_app) that is a member of outbox_producer only."""
    _migrate(env)
    with connect(env) as c:
        c.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE outbox_producer").format(sql.Identifier(f"{env.dbname}_app")))


@scenario("empty")
def _empty(env: Env) -> None:
    """The outbox schema installed, no event yet (scheduling, idempotent enqueue, a worker by hand, the settings row)."""
    _migrate(env)


@scenario("node-example", lambda env: {
    "cd examples/node && npm ci --silent": f"cd {env.tmp / 'node'} && npm ci --silent --prefer-offline",
    "postgresql://relay@db/shop": "postgresql://{PGUSER}@{PGHOST}:{PGPORT}/{PGDATABASE}"})
def _node_example(env: Env) -> None:
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the Node.js example (examples/node) cannot run")
    shutil.copytree(ROOT / "examples" / "node", env.tmp / "node", ignore=shutil.ignore_patterns("node_modules"))
    _migrate(env)


def _migrate(env: Env) -> None:
    schema.migrate(env.dsn)


def _insert(c: psycopg.Connection[Any], aggregate_type: str, aggregate_id: str, event_type: str,
            payload: str = "{}", headers: str | None = None, subject: str | None = None) -> int:
    return c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, subject) "
                     "VALUES (%s, %s, %s, %s, coalesce(%s::jsonb, '{}'), %s) RETURNING id",
                     (aggregate_type, aggregate_id, event_type, payload, headers, subject)).fetchone()[0]


async def _deliver(env: Env, prefix: str, until: Callable[[], bool], keep_stream: bool = False,
                   **publisher_options: Any) -> None:
    """A real worker (worker-a:4711, NATS publisher) until ``until()``; the stream (named
    ``prefix.upper()``) is deleted afterwards unless ``keep_stream``."""
    from outboxpg.relay.nats.publisher import NatsPublisher
    from outboxpg.relay.nats.streams import ensure_stream
    from outboxpg.relay.worker import Worker, WorkerConfig

    publisher = NatsPublisher(env.nats_url, ack_timeout=5, **publisher_options)
    await publisher.start()
    try:
        await ensure_stream(publisher.js, prefix.upper(), [f"{prefix}.>"], timedelta(minutes=10))
        worker = Worker(WorkerConfig(dsn=env.dsn, name="worker-a:4711", poll_interval=0.2, publish_timeout=5,
                                     lease=30, maintenance_interval=0), publisher)
        task = asyncio.create_task(worker.run())
        end = time.monotonic() + 30
        while not until():
            assert time.monotonic() < end and not task.done(), "the worker did not deliver in time"
            await asyncio.sleep(0.05)
        worker.stop()
        await task   # the worker closes its publisher
    finally:
        await publisher.close()
    if keep_stream:
        return
    import nats
    nc = await nats.connect(env.nats_url)
    try:
        await nc.jetstream().delete_stream(prefix.upper())
    finally:
        await nc.close()


@scenario("shop")
def _shop(env: Env) -> None:
    """docs/how-to/operate.md and dead-letters.md, the database "shop": 120 orders delivered by a worker (worker-a:4711); three events
    it dead-lettered (two payloads over NATS max_payload, written while max_event_bytes was set
    above it; one header block over JetStream's 64 KiB); an order event held back behind a dead
    one; one retry after a timeout; three events leased by worker-b:5120."""
    _migrate(env)
    prefix = f"shop{uuid.uuid4().hex[:8]}"
    with connect(env) as c:
        c.execute("UPDATE outbox_settings SET subject_prefix = %s", (prefix,))
        # Above NATS' max_payload (1 MiB): the two label PDFs get in, and die at the worker.
        c.execute("UPDATE outbox_settings SET max_event_bytes = 4000000")
        c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                  "SELECT 'order', 'o-' || n, 'created', jsonb_build_object('order', 'o-' || n) "
                  "FROM generate_series(1, 120) n")
        pdf = "JVBERi0xLjQK" + "A" * 1_310_000
        _insert(c, "order", "o-1007", "shipped", f'{{"order": "o-1007", "carrier": "dhl", "label_pdf": "{pdf}"}}',
                '{"Trace-Id": "4bf92f3577b34da6"}')
        _insert(c, "order", "o-1012", "shipped", f'{{"order": "o-1012", "carrier": "ups", "label_pdf": "{pdf * 2}"}}')
        _insert(c, "customer", "c-88", "merged", '{"into": "c-12"}', '{"Merge-Trail": "%s"}' % ("c-1," * 22_000))

        def settled() -> bool:
            return c.execute("SELECT count(*) FROM outbox WHERE state IN ('published', 'dead')").fetchone() == (123,)
        asyncio.run(_deliver(env, prefix, settled))
        # Its retry a minute away, whenever the commands run (the default backoff: 0.5 to 1 s).
        c.execute("UPDATE outbox_settings SET subject_prefix = DEFAULT, backoff_base = '1 minute', "
                  "max_event_bytes = DEFAULT")
        _insert(c, "order", "o-1007", "delivered", '{"order": "o-1007"}')            # 124: behind 121
        retry = _insert(c, "order", "o-2001", "created", '{"order": "o-2001"}')       # 125
        (token,) = c.execute("SELECT DISTINCT lease_token FROM outbox_claim(10, '30 s', 'worker-a:4711')").fetchone()
        c.execute("SELECT outbox_fail(%s, %s, 'TimeoutError: no ack from JetStream within 10s')", (retry, token))
        for n in range(300, 303):
            _insert(c, "order", f"o-{n}", "created", f'{{"order": "o-{n}"}}')           # 126-128
        c.execute("SELECT * FROM outbox_claim(10, '5 minutes', 'worker-b:5120')")


@scenario("held")
def _held(env: Env) -> None:
    """docs/how-to/operate.md, a producing transaction left open: 120 events of 40 orders (o-1 to
    o-40) committed; a session named billing-import inserted an event of o-7 and one of o-12 and
    stays idle in its transaction; then 120 more events of the 40 orders committed, and a worker
    (relay-1) delivered all it could: everything but the 6 newer events of o-7 and o-12."""
    _migrate(env)
    many = ("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
            "SELECT 'order', 'o-' || (n %% 40 + 1), 'updated', jsonb_build_object('n', n) FROM generate_series(%s::int, %s::int) n")
    with connect(env) as c:
        c.execute(many, (1, 120))
    held = psycopg.connect(env.dsn, application_name="billing-import")   # a transaction stays open
    env.cleanups.append(held.close)
    held.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                 "VALUES ('order', 'o-7', 'imported', '{}'), ('order', 'o-12', 'imported', '{}')")
    with connect(env) as c:
        c.execute(many, (121, 240))
        while rows := c.execute("SELECT id, lease_token FROM outbox_claim(500, NULL, 'relay-1')").fetchall():
            c.execute("SELECT outbox_complete(%s, %s)", ([i for i, _ in rows], rows[0][1]))


@scenario("xmin")
def _xmin(env: Env) -> None:
    """docs/how-to/operate.md, a held snapshot: a session named nightly-report in a REPEATABLE READ
    transaction, idle since its query, for more than a second."""
    _migrate(env)
    with connect(env) as c:
        c.execute("CREATE TABLE orders (id text PRIMARY KEY, total numeric NOT NULL)")
    report = psycopg.connect(env.dsn, application_name="nightly-report")
    env.cleanups.append(report.close)
    report.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    report.execute("SELECT sum(total) FROM orders")
    time.sleep(1.5)


# docs/how-to/publish.md, CloudEvents: the stream and subject prefix of the scenario's own.
CE_PREFIX = f"ce{uuid.uuid4().hex[:8]}"


@scenario("cloudevents", lambda env: {"nats://nats:4222": env.nats_url, "--stream OUTBOX": f"--stream {CE_PREFIX.upper()}",
                                       "outbox.order.paid": f"{CE_PREFIX}.order.paid"})
def _cloudevents(env: Env) -> None:
    """docs/how-to/publish.md, CloudEvents: the page's INSERT with a traceparent, delivered
    by a worker with --cloudevents --cloudevents-source https://shop.example/orders."""
    from outboxpg.cloudevents import CloudEvents

    _migrate(env)
    with connect(env) as c:
        c.execute("UPDATE outbox_settings SET subject_prefix = %s", (CE_PREFIX,))
        c.execute("""INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
                     VALUES ('order', 'o-17', 'paid', '{"amount": 42}',
                             '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}')""")

        def delivered() -> bool:
            return c.execute("SELECT count(*) FROM outbox WHERE state = 'published'").fetchone() == (1,)
        asyncio.run(_deliver(env, CE_PREFIX, delivered, keep_stream=True,
                             cloudevents=CloudEvents("https://shop.example/orders")))


@scenario("errors", lambda env: {"dbname=blank": "dbname={PGDATABASE}_blank",
                                  "dbname=older": "dbname={PGDATABASE}_older"})
def _errors(env: Env) -> None:
    """A database without the schema (blank) and one three steps behind (older)."""
    env.database("blank")
    older = env.database("older")
    schema.migrate(older)
    schema.rollback(older, 3)


@scenario("tenants", lambda env: {"dbname=billing": "dbname={PGDATABASE}_billing"})
def _tenants(env: Env) -> None:
    """docs/how-to/many-databases.md: two migrated databases, shop and billing, two events
    waiting in billing."""
    _migrate(env)
    billing = env.database("billing")
    schema.migrate(billing)
    with psycopg.connect(billing, autocommit=True) as c:
        _insert(c, "invoice", "i-4", "issued")
        _insert(c, "invoice", "i-5", "issued")


NO_STREAM = "RuntimeError: no JetStream stream captures this subject (no responders)"


@scenario("invoices")
def _invoices(env: Env) -> None:
    """docs/how-to/operate.md "Events failing right now": 40 orders delivered; three invoices with a
    subject of their own (billing.*, allowed to producers) that no stream captures, failed 5 or 6
    times; a 1.3 MB order (written while max_event_bytes was raised) dead-lettered for its size
    (the reasons as the worker records them)."""
    _migrate(env)
    with connect(env) as c:
        c.execute("UPDATE outbox_settings SET allowed_subject_prefixes = '{billing}', max_event_bytes = 2000000")
        c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                  "SELECT 'order', 'o-' || n, 'created', jsonb_build_object('order', 'o-' || n) "
                  "FROM generate_series(1, 40) n")
        (token,) = c.execute("SELECT DISTINCT lease_token FROM outbox_claim(100, NULL, 'relay-1')").fetchone()
        c.execute("SELECT outbox_complete(array_agg(id), %s) FROM outbox", (token,))
        invoices = [_insert(c, "invoice", f"i-{n}", "issued", f'{{"invoice": "i-{n}"}}',
                            subject="billing.invoice.issued") for n in range(3)]
        big = _insert(c, "order", "o-big", "created", '{"blob": "%s"}' % ("x" * 1_300_000))
        for attempt in range(6):
            # Skip the backoff (the heads recomputed as the report functions do).
            c.execute("WITH due AS (UPDATE outbox SET next_attempt_at = clock_timestamp() WHERE id = ANY(%s) "
                      "RETURNING aggregate_type, aggregate_id) "
                      "SELECT outbox_refresh_heads(array_agg(aggregate_type), array_agg(aggregate_id)) FROM due",
                      (invoices,))
            rows = c.execute("SELECT id, lease_token FROM outbox_claim(10, NULL, 'relay-1')").fetchall()
            for i, t in rows:
                if i == big:
                    c.execute("SELECT outbox_fail(%s, %s, %s, true)", (i, t, (
                        "PermanentError: message of 1300195 bytes (payload 1300012, headers 183) exceeds the "
                        "NATS server's max_payload of 1048576")))
                elif i != invoices[0] or attempt < 5:   # the first invoice once less
                    c.execute("SELECT outbox_fail(%s, %s, %s)", (i, t, NO_STREAM))
                else:
                    c.execute("SELECT outbox_release(ARRAY[%s]::bigint[], %s)", (i, t))


# -- running a block ----------------------------------------------------------------------------

@dataclass
class Step:
    command: str
    expected: list[str]     # as in the doc
    exit_code: int | None   # when the doc shows "(exit code N)"


def steps(block: Block) -> list[Step]:
    if ":" in block.arg:   # output-only: the command is in the marker
        command = block.arg.split(":", 1)[1].strip()
        return [Step(command, block.body, None)]
    out: list[Step] = []
    i = 0
    body = block.body
    while i < len(body):
        line = body[i]
        assert line.startswith("$ "), f"{block.where}: output before the first command: {line!r}"
        command = line[2:]
        while command.rstrip().endswith("\\"):
            i += 1
            command = command.rstrip()[:-1] + " " + body[i].strip()
        i += 1
        expected = []
        while i < len(body) and not body[i].startswith("$ "):
            expected.append(body[i])
            i += 1
        code = None
        if expected and re.fullmatch(r"\(exit code \d+\)", expected[-1]):
            code = int(expected[-1][11:-1])
        out.append(Step(re.sub(r"\s+#[^\"']*$", "", command), expected, code))
    return out


def run_steps(block: Block, env: Env, shell_env: dict[str, str]) -> list[tuple[str, int]]:
    """Run the block's commands in one bash session; each one's output (stdout and stderr) and exit code."""
    subs = {**SUBSTITUTIONS.get(block.arg.split(":", 1)[0].strip(), lambda e: {})(env), **GLOBAL_SUBSTITUTIONS}
    script = []
    for step in steps(block):
        command = step.command
        for doc_text, test_text in subs.items():
            command = command.replace(doc_text, test_text.format(**shell_env))
        script.append(f"{{ {command}\n}} 2>&1 < /dev/null; printf '\\n{SEP} %s\\n' $?")
    r = subprocess.run(["bash", "-c", "\n".join(script)], cwd=ROOT, capture_output=True, text=True,
                       env=shell_env, timeout=300)
    parts = r.stdout.split(f"{SEP} ")
    results = []
    output = parts[0]
    for part in parts[1:]:
        code, _, rest = part.partition("\n")
        # The printf's newline, then the output's own last one.
        results.append((output.removesuffix("\n").removesuffix("\n"), int(code)))
        output = rest
    assert len(results) == len(script), (r.stdout, r.stderr)
    return results


@pytest.fixture
def doc_env(pg_server: Any, nats_server: EmbeddedNats, tmp_path: Path) -> Iterator[Env]:
    name = f"docs_{uuid.uuid4().hex[:8]}"
    janitor = DatabaseJanitor(user=pg_server.user, host=pg_server.host, port=pg_server.port,
                              password=pg_server.password, dbname=name)
    with janitor:
        dsn = make_conninfo(host=pg_server.host, port=pg_server.port, user=pg_server.user, dbname=name,
                            password=pg_server.password)
        env = Env(dsn, name, pg_server, nats_server.url, tmp_path, [], [])
        try:
            yield env
        finally:
            for cleanup in reversed(env.cleanups):
                cleanup()
            for more in env.more:
                more.drop()
        # Roles a scenario made are cluster-wide: theirs to drop (scenarios name them <dbname>_*).
        with psycopg.connect(dsn, autocommit=True) as c:
            for (role,) in c.execute("SELECT rolname FROM pg_roles WHERE rolname LIKE %s",
                                     (name.replace("_", "\\_") + "\\_%",)).fetchall():
                c.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                c.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.mark.parametrize("block", RUN, ids=lambda b: f"{b.where}-{b.arg.split(':')[0]}")
def test_commands_print_what_the_docs_show(block: Block, doc_env: Env) -> None:
    name = block.arg.split(":", 1)[0].strip()
    assert name in SCENARIOS, f"{block.where}: no scenario {name!r} in tests/product/test_docs.py"
    SCENARIOS[name](doc_env)
    pg = doc_env.pg
    venv_bin = str(Path(sys.executable).parent)
    shell_env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "OUTBOXPG_"))}
    shell_env.update(PATH=f"{venv_bin}:{os.environ['PATH']}", PGHOST=pg.host, PGPORT=str(pg.port), PGUSER=pg.user,
                     PGDATABASE=doc_env.dbname, DSN=doc_env.dsn, OUTBOXPG_DSN=doc_env.dsn,
                     COLUMNS="200", NO_COLOR="1")
    if pg.password:
        shell_env["PGPASSWORD"] = pg.password
    results = run_steps(block, doc_env, shell_env)
    problems, new_body = [], []
    for step, (output, code) in zip(steps(block), results):
        actual_text = re.sub(re.escape(doc_env.dbname) + r"_(\w+)", r"\1", output).replace(doc_env.dbname, "shop")
        # Paths of this checkout (bin/demo names its nats-server binary) as a reader's would be.
        actual_text = actual_text.replace(VENV, "/path/to/outboxpg/.venv").replace(str(ROOT), "/path/to/outboxpg")
        expected = [e for e in step.expected if not re.fullmatch(r"\(exit code \d+\)", e)]
        if step.exit_code is not None and code != step.exit_code:
            problems.append(f"$ {step.command}\n  exit code {code}, the doc says {step.exit_code}")
        if not matches(normalise("\n".join(expected)) if expected else [""], normalise(actual_text)):
            problems.append(f"$ {step.command}\n--- the doc shows\n" + "\n".join(expected)
                            + "\n--- it prints now\n" + actual_text)
        new_body += ([f"$ {step.command}"] if ":" not in block.arg else []) + \
            (abridged([line.rstrip() for line in actual_text.split("\n")], expected) if actual_text else []) + \
            ([f"(exit code {code})"] if step.exit_code is not None else [])
    if UPDATE and (problems or any(line != line.rstrip() for line in block.body)):
        _rewrite(block, new_body)
    assert not problems, f"{block.where} drifted:\n\n" + "\n\n".join(problems)


def abridged(actual: list[str], expected: list[str]) -> list[str]:
    """``actual`` cut as the doc cut the output it showed: as many first and last lines as the doc
    had before its first and after its last ``...`` line, and one ``...`` between them."""
    if "..." not in expected:
        return actual
    head = expected.index("...")
    tail = len(expected) - 1 - max(i for i, line in enumerate(expected) if line == "...")
    if head + tail >= len(actual):
        return actual
    return actual[:head] + ["..."] + (actual[len(actual) - tail:] if tail else [])


def _rewrite(block: Block, body: list[str]) -> None:
    """Put ``body`` in place of the block (found again by its marker and old body: earlier
    rewrites may have moved it)."""
    path = ROOT / block.doc
    lines = path.read_text().split("\n")
    for i in range(1, len(lines)):
        if lines[i].startswith("```") and MARKER.match(lines[i - 1]) and \
                lines[i + 1:i + 1 + len(block.body)] == block.body and lines[i + 1 + len(block.body)].startswith("```"):
            lines[i + 1:i + 1 + len(block.body)] = body
            path.write_text("\n".join(lines))
            return
    raise AssertionError(f"{block.where}: cannot find the block to rewrite")
