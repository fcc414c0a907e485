"""Hostile input (issue 5), property-based: arbitrary values through the producer helpers
(enqueue / enqueue_many, sync and async) and the SQL functions, against a real PostgreSQL.

The property, for every generated case: either the event is stored, and claim hands back
exactly what was written and complete takes it; or the call fails with a clear error (one of
a few exception classes, naming the constraint, the field or the function), and nothing of
it is left behind: a neighbour written earlier in the same transaction survives when the
failed call ran in a savepoint, a neighbour written concurrently in another transaction is
always delivered, and the table holds exactly the events that should be there.

Which cases must be taken and which refused is predicted by tests/hostile.py (see its
docstring for what it leaves open). Examples are bounded; under CI=true they are derandomized
(conftest.py), so a failure there is the same on every run.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import hypothesis
import psycopg
import pytest
from hostile import CONSTRAINTS, INJECTIONS, SETTINGS_REFUSALS, Spec, hostile_text, same_json, specs, verdict
from hypothesis import example, given, settings
from hypothesis import strategies as st
from psycopg import errors
from psycopg.rows import dict_row

from outboxpg import Event, enqueue, enqueue_many
from outboxpg.producer import encode_payload

# OUTBOXPG_HYPOTHESIS_SCALE=20 runs twenty times the examples (a longer hunt; not for CI).
SCALE = float(os.environ.get("OUTBOXPG_HYPOTHESIS_SCALE", "1"))
Conn = psycopg.Connection[Any]
AConn = psycopg.AsyncConnection[Any]

# Everything the outbox may answer a bad value with. Anything else (an AttributeError, an
# AssertionError, a broken connection) fails the test.
CLEAR_ERRORS = (TypeError, ValueError, errors.IntegrityError, errors.DataError, errors.ProgramLimitExceeded,
                errors.StatementTooComplex)   # JSON nested deeper than max_stack_depth allows

NEIGHBOUR_SAME_TX = ("neighbour", "same-tx")
NEIGHBOUR_OTHER_TX = ("neighbour", "other-tx")
NEIGHBOURS_IN_BATCH = [("neighbour", "batch-before"), ("neighbour", "batch-after")]

CLAIM = ("SELECT id, subject, aggregate_type, aggregate_id, event_type, payload::text AS payload, headers, msg_id, "
         "lease_token FROM outbox_claim(1000, '1 minute', 'hostile-test')")


# -- fixtures ---------------------------------------------------------------------------------

@pytest.fixture
def tx(dsn: str) -> Iterator[Conn]:
    with psycopg.connect(dsn) as c:
        yield c


@pytest.fixture
def other(dsn: str) -> Iterator[Conn]:
    with psycopg.connect(dsn) as c:
        yield c


@pytest.fixture
async def atx(dsn: str) -> AsyncIterator[AConn]:
    async with await psycopg.AsyncConnection.connect(dsn) as c:
        yield c


def reset(conn: Conn) -> None:
    conn.execute("DELETE FROM outbox")


# -- checking one case ---------------------------------------------------------------------------

def check_error(exc: BaseException, spec: Spec) -> None:
    assert isinstance(exc, CLEAR_ERRORS), f"unexpected {type(exc).__name__}: {exc!r} for {spec!r}"
    text = str(exc).strip()
    assert text, f"{type(exc).__name__} without a message"
    if isinstance(exc, errors.CheckViolation) and exc.diag.constraint_name is None:
        # The insert trigger's checks against outbox_settings: the message names the setting.
        assert text.startswith("outbox: ") and any(name in text for name in SETTINGS_REFUSALS), text
    elif isinstance(exc, errors.CheckViolation):
        assert exc.diag.constraint_name in CONSTRAINTS, exc.diag.constraint_name
        assert exc.diag.constraint_name in text
    if isinstance(exc, errors.NotNullViolation):
        assert exc.diag.column_name in text


def written(spec: Spec) -> dict[str, Any]:
    """What the helper sends for ``spec`` (keys as text, the payload as JSON text)."""
    return {"aggregate_type": str(spec.aggregate_type), "aggregate_id": str(spec.aggregate_id),
            "event_type": str(spec.event_type), "payload": encode_payload(spec.payload)}


def check_case(conn: Conn, spec: Spec, error: BaseException | None, kept_same_tx: bool,
               batch: bool = False) -> None:
    """After the producing transactions ended: what must be in the outbox, delivered exactly."""
    v = verdict(spec)
    hypothesis.event("stored" if error is None else f"refused: {type(error).__name__}")
    hypothesis.event(f"model: {v.outcome}")
    if error is not None:
        check_error(error, spec)
        assert v.outcome != "stored", f"refused although valid: {error!r}"
    else:
        assert v.outcome != "refused", f"stored although it should be refused ({v.refused}): {spec!r}"
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(CLAIM).fetchall()
    def is_neighbour(r: dict[str, Any]) -> bool:
        return r["aggregate_type"] == "neighbour" and r["event_type"] == "neighbour"

    by_key = {(r["aggregate_type"], r["aggregate_id"]): r for r in rows if is_neighbour(r)}
    hostile = [r for r in rows if not is_neighbour(r)]
    expected_neighbours = {NEIGHBOUR_OTHER_TX}
    if kept_same_tx:
        expected_neighbours.add(NEIGHBOUR_SAME_TX)
    if batch and error is None:
        expected_neighbours.update(NEIGHBOURS_IN_BATCH)
    assert set(by_key) == expected_neighbours, "a neighbour was lost, or a failed batch left some of its rows"
    for key, r in by_key.items():
        assert r["payload"] == f'{{"n": "{key[1]}"}}' and r["event_type"] == "neighbour"
    if error is None:
        assert len(hostile) == 1, "the stored event was not claimed"
        (h,) = hostile
        w = written(spec)
        for name in ("aggregate_type", "aggregate_id", "event_type"):
            assert h[name] == w[name], name
        assert same_json(w["payload"], h["payload"])
        assert h["subject"] == (spec.subject if spec.subject is not None
                                else f"outbox.{w['aggregate_type']}.{w['event_type']}")
        assert h["headers"] == (spec.headers or {})
        if spec.msg_id is None:
            uuid.UUID(h["msg_id"])
        else:
            assert h["msg_id"] == spec.msg_id
    else:
        assert hostile == [], "a refused event was stored"
    tokens = {r["lease_token"] for r in rows}
    assert len(tokens) == 1
    assert conn.execute("SELECT outbox_complete(%s, %s)", ([r["id"] for r in rows], tokens.pop())).fetchone() \
        == (len(rows),)
    # Nothing else in the table: nothing half-written.
    assert conn.execute("SELECT count(*), count(*) FILTER (WHERE state = 'published') FROM outbox").fetchone() \
        == (len(rows), len(rows))


def neighbour(key: tuple[str, str]) -> Event:
    return Event(key[0], key[1], "neighbour", {"n": key[1]})


def as_event(spec: Spec) -> Event:
    return Event(spec.aggregate_type, spec.aggregate_id, spec.event_type, spec.payload, spec.subject,
                 spec.headers, spec.msg_id)


def produce_sync(tx: Conn, other: Conn, spec: Spec, savepoint: bool, batch: bool) -> BaseException | None:
    """Neighbours around the hostile call; returns its error. Ends both transactions."""
    enqueue_many(other, [neighbour(NEIGHBOUR_OTHER_TX)])      # open, concurrently, in another transaction
    enqueue(tx, *NEIGHBOUR_SAME_TX, "neighbour", {"n": NEIGHBOUR_SAME_TX[1]})

    def call() -> None:
        if batch:
            before, after = (neighbour(k) for k in NEIGHBOURS_IN_BATCH)
            enqueue_many(tx, [before, as_event(spec), after])
        else:
            enqueue(tx, spec.aggregate_type, spec.aggregate_id, spec.event_type, spec.payload, **spec.kwargs())

    error = None
    try:
        if savepoint:
            with tx.transaction():
                call()
        else:
            call()
    except Exception as exc:  # noqa: BLE001 - judged by check_case
        error = exc
    if error is not None and not savepoint:
        tx.rollback()    # what an application does when a statement of its transaction failed
    else:
        tx.commit()
    other.commit()
    return error


async def produce_async(atx: AConn, other: Conn, spec: Spec, savepoint: bool, batch: bool) -> BaseException | None:
    enqueue_many(other, [neighbour(NEIGHBOUR_OTHER_TX)])
    await enqueue(atx, *NEIGHBOUR_SAME_TX, "neighbour", {"n": NEIGHBOUR_SAME_TX[1]})

    async def call() -> None:
        if batch:
            before, after = (neighbour(k) for k in NEIGHBOURS_IN_BATCH)
            await enqueue_many(atx, [before, as_event(spec), after])
        else:
            await enqueue(atx, spec.aggregate_type, spec.aggregate_id, spec.event_type, spec.payload,
                          **spec.kwargs())

    error = None
    try:
        if savepoint:
            async with atx.transaction():
                await call()
        else:
            await call()
    except Exception as exc:  # noqa: BLE001 - judged by check_case
        error = exc
    if error is not None and not savepoint:
        await atx.rollback()
    else:
        await atx.commit()
    other.commit()
    return error


# -- the properties: producer helpers -----------------------------------------------------------

KNOWN = [  # cases worth running on every run, whatever hypothesis draws
    Spec("order", "1", "created", {"x": "\x00"}),
    Spec("order", "\x00", "created", {}),
    Spec("order", "\ud800", "created", {}),
    Spec(None, "1", "created", {}),
    Spec("order", b"1", "created", {}),
    Spec("order", "1", "created", b"\xff\xfe"),
    Spec("order", "1", "created", b"[" * 100_000 + b"]" * 100_000),
    Spec("order", "1", "created", {"blob": "x" * 2_000_000}),
    Spec("\u05d0\u05d1", "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\u202eevil", {"\u2028": "\ufeff"},
         headers={"X-Rtl": "\u202e\u0627\u0644"}, msg_id="\U0010ffff"),
    Spec("order", "1", "created", {}, subject="a\u00a0b.c"),
    Spec("order", "1", "created", {}, subject="outbox.a\u00a0b.c"),
    Spec("order", "1", "created", {}, headers={"k\u00a0": "v"}),
    Spec("order", "1", "created", {}, subject="$JS.API.STREAM.PURGE.ORDERS"),
    Spec("order", "x" * 1024, "e" * 255, {}, msg_id="m" * 255),
    Spec("order", "\u00e9" * 513, "created", {}),
    Spec("order", "1", "created", "NaN"),
    Spec("order", "1", "created", {"f": float("nan"), "big": 1e300, "tiny": 5e-324}),
]


def _with_known(fn: Any) -> Any:
    for spec in KNOWN:
        fn = example(spec=spec, savepoint=True)(fn)
    return fn


@settings(max_examples=int(100 * SCALE))
@_with_known
@given(spec=specs(), savepoint=st.booleans())
def test_enqueue_stores_exactly_or_refuses_cleanly(conn: Conn, tx: Conn, other: Conn, spec: Spec,
                                                   savepoint: bool) -> None:
    reset(conn)
    error = produce_sync(tx, other, spec, savepoint, batch=False)
    check_case(conn, spec, error, kept_same_tx=error is None or savepoint)


@settings(max_examples=int(60 * SCALE))
@_with_known
@given(spec=specs(), savepoint=st.booleans())
def test_enqueue_many_stores_the_whole_batch_or_nothing(conn: Conn, tx: Conn, other: Conn, spec: Spec,
                                                        savepoint: bool) -> None:
    reset(conn)
    error = produce_sync(tx, other, spec, savepoint, batch=True)
    check_case(conn, spec, error, kept_same_tx=error is None or savepoint, batch=True)


# Async: hypothesis drives a sync test; each example runs its coroutine on a loop of its own.

@settings(max_examples=int(50 * SCALE))
@given(spec=specs(), savepoint=st.booleans(), batch=st.booleans())
def test_async_helpers_store_exactly_or_refuse_cleanly(conn: Conn, dsn: str, other: Conn, spec: Spec,
                                                       savepoint: bool, batch: bool) -> None:
    reset(conn)

    async def case() -> BaseException | None:
        async with await psycopg.AsyncConnection.connect(dsn) as atx:
            return await produce_async(atx, other, spec, savepoint, batch)

    error = asyncio.run(case())
    check_case(conn, spec, error, kept_same_tx=error is None or savepoint, batch=batch)


# -- the properties: SQL functions ------------------------------------------------------------

# Raised by the function itself (named: "outbox_claim: ..."), or by PostgreSQL turning an argument
# into its type (class 22: out of range, not a uuid, not an interval), or by psycopg before sending
# (NUL in a text, a lone surrogate).
ALLOWED_FUNCTION_ERRORS = (errors.InvalidParameterValue, errors.NullValueNotAllowed, psycopg.DataError,
                           UnicodeEncodeError)
SNAPSHOT = ("SELECT id, state::text, attempts, locked_by, lease_token, last_error, published_at, dead_at, "
            "discarded_at, discard_reason, next_attempt_at FROM outbox ORDER BY id")


def setup_states(conn: Conn) -> dict[str, Any]:
    """One event in each state: pending P, leased L (token T), dead D, published X; plus a
    second event of D's aggregate held back behind it (H)."""
    reset(conn)
    ids: dict[str, Any] = {}
    for name in ("X", "D", "L"):
        ids[name] = enqueue(conn, "state", name, "e", {})
        (row,) = conn.execute("SELECT id, lease_token FROM outbox_claim(1, '1 hour', 'setup')").fetchall()
        assert row[0] == ids[name]
        if name == "X":
            conn.execute("SELECT outbox_complete(%s, %s)", ([row[0]], row[1]))
        elif name == "D":
            conn.execute("SELECT outbox_fail(%s, %s, 'setup', true)", (row[0], row[1]))
        else:
            ids["T"] = row[1]
    ids["P"] = enqueue(conn, "state", "P", "e", {})
    ids["H"] = enqueue(conn, "state", "D", "later", {})
    return ids


