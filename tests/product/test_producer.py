"""outboxpg.enqueue / enqueue_many on sync and async psycopg connections."""

from __future__ import annotations

import dataclasses
import enum
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from types import MappingProxyType
from typing import Any

import orjson
import psycopg
import pytest
from helpers import Listener, allow_subjects, claim, connect, event, events
from psycopg import errors
from psycopg.conninfo import make_conninfo

import outboxpg
from outboxpg import Event, enqueue, enqueue_many

Conn = psycopg.Connection[Any]


@pytest.fixture
def tx(dsn: str) -> Iterator[Conn]:
    """A producer connection in the default (non-autocommit) mode: the caller's transaction."""
    with psycopg.connect(dsn) as c:
        yield c


@pytest.fixture
async def atx(dsn: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with await psycopg.AsyncConnection.connect(dsn) as c:
        yield c


@pytest.fixture
def listener(dsn: str) -> Iterator[Listener]:
    with Listener(dsn) as lst:
        yield lst


def count(conn: Conn) -> int:
    row = conn.execute("SELECT count(*) FROM outbox").fetchone()
    assert row is not None
    return int(row[0])


# --------------------------------------------------------------------------------------------
# enqueue (sync)
# --------------------------------------------------------------------------------------------

def test_enqueue_never_commits(tx: Conn, conn: Conn) -> None:
    i = enqueue(tx, "order", "1", "created", {"total": 42})
    assert isinstance(i, int)
    assert tx.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    assert count(conn) == 0            # invisible to others until the caller commits
    tx.rollback()
    assert count(conn) == 0
    assert count(tx) == 0

    with pytest.raises(RuntimeError):
        with tx.transaction():
            enqueue(tx, "order", "2", "created", {})
            raise RuntimeError("business logic failed")
    tx.commit()
    assert count(conn) == 0

    with tx.transaction():
        j = enqueue(tx, "order", "3", "created", {})
    assert [e["id"] for e in events(conn)] == [j]


def test_enqueue_dict_payload_through_orjson(tx: Conn, conn: Conn) -> None:
    payload = {"total": 42.5, "when": datetime(2024, 5, 1, 12, 0, tzinfo=UTC),
               "id": uuid.UUID("12345678-1234-5678-1234-567812345678"), "text": "naïve ✓ \"quoted\" \\ \t\n",
               "nested": {"list": [1, None, True]}}
    i = enqueue(tx, "order", "1", "created", payload)
    j = enqueue(tx, "order", "1", "listed", [1, 2, {"a": "b"}])
    tx.commit()
    assert event(conn, i)["payload"] == orjson.loads(orjson.dumps(payload))
    assert event(conn, i)["payload"]["when"] == "2024-05-01T12:00:00+00:00"
    assert event(conn, j)["payload"] == [1, 2, {"a": "b"}]


def test_enqueue_raw_json_bytes_and_str(tx: Conn, conn: Conn) -> None:
    a = enqueue(tx, "order", "1", "created", b'{"raw": "bytes", "n": 1}')
    b = enqueue(tx, "order", "1", "paid", '{"raw": "str"}')
    c = enqueue(tx, "order", "1", "shipped", bytearray(b"[1,2]"))
    d = enqueue(tx, "order", "1", "closed", memoryview(b'"just a string"'))
    tx.commit()
    assert [event(conn, x)["payload"] for x in (a, b, c, d)] == [
        {"raw": "bytes", "n": 1}, {"raw": "str"}, [1, 2], "just a string"]


def test_enqueue_optional_subject_headers_msg_id(tx: Conn, conn: Conn) -> None:
    allow_subjects(conn, "billing")   # an explicit subject outside subject_prefix
    plain = enqueue(tx, "order", "1", "created", {})
    full = enqueue(tx, "order", "2", "created", {}, subject="billing.orders", headers={"trace-id": "t-1"},
                   msg_id="order-2-created")
    tx.commit()
    p, f = event(conn, plain), event(conn, full)
    assert (p["subject"], p["headers"]) == (None, {})
    assert uuid.UUID(p["msg_id"])      # the table's default: a random UUID
    assert (f["subject"], f["headers"], f["msg_id"]) == ("billing.orders", {"trace-id": "t-1"}, "order-2-created")
    rows = {r["id"]: r for r in claim(conn, 10)}
    assert rows[plain]["subject"] == "outbox.order.created"
    assert rows[full]["subject"] == "billing.orders"


def test_enqueue_accepts_non_string_aggregate_id(tx: Conn, conn: Conn) -> None:
    i = enqueue(tx, "order", 1234, "created", {})  # type: ignore[arg-type]
    tx.commit()
    assert event(conn, i)["aggregate_id"] == "1234"


def test_enqueue_rejects_bad_input(tx: Conn) -> None:
    with pytest.raises(TypeError, match="payload"):
        enqueue(tx, "order", "1", "created", 42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="payload"):
        enqueue(tx, "order", "1", "created", None)  # type: ignore[arg-type]
    with pytest.raises(errors.CheckViolation, match="outbox_subject_is_valid_nats_subject"):
        enqueue(tx, "order", "1", "created", {}, subject="orders.*")
    tx.rollback()
    with pytest.raises(errors.CheckViolation, match="outbox_headers_are_string_map"):
        enqueue(tx, "order", "1", "created", {}, headers={"n": 1})  # type: ignore[dict-item]
    tx.rollback()
    with pytest.raises(errors.InvalidTextRepresentation, match="not JSON"):
        enqueue(tx, "order", "1", "created", "{not json")
    tx.rollback()


# --------------------------------------------------------------------------------------------
# payloads: what a Python application has at hand
# --------------------------------------------------------------------------------------------

class Status(enum.Enum):
    PAID = "paid"


class Priority(enum.IntEnum):
    HIGH = 1


@dataclasses.dataclass
class Line:
    sku: str
    price: Decimal
    added: date


class ModelLike:
    """Stands in for a Pydantic model: all the helpers use is model_dump(mode="json")."""

    def __init__(self, **fields: Any) -> None:
        self.fields = fields

    def model_dump(self, *, mode: str = "python") -> dict[str, Any]:
        assert mode == "json"
        return {k: str(v) if isinstance(v, Decimal) else v for k, v in self.fields.items()}


class Money:
    """Not JSON in any way the helpers know."""

    def __init__(self, cents: int) -> None:
        self.cents = cents


APP_PAYLOAD: dict[str, Any] = {
    "total": Decimal("12345678901234567890.12345678901234567890"),
    "tiny": Decimal("1E-30"),
    "at": datetime(2024, 5, 1, 12, 30, tzinfo=timezone(timedelta(hours=2))),
    "day": date(2024, 5, 1),
    "clock": time(9, 15, 30),
    "id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "status": Status.PAID,
    "priority": Priority.HIGH,
    "lines": [Line("sku-1", Decimal("9.90"), date(2024, 4, 30))],
    "model": ModelLike(amount=Decimal("0.10"), currency="EUR"),
    "by_id": {7: "seven", uuid.UUID(int=1): "uuid key"},
    "view": MappingProxyType({"a": 1}),
    "pair": (1, "two"),
}
APP_JSON: dict[str, Any] = {
    "total": "12345678901234567890.12345678901234567890",
    "tiny": "1E-30",
    "at": "2024-05-01T12:30:00+02:00",
    "day": "2024-05-01",
    "clock": "09:15:30",
    "id": "12345678-1234-5678-1234-567812345678",
    "status": "paid",
    "priority": 1,
    "lines": [{"sku": "sku-1", "price": "9.90", "added": "2024-04-30"}],
    "model": {"amount": "0.10", "currency": "EUR"},
    "by_id": {"7": "seven", "00000000-0000-0000-0000-000000000001": "uuid key"},
    "view": {"a": 1},
    "pair": [1, "two"],
}


def test_enqueue_encodes_what_a_python_app_has(tx: Conn, conn: Conn) -> None:
    """Decimal (as a string: every digit kept), date and time, UUID, enums, dataclasses, objects
    with model_dump (Pydantic), non-str keys; a dataclass or a model as the whole payload."""
    i = enqueue(tx, "order", "1", "created", APP_PAYLOAD)
    j = enqueue(tx, "order", "1", "line", Line("sku-2", Decimal("0.1"), date(2024, 1, 2)))  # type: ignore[arg-type]
    k = enqueue(tx, "order", "1", "priced", ModelLike(amount=Decimal("5")))  # type: ignore[arg-type]
    tx.commit()
    assert event(conn, i)["payload"] == APP_JSON
    assert event(conn, j)["payload"] == {"sku": "sku-2", "price": "0.1", "added": "2024-01-02"}
    assert event(conn, k)["payload"] == {"amount": "5"}


def test_enqueue_many_encodes_what_a_python_app_has(tx: Conn, conn: Conn) -> None:
    assert enqueue_many(tx, [Event("order", "1", "created", APP_PAYLOAD),
                             Event("order", "1", "line", Line("s", Decimal("-0.00"), date(2024, 1, 2)))]) == 2
    tx.commit()
    assert [e["payload"] for e in events(conn)] == [APP_JSON, {"sku": "s", "price": "-0.00", "added": "2024-01-02"}]


def test_enqueue_pydantic_model(tx: Conn, conn: Conn) -> None:
    import pydantic

    class Order(pydantic.BaseModel):  # type: ignore[name-defined,misc]
        id: uuid.UUID
        total: Decimal
        at: datetime

    order = Order(id=uuid.UUID(int=5), total=Decimal("19.99"), at=datetime(2024, 5, 1, tzinfo=UTC))
    i = enqueue(tx, "order", "1", "created", order)
    j = enqueue(tx, "order", "1", "wrapped", {"order": order})
    tx.commit()
    expected = orjson.loads(order.model_dump_json())
    assert event(conn, i)["payload"] == expected and event(conn, j)["payload"] == {"order": expected}


def test_a_type_still_not_encodable_is_refused_before_anything_is_sent(tx: Conn, conn: Conn) -> None:
    kept = enqueue(tx, "order", "1", "created", {})
    with pytest.raises(TypeError) as raised:
        enqueue(tx, "order", "1", "paid", {"amount": Money(42)})
    message = str(raised.value)
    assert "\n" not in message and "Money" in message and "payload" in message
    assert "convert" in message, message   # says what to do
    with pytest.raises(TypeError, match="Money"):
        enqueue_many(tx, [Event("order", "2", "created", {}), Event("order", "2", "paid", [Money(1)])])
    with pytest.raises(TypeError, match="set"):
        enqueue(tx, "order", "1", "tagged", {"tags": {"a"}})
    # The caller's transaction is still usable: nothing was sent, the earlier event is there.
    assert tx.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    enqueue(tx, "order", "1", "closed", {})
    tx.commit()
    assert [(e["id"] == kept, e["event_type"]) for e in events(conn)] == [(True, "created"), (False, "closed")]


def test_a_str_payload_is_raw_json_text(tx: Conn, conn: Conn) -> None:
    """A str is JSON text, not a JSON string: "hello" is refused in one line that says so."""
    i = enqueue(tx, "order", "1", "created", '"hello"')
    tx.commit()
    assert event(conn, i)["payload"] == "hello"
    with pytest.raises(errors.InvalidTextRepresentation) as raised:
        enqueue(tx, "order", "1", "created", "hello")
    message = str(raised.value)
    assert "\n" not in message and "raw JSON" in message and "orjson.dumps" in message, message
    assert raised.value.diag.message_detail == 'Token "hello" is invalid.'    # the server's own, still there
    tx.rollback()
    with pytest.raises(errors.InvalidTextRepresentation) as raised:
        enqueue_many(tx, [Event("order", "1", "created", "{}"), Event("order", "1", "paid", b"paid")])
    message = str(raised.value)
    assert "\n" not in message and "event 2 of the batch" in message and "raw JSON" in message, message
    tx.rollback()
    assert count(conn) == 1


def test_enqueue_before_migrate_names_the_database(empty_dsn: str) -> None:
    dsn = make_conninfo(empty_dsn, password="s3cret-pw")
    with psycopg.connect(dsn) as c:
        for call in (lambda: enqueue(c, "order", "1", "created", {}),
                     lambda: enqueue_many(c, [Event("order", "1", "created", {})])):
            with pytest.raises(outboxpg.NotInstalled) as raised:
                call()
            c.rollback()
            e = raised.value
            assert isinstance(e, errors.UndefinedTable) and isinstance(e, psycopg.Error)
            message = str(e)
            assert "\n" not in message and "s3cret" not in message, message
            assert f"database {c.info.dbname} on {c.info.host}:{c.info.port}" in message, message
            assert "outboxpg migrate --dsn" in message, message


async def test_async_enqueue_before_migrate_names_the_database(empty_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(empty_dsn) as c:
        with pytest.raises(outboxpg.NotInstalled, match=f"database {c.info.dbname} on .*outboxpg migrate --dsn"):
            await enqueue(c, "order", "1", "created", {})
        await c.rollback()
        with pytest.raises(outboxpg.NotInstalled, match="outboxpg migrate --dsn"):
            await enqueue_many(c, [Event("order", "1", "created", {})])


async def test_async_enqueue_encodes_and_refuses_the_same(atx: psycopg.AsyncConnection[Any], conn: Conn) -> None:
    i = await enqueue(atx, "order", "1", "created", APP_PAYLOAD)
    assert await enqueue_many(atx, [Event("order", "2", "created", APP_PAYLOAD)]) == 1
    with pytest.raises(TypeError, match="Money"):
        await enqueue(atx, "order", "1", "paid", {"m": Money(1)})
    await atx.commit()
    assert [e["payload"] for e in events(conn)] == [APP_JSON, APP_JSON] and events(conn)[0]["id"] == i
    with pytest.raises(errors.InvalidTextRepresentation, match="raw JSON"):
        await enqueue(atx, "order", "1", "created", "hello")


# --------------------------------------------------------------------------------------------
# enqueue_many (sync)
# --------------------------------------------------------------------------------------------

def test_enqueue_many_10000_in_one_copy_notifies_once(dsn: str, tx: Conn, conn: Conn, listener: Listener) -> None:
    n = 10_000
    with connect(dsn) as idle:
        idle.execute("SELECT outbox_worker_idle()")
        tx.execute("SET LOCAL track_functions = 'pl'")
        written = enqueue_many(tx, (Event("order", str(k), "created", {"n": k}) for k in range(n)))
        assert written == n
        calls = tx.execute("SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions "
                           "WHERE funcname = 'outbox_wake_workers'").fetchone()
        assert calls == (1,), "the statement trigger should run once for the whole COPY"
        assert count(conn) == 0
        tx.commit()
        assert listener.collect() == [""]
        idle.execute("SELECT outbox_worker_busy()")
    stats = conn.execute("SELECT count(*), count(DISTINCT id), count(DISTINCT msg_id), "
                         "count(*) FILTER (WHERE payload = jsonb_build_object('n', aggregate_id::int)), "
                         "count(*) FILTER (WHERE subject IS NULL AND headers = '{}') FROM outbox").fetchone()
    assert stats == (n, n, n, n, n)


def test_enqueue_many_without_an_idle_worker_does_not_notify(tx: Conn, conn: Conn, listener: Listener) -> None:
    assert enqueue_many(tx, [Event("order", str(k), "created", {}) for k in range(100)]) == 100
    tx.commit()
    assert count(conn) == 100
    assert listener.collect() == []


def test_enqueue_many_never_commits(tx: Conn, conn: Conn) -> None:
    enqueue_many(tx, [Event("order", "1", "created", {}), Event("order", "1", "paid", {})])
    assert count(conn) == 0
    tx.rollback()
    assert count(conn) == 0 and count(tx) == 0


def test_enqueue_many_mixed_optional_fields(tx: Conn, conn: Conn) -> None:
    allow_subjects(conn, "custom")
    batch: list[Event | dict[str, Any]] = [
        Event("order", "1", "created", {"a": 1}, msg_id="explicit-1"),
        Event("order", "2", "created", {"a": 2}),
        {"aggregate_type": "order", "aggregate_id": "3", "event_type": "created", "payload": b'{"a": 3}',
         "subject": "custom.three", "headers": {"h": "v"}},
        {"aggregate_type": "order", "aggregate_id": "4", "event_type": "created", "payload": '{"a": 4}',
         "msg_id": "explicit-4"},
        Event("order", "5", "created", {"a": 5}),
    ]
    assert enqueue_many(tx, batch) == 5
    tx.commit()
    rows = events(conn)
    assert [r["aggregate_id"] for r in rows] == ["1", "2", "3", "4", "5"]
    assert [r["payload"] for r in rows] == [{"a": k} for k in range(1, 6)]
    msg = [r["msg_id"] for r in rows]
    assert msg[0] == "explicit-1" and msg[3] == "explicit-4"
    for generated in (msg[1], msg[2], msg[4]):
        assert uuid.UUID(generated)
    assert len(set(msg)) == 5
    assert [r["subject"] for r in rows] == [None, None, "custom.three", None, None]
    assert [r["headers"] for r in rows] == [{}, {}, {"h": "v"}, {}, {}]
    subjects = {r["id"]: r["subject"] for r in claim(conn, 10)}
    assert sorted(subjects.values()) == ["custom.three"] + ["outbox.order.created"] * 4


def test_enqueue_many_escapes_copy_special_characters(tx: Conn, conn: Conn) -> None:
    allow_subjects(conn, "s")
    tricky = {"text": "tab\there\nnew line\\backslash \\N \"q\" ✓ \r\x1f end", "\\N": "\\."}
    enqueue_many(tx, [Event("agg\\type", "id\twith\ttabs", "ev", tricky, headers={"k": "a\\b\tc"},
                            subject="s.t", msg_id="\\N")])
    tx.commit()
    (row,) = events(conn)
    assert row["payload"] == tricky
    assert (row["aggregate_type"], row["aggregate_id"], row["msg_id"]) == ("agg\\type", "id\twith\ttabs", "\\N")
    assert row["headers"] == {"k": "a\\b\tc"}


def test_enqueue_many_empty_and_invalid(tx: Conn, conn: Conn) -> None:
    assert enqueue_many(tx, []) == 0
    assert enqueue_many(tx, iter([])) == 0
    with pytest.raises(errors.CheckViolation, match="outbox_subject_is_valid_nats_subject"):
        enqueue_many(tx, [Event("order", "1", "created", {}), Event("order", "2", "created", {}, subject="a..b")])
    tx.rollback()
    assert count(conn) == 0   # nothing of the failed batch
    with pytest.raises(TypeError):
        enqueue_many(tx, [{"aggregate_type": "order", "aggregate_id": "1", "event_type": "x", "payload": {},
                           "unknown": 1}])


def test_package_exports() -> None:
    assert outboxpg.enqueue is enqueue and outboxpg.enqueue_many is enqueue_many and outboxpg.Event is Event
    assert outboxpg.NotInstalled.__module__ == "outboxpg" and "NotInstalled" in outboxpg.__all__


# --------------------------------------------------------------------------------------------
# async
# --------------------------------------------------------------------------------------------

async def test_async_enqueue_never_commits(atx: psycopg.AsyncConnection[Any], conn: Conn) -> None:
    allow_subjects(conn, "a")
    i = await enqueue(atx, "order", "1", "created", {"total": 1})
    assert isinstance(i, int)
    assert count(conn) == 0
    await atx.rollback()
    assert count(conn) == 0

    async with atx.transaction():
        j = await enqueue(atx, "order", "2", "created", b'{"raw": true}', subject="a.b", headers={"h": "1"},
                          msg_id="m-2")
    e = event(conn, j)
    assert (e["payload"], e["subject"], e["headers"], e["msg_id"]) == ({"raw": True}, "a.b", {"h": "1"}, "m-2")


async def test_async_enqueue_many(atx: psycopg.AsyncConnection[Any], conn: Conn, dsn: str) -> None:
    n = 2_000
    with Listener(dsn) as lst, connect(dsn) as idle:
        idle.execute("SELECT outbox_worker_idle()")
        written = await enqueue_many(atx, [Event("order", str(k), "created", {"n": k},
                                                 msg_id=f"m-{k}" if k % 2 else None) for k in range(n)])
        assert written == n
        assert count(conn) == 0
        await atx.commit()
        assert lst.collect() == [""]
    rows = events(conn)
    assert len(rows) == n
    assert [r["payload"]["n"] for r in rows] == list(range(n))
    assert all(r["msg_id"] == f"m-{k}" for k, r in enumerate(rows) if k % 2)
    assert len({r["msg_id"] for r in rows}) == n

    assert await enqueue_many(atx, []) == 0
    await enqueue_many(atx, [Event("order", "x", "created", {})])
    await atx.rollback()
    assert count(conn) == n