def snapshot(conn: Conn) -> dict[int, tuple[Any, ...]]:
    return {r[0]: r for r in conn.execute(SNAPSHOT).fetchall()}


id_choices = st.sampled_from(["P", "L", "D", "X", "H"])
bigints = st.integers(-(2**63), 2**63 - 1)
foreign_ids = st.one_of(bigints, bigints, st.integers(2**63, 2**70), st.none())   # beyond bigint, now and then
id_lists = st.one_of(st.none(), st.lists(st.one_of(id_choices, id_choices, bigints, st.none()), max_size=4),
                     st.lists(st.one_of(id_choices, st.integers(2**63, 2**70)), min_size=1, max_size=2))
tokens = st.one_of(st.none(), st.just("T"), st.uuids(), st.sampled_from(["not-a-uuid", "", "'; --"]))
intervals = st.one_of(st.none(), st.sampled_from(["1 minute", "0", "-1 second", "1 microsecond", "100 years",
                                                  "1000000000 years", "forever", "'; --"]))
texts = st.one_of(st.none(), hostile_text(), st.sampled_from(["", " ", "\t\n", "\u00a0", "\u3000"]), st.sampled_from(INJECTIONS))

calls = st.one_of(
    st.tuples(st.just("claim"), st.one_of(st.none(), st.integers(-(2**31) - 5, 2**31 + 5),
                                          st.sampled_from([0, -1, 1, 10**6])), intervals, texts),
    st.tuples(st.just("complete"), id_lists, tokens),
    st.tuples(st.just("fail"), st.one_of(id_choices, foreign_ids), tokens, texts, st.one_of(st.none(), st.booleans())),
    st.tuples(st.just("release"), id_lists, tokens),
    st.tuples(st.just("requeue"), id_lists),
    st.tuples(st.just("discard"), id_lists, texts),
)

SQL = {
    "claim": "SELECT id FROM outbox_claim(%s::integer, %s::interval, %s::text)",
    "complete": "SELECT outbox_complete(%s::bigint[], %s::uuid)",
    "fail": "SELECT outbox_fail(%s::bigint, %s::uuid, %s::text, %s::boolean)",
    "release": "SELECT outbox_release(%s::bigint[], %s::uuid)",
    "requeue": "SELECT outbox_requeue(%s::bigint[])",
    "discard": "SELECT outbox_discard(%s::bigint[], %s::text)",
}


def _is_blank(reason: str) -> bool | None:
    """Whether outbox_discard calls ``reason`` blank (None: depends on the database's locale)."""
    if all(c in " \t\n\r\v\f" for c in reason):
        return True
    if reason.isspace():
        return None
    return False


@settings(max_examples=int(150 * SCALE))
@given(call=calls)
# A text that happens to spell a state's letter is a text, not that event's id (a reason "L").
@example(call=("discard", [], "L"))
@example(call=("fail", "L", "T", "P", False))
def test_functions_change_only_what_they_name_or_refuse_cleanly(conn: Conn, call: tuple[Any, ...]) -> None:
    ids = setup_states(conn)
    before = snapshot(conn)
    name, *raw = call

    def resolve(x: Any) -> Any:
        if isinstance(x, str) and x in ids:
            return ids[x] if x != "T" else str(ids["T"])
        if isinstance(x, list):
            return [resolve(i) for i in x]
        if isinstance(x, uuid.UUID):
            return str(x)
        return x

    # Letters stand for events (and "T" for L's token) only where `calls` puts them: the ids
    # first, then the token. The texts after them are passed as they are.
    symbolic = 2 if name in ("complete", "fail", "release") else 0 if name == "claim" else 1
    args = [resolve(a) if i < symbolic else a for i, a in enumerate(raw)]
    try:
        result = conn.execute(SQL[name], args).fetchall()
        error = None
    except Exception as exc:  # noqa: BLE001 - judged below
        result, error = None, exc
    after = snapshot(conn)
    hypothesis.event(f"{name}: {type(error).__name__ if error else 'returned'}")
    if error is not None:
        assert isinstance(error, ALLOWED_FUNCTION_ERRORS), f"{name}{tuple(args)!r}: {error!r}"
        assert str(error).strip()
        if isinstance(error, (errors.InvalidParameterValue, errors.NullValueNotAllowed)):
            assert str(error).startswith(f"outbox_{name}:"), str(error)   # raised by the function, named
        assert after == before, "a failed call changed something"
        return
    changed = {i for i in before if before[i] != after[i]}
    arg_ids = set(args[0]) if isinstance(args[0], list) else {args[0]}
    token_holds = name in ("complete", "fail", "release") and args[1] == str(ids["T"])
    (value,) = result[0] if result else (None,)

    if name == "claim":
        # Only P is due: L is leased for an hour, D is dead and H waits behind D, X is done.
        assert [r[0] for r in result] == [ids["P"]]
        assert changed == {ids["P"]}
        if args[2] is not None:
            assert after[ids["P"]][3] == args[2], "the worker name is stored verbatim"
    elif name in ("complete", "release"):
        hit = token_holds and ids["L"] in arg_ids
        assert value == int(hit)
        assert changed == ({ids["L"]} if hit else set())
        if hit:
            assert after[ids["L"]][1] == ("published" if name == "complete" else "pending")
    elif name == "fail":
        hit = token_holds and args[0] == ids["L"]
        assert changed == ({ids["L"]} if hit else set())
        if hit:
            assert value == ("dead" if args[3] else "pending")
            error_text = args[2] if args[2] is not None else "unknown error (outbox_fail was given no text)"
            assert after[ids["L"]][5] == error_text[:8000], "the error text is stored verbatim (first 8000 characters)"
        else:
            assert value is None
    elif name == "requeue":
        hit = ids["D"] in arg_ids
        assert value == int(hit) and changed == ({ids["D"]} if hit else set())
    elif name == "discard":
        assert args[1] is not None and _is_blank(args[1]) is not True, "a blank reason must be refused"
        targets = arg_ids & {ids["D"], ids["P"], ids["H"]}
        assert value == len(targets) and changed == targets
        for i in targets:
            assert after[i][1] == "discarded" and after[i][9] == args[1][:8000], "the reason is stored verbatim"
