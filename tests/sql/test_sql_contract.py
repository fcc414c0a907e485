"""The contract of every outbox SQL function and view, one call at a time (no concurrency).

Each test runs on its own freshly migrated database (the ``conn`` fixture: autocommit, so every
statement commits on its own, as a worker's calls do).
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from helpers import (
    allow_subjects,
    claim,
    complete,
    discard,
    event,
    fail,
    insert,
    insert_series,
    make_due,
    release,
    requeue,
    server_now,
    set_settings,
    states,
)
from psycopg import errors

Conn = psycopg.Connection[Any]


# --------------------------------------------------------------------------------------------
# outbox_claim
# --------------------------------------------------------------------------------------------

def test_claim_rejects_batch_size_below_one_or_null(conn: Conn, subtests: Any) -> None:
    insert(conn)
    for batch in [0, -1, -1000, None]:
        with subtests.test(batch=batch):
            with pytest.raises(errors.InvalidParameterValue, match="batch_size"):
                claim(conn, batch)
            assert states(conn) == {"pending": 1}


def test_claim_clamps_batch_size_to_max_claim_batch(conn: Conn) -> None:
    insert_series(conn, [str(i) for i in range(20)])
    set_settings(conn, max_claim_batch=5)
    rows = claim(conn, 1_000_000)
    assert len(rows) == 5
    assert states(conn) == {"processing": 5, "pending": 15}
    set_settings(conn, max_claim_batch=100)
    assert len(claim(conn, 1_000_000)) == 15


def test_claim_rejects_lease_not_positive(conn: Conn, subtests: Any) -> None:
    insert(conn)
    for lease in ["0", "-1 second", "-5 minutes", "1 day -25 hours"]:
        with subtests.test(lease=lease):
            with pytest.raises(errors.InvalidParameterValue, match="lease"):
                claim(conn, 10, lease=lease)
            assert states(conn) == {"pending": 1}


def test_claim_on_empty_outbox_returns_nothing(conn: Conn) -> None:
    assert claim(conn, 10) == []


def test_claim_leases_batch_under_one_token(conn: Conn) -> None:
    ids = insert_series(conn, ["a", "b", "c"])
    set_settings(conn, default_lease="45 seconds")
    before = server_now(conn)
    rows = claim(conn, 10, worker="worker-1")
    after = server_now(conn)

    assert [r["id"] for r in rows] == ids  # oldest first, ordered by id
    assert len({r["lease_token"] for r in rows}) == 1
    token = rows[0]["lease_token"]
    assert isinstance(token, uuid.UUID)
    for r in rows:
        assert r["attempts"] == 1
        e = event(conn, r["id"])
        assert e["state"] == "processing"
        assert e["locked_by"] == "worker-1"
        assert e["lease_token"] == token
        assert before <= e["claimed_at"] <= after
        # lease NULL (not passed): outbox_settings.default_lease
        assert e["locked_until"] - e["claimed_at"] == timedelta(seconds=45)
        assert r["locked_until"] == e["locked_until"]

    # a second claim gets a different token; an explicit lease is used as given
    ids2 = insert_series(conn, ["d"])
    rows2 = claim(conn, 10, lease="2 minutes")
    assert [r["id"] for r in rows2] == ids2
    assert rows2[0]["lease_token"] != token
    e = event(conn, ids2[0])
    assert e["locked_until"] - e["claimed_at"] == timedelta(minutes=2)


def test_claim_worker_name_defaults_to_application_name(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True, application_name="billing-relay") as c:
        i = insert(c)
        claim(c, 1)
        assert event(c, i)["locked_by"] == "billing-relay"
    with psycopg.connect(dsn, autocommit=True, application_name="") as c:
        i = insert(c, aggregate_id="2")
        claim(c, 1)
        pid = c.info.backend_pid
        assert event(c, i)["locked_by"] == f"backend {pid}"


def test_claim_returns_event_fields(conn: Conn) -> None:
    allow_subjects(conn, "billing")
    i = insert(conn, "invoice", "inv-7", "paid", '{"amount": 12.5, "items": [1, 2]}',
               headers='{"trace-id": "abc"}', subject="billing.paid", msg_id="m-1")
    (row,) = claim(conn, 1)
    assert row["id"] == i
    assert row["aggregate_type"] == "invoice"
    assert row["aggregate_id"] == "inv-7"
    assert row["event_type"] == "paid"
    assert row["payload"] == {"amount": 12.5, "items": [1, 2]}
    assert row["headers"] == {"trace-id": "abc"}
    assert row["subject"] == "billing.paid"  # explicit subject as given
    assert row["msg_id"] == "m-1"
    assert row["created_at"] == event(conn, i)["created_at"]


def test_claim_skips_events_not_yet_due(conn: Conn) -> None:
    later = insert(conn, aggregate_id="1", next_attempt_at="2999-01-01 00:00:00+00")
    now = insert(conn, aggregate_id="2")
    assert [r["id"] for r in claim(conn, 10)] == [now]
    assert event(conn, later)["state"] == "pending"


def test_default_subject_is_resolved_at_claim_time(conn: Conn) -> None:
    allow_subjects(conn, "custom")
    first = insert(conn, "order", "1", "created")
    second = insert(conn, "order", "2", "shipped")
    explicit = insert(conn, "order", "3", "created", subject="custom.subject")
    # stored NULL: resolved when handed out
    assert event(conn, first)["subject"] is None

    (row,) = claim(conn, 1)
    assert (row["id"], row["subject"]) == (first, "outbox.order.created")

    # a prefix changed after the insert applies to events claimed from then on
    set_settings(conn, subject_prefix="acme.events")
    rows = claim(conn, 10)
    assert {r["id"]: r["subject"] for r in rows} == {second: "acme.events.order.shipped",
                                                     explicit: "custom.subject"}
    assert event(conn, second)["subject"] is None


def test_invalid_subject_prefix_is_refused(conn: Conn) -> None:
    for bad in ["", "a b", "a.*", "a.>", "a..b", ".a", "a.", "$JS.API", "$SYS", "_INBOX", "_INBOX.x"]:
        with pytest.raises(errors.CheckViolation) as exc:
            set_settings(conn, subject_prefix=bad)
        assert exc.value.diag.constraint_name == "subject_prefix_is_valid_nats_subject"
    with pytest.raises(errors.UniqueViolation):
        conn.execute("INSERT INTO outbox_settings DEFAULT VALUES")
    with pytest.raises(errors.CheckViolation):
        conn.execute("INSERT INTO outbox_settings (singleton) VALUES (false)")


def test_msg_id_defaults_unique_and_stays_across_retries(conn: Conn) -> None:
    ids = insert_series(conn, [str(i) for i in range(50)])
    msg_ids = {event(conn, i)["msg_id"] for i in ids}
    assert len(msg_ids) == 50
    assert all(m for m in msg_ids)

    target = ids[0]
    first_msg = event(conn, target)["msg_id"]
    seen = []
    for _ in range(3):
        rows = [r for r in claim(conn, 100) if r["id"] == target]
        assert len(rows) == 1
        seen.append(rows[0]["msg_id"])
        assert fail(conn, target, rows[0]["lease_token"], "broker down") == "pending"
        make_due(conn, [target])
    assert seen == [first_msg] * 3
    assert event(conn, target)["msg_id"] == first_msg


# --------------------------------------------------------------------------------------------
# outbox_complete
# --------------------------------------------------------------------------------------------

def test_complete_marks_published(conn: Conn) -> None:
    ids = insert_series(conn, ["a", "b", "c"])
    rows = claim(conn, 10)
    token = rows[0]["lease_token"]
    before = server_now(conn)
    assert complete(conn, ids, token) == 3
    for i in ids:
        e = event(conn, i)
        assert e["state"] == "published"
        assert e["published_at"] >= before
        assert e["locked_until"] is None
    # completing again changes nothing: they are no longer leased
    assert complete(conn, ids, token) == 0


def test_complete_with_wrong_token_changes_nothing(conn: Conn) -> None:
    ids = insert_series(conn, ["a", "b"])
    claim(conn, 10)
    before = [event(conn, i) for i in ids]
    assert complete(conn, ids, uuid.uuid4()) == 0
    assert [event(conn, i) for i in ids] == before


def test_complete_counts_only_events_held_by_the_token(conn: Conn) -> None:
    a, b, c = insert_series(conn, ["a", "b", "c"])
    token_ab = claim(conn, 2)[0]["lease_token"]
    token_c = claim(conn, 2)[0]["lease_token"]
    # unknown ids and an event held by another token are not counted, and not touched
    assert complete(conn, [a, b, c, 999_999, -1], token_ab) == 2
    assert event(conn, c)["state"] == "processing"
    assert complete(conn, [c], token_c) == 1


def test_complete_empty_array_is_a_no_op(conn: Conn) -> None:
    insert(conn)
    token = claim(conn, 1)[0]["lease_token"]
    assert complete(conn, [], token) == 0
    assert states(conn) == {"processing": 1}


def test_complete_rejects_null_arguments(conn: Conn) -> None:
    i = insert(conn)
    token = claim(conn, 1)[0]["lease_token"]
    with pytest.raises(errors.NullValueNotAllowed):
        complete(conn, None, token)
    with pytest.raises(errors.NullValueNotAllowed):
        complete(conn, [i], None)
    assert event(conn, i)["state"] == "processing"


# --------------------------------------------------------------------------------------------
# outbox_fail and the backoff
# --------------------------------------------------------------------------------------------

def test_fail_schedules_retry_within_backoff_bounds(conn: Conn) -> None:
    set_settings(conn, backoff_base="1 second", backoff_cap="4 seconds", max_attempts=10)
    i = insert(conn)
    for attempt in range(1, 7):
        (row,) = claim(conn, 1)
        assert row["attempts"] == attempt
        t0 = server_now(conn)
        assert fail(conn, i, row["lease_token"], f"error {attempt}") == "pending"
        t1 = server_now(conn)
        e = event(conn, i)
        base = timedelta(seconds=min(4, 2 ** (attempt - 1)))  # least(cap, base * 2^(n-1))
        assert t0 + base / 2 <= e["next_attempt_at"] <= t1 + base, (attempt, e["next_attempt_at"] - t0)
        assert e["state"] == "pending"
        assert e["attempts"] == attempt
        assert e["last_error"] == f"error {attempt}"
        assert e["lease_token"] is None and e["locked_until"] is None
        assert e["dead_at"] is None
        # not due yet: a claim does not hand it out
        assert claim(conn, 1) == []
        make_due(conn, [i])


def test_retry_delay_is_equal_jitter_of_capped_exponential(conn: Conn) -> None:
    rows = conn.execute(
        "SELECT a, min(d), max(d) FROM generate_series(-1, 45) a, "
        "LATERAL (SELECT outbox_retry_delay(a, '1 second', '1 minute') AS d FROM generate_series(1, 300)) s "
        "GROUP BY a ORDER BY a").fetchall()
    for attempt, lo, hi in rows:
        full = timedelta(seconds=min(60, 2 ** (max(attempt, 1) - 1)))
        assert full / 2 <= lo <= hi <= full, (attempt, lo, hi)
        assert hi - lo > full / 5, f"no jitter for attempt {attempt}: {lo}..{hi}"


def test_fail_after_max_attempts_is_dead(conn: Conn) -> None:
    set_settings(conn, max_attempts=3)
    i = insert(conn)
    results = []
    for _ in range(3):
        (row,) = claim(conn, 1)
        results.append(fail(conn, i, row["lease_token"], "nope"))
        make_due(conn, [i])
    assert results == ["pending", "pending", "dead"]
    e = event(conn, i)
    assert e["state"] == "dead" and e["attempts"] == 3 and e["dead_at"] is not None
    assert e["last_error"] == "nope"
    assert claim(conn, 1) == []


def test_fail_permanent_is_dead_at_once(conn: Conn) -> None:
    i = insert(conn)
    (row,) = claim(conn, 1)
    assert fail(conn, i, row["lease_token"], "subject refused", permanent=True) == "dead"
    e = event(conn, i)
    assert e["state"] == "dead" and e["attempts"] == 1 and e["last_error"] == "subject refused"


def test_fail_with_stale_or_wrong_token_returns_null_and_changes_nothing(conn: Conn) -> None:
    a, b = insert_series(conn, ["a", "b"])
    rows = claim(conn, 10)
    token = rows[0]["lease_token"]
    before = event(conn, a)
    assert fail(conn, a, uuid.uuid4(), "x") is None          # wrong token
    assert fail(conn, 999_999, token, "x") is None            # unknown id
    assert event(conn, a) == before
    assert complete(conn, [b], token) == 1
    published = event(conn, b)
    assert fail(conn, b, token, "x") is None                  # no longer leased
    assert event(conn, b) == published
    assert fail(conn, a, token, "first") == "pending"
    after_fail = event(conn, a)
    assert fail(conn, a, token, "second") is None             # token already used up
    assert event(conn, a) == after_fail


def test_fail_null_arguments(conn: Conn) -> None:
    a, b, c = insert_series(conn, ["a", "b", "c"])
    token = claim(conn, 10)[0]["lease_token"]
    with pytest.raises(errors.NullValueNotAllowed):
        fail(conn, None, token)
    with pytest.raises(errors.NullValueNotAllowed):
        fail(conn, a, None)
    assert event(conn, a)["state"] == "processing"
    # NULL error text: a placeholder reason; NULL permanent: not permanent
    assert fail(conn, a, token, None, None) == "pending"
    assert "no text" in event(conn, a)["last_error"]
    # a runaway error text is bounded
    assert fail(conn, b, token, "x" * 100_000) == "pending"
    assert len(event(conn, b)["last_error"]) == 8000


# --------------------------------------------------------------------------------------------
# outbox_release
# --------------------------------------------------------------------------------------------

def test_release_returns_events_unattempted(conn: Conn) -> None:
    a, b, c = insert_series(conn, ["a", "b", "c"])
    token = claim(conn, 10)[0]["lease_token"]
    assert release(conn, [a, b], uuid.uuid4()) == 0            # wrong token
    assert release(conn, [], token) == 0                       # empty
    assert release(conn, [a, b, 999_999], token) == 2
    for i in (a, b):
        e = event(conn, i)
        assert e["state"] == "pending" and e["attempts"] == 0 and e["lease_token"] is None
    assert event(conn, c)["state"] == "processing"
    assert release(conn, [a, b], token) == 0                   # already released
    # due at once, and the next claim is attempt 1 again
    rows = claim(conn, 10)
    assert sorted(r["id"] for r in rows) == [a, b]
    assert all(r["attempts"] == 1 for r in rows)
    # the released lease's token is dead
    assert complete(conn, [a, b], token) == 0
    with pytest.raises(errors.NullValueNotAllowed):
        release(conn, None, token)
    with pytest.raises(errors.NullValueNotAllowed):
        release(conn, [c], None)


def test_release_after_retries_keeps_earlier_attempts(conn: Conn) -> None:
    i = insert(conn)
    (row,) = claim(conn, 1)
    assert fail(conn, i, row["lease_token"]) == "pending"
    make_due(conn, [i])
    (row,) = claim(conn, 1)
    assert row["attempts"] == 2
    assert release(conn, [i], row["lease_token"]) == 1
    assert event(conn, i)["attempts"] == 1


# --------------------------------------------------------------------------------------------
# outbox_requeue / outbox_discard / outbox_dead_letters
# --------------------------------------------------------------------------------------------

def _one_of_each(conn: Conn) -> dict[str, int]:
    """Events in every state, each of its own aggregate."""
    ids = dict(zip(["dead", "processing", "published", "pending", "discarded"],
                   insert_series(conn, ["d", "l", "p", "q", "x"])))
    rows = {r["id"]: r for r in claim(conn, 3)}
    assert set(rows) == {ids["dead"], ids["processing"], ids["published"]}
    assert fail(conn, ids["dead"], rows[ids["dead"]]["lease_token"], "poison", permanent=True) == "dead"
    assert complete(conn, [ids["published"]], rows[ids["published"]]["lease_token"]) == 1
    assert discard(conn, [ids["discarded"]], "test") == 1
    return ids


def test_requeue_only_touches_dead(conn: Conn) -> None:
    ids = _one_of_each(conn)
    before = {s: event(conn, i) for s, i in ids.items()}
    assert requeue(conn, list(ids.values()) + [999_999]) == 1
    e = event(conn, ids["dead"])
    assert e["state"] == "pending" and e["attempts"] == 0 and e["dead_at"] is None
    assert e["last_error"] == "poison"  # kept: why it died last time
    for s in ("processing", "published", "pending", "discarded"):
        assert event(conn, ids[s]) == before[s], s
    assert requeue(conn, [ids["dead"]]) == 0  # no longer dead
    assert requeue(conn, []) == 0
    with pytest.raises(errors.NullValueNotAllowed):
        requeue(conn, None)
    # requeued: claimable again, from attempt 1
    rows = [r for r in claim(conn, 10) if r["id"] == ids["dead"]]
    assert len(rows) == 1 and rows[0]["attempts"] == 1


def test_discard_touches_dead_and_pending_never_leased(conn: Conn) -> None:
    ids = _one_of_each(conn)
    before = {s: event(conn, i) for s, i in ids.items()}
    assert discard(conn, list(ids.values()) + [999_999], "superseded by #44") == 2
    for s in ("dead", "pending"):
        e = event(conn, ids[s])
        assert e["state"] == "discarded"
        assert e["discard_reason"] == "superseded by #44"
        assert e["discarded_at"] is not None
    for s in ("processing", "published", "discarded"):
        assert event(conn, ids[s]) == before[s], s
    assert discard(conn, [], "r") == 0
    # a discarded event is never handed out again
    assert claim(conn, 10) == []


def test_discard_requires_a_reason(conn: Conn, subtests: Any) -> None:
    ids = _one_of_each(conn)
    for reason in [None, "", "   ", "\t\n"]:
        with subtests.test(reason=reason):
            with pytest.raises(errors.InvalidParameterValue, match="reason"):
                discard(conn, [ids["dead"], ids["pending"]], reason)
            assert event(conn, ids["dead"])["state"] == "dead"
            assert event(conn, ids["pending"])["state"] == "pending"


def test_discard_rejects_null_ids(conn: Conn) -> None:
    with pytest.raises(errors.NullValueNotAllowed):
        discard(conn, None, "why")


def test_dead_letters_view(conn: Conn) -> None:
    allow_subjects(conn, "billing")
    set_settings(conn, max_attempts=1)
    ids = _one_of_each(conn)
    extra = insert(conn, "invoice", "9", "paid", subject="billing.x")
    row = next(r for r in claim(conn, 10) if r["id"] == extra)
    assert fail(conn, extra, row["lease_token"], "timeout") == "dead"

    rows = conn.execute("SELECT id, aggregate_type, aggregate_id, event_type, subject, attempts, last_error, "
                        "dead_at IS NOT NULL, msg_id FROM outbox_dead_letters ORDER BY id").fetchall()
    assert rows == [
        (ids["dead"], "order", "d", "created", None, 1, "poison", True, event(conn, ids["dead"])["msg_id"]),
        (extra, "invoice", "9", "paid", "billing.x", 1, "timeout", True, event(conn, extra)["msg_id"]),
    ]
    requeue(conn, [extra])
    discard(conn, [ids["dead"]], "gone")
    assert conn.execute("SELECT count(*) FROM outbox_dead_letters").fetchone() == (0,)


# --------------------------------------------------------------------------------------------
# head of line per aggregate (single claimer)
# --------------------------------------------------------------------------------------------

def test_one_event_per_aggregate_in_flight_oldest_first(conn: Conn) -> None:
    set_settings(conn, max_run=1)       # runs: tests/sql/test_sql_runs.py
    ids = insert_series(conn, ["a", "b", "a", "b", "a"])
    a1, b1, a2, b2, a3 = ids
    rows = claim(conn, 10)
    assert [r["id"] for r in rows] == [a1, b1]
    assert claim(conn, 10) == []  # a2, b2 wait for a1, b1
    token = rows[0]["lease_token"]
    assert complete(conn, [a1], token) == 1
    (r,) = claim(conn, 10)
    assert r["id"] == a2
    # b1 fails: b2 waits through b1's backoff too
    assert fail(conn, b1, token, "x") == "pending"
    assert claim(conn, 10) == []
    make_due(conn, [b1])
    assert [x["id"] for x in claim(conn, 10)] == [b1]
    # same aggregate_id under another aggregate_type is another aggregate
    other = insert(conn, "invoice", "a")
    assert [x["id"] for x in claim(conn, 10)] == [other]
    assert event(conn, a3)["state"] == "pending"


def test_dead_event_blocks_only_its_aggregate_until_requeued(conn: Conn) -> None:
    set_settings(conn, max_run=1)
    a1, b1, a2, b2 = insert_series(conn, ["a", "b", "a", "b"])
    rows = {r["id"]: r for r in claim(conn, 10)}
    assert set(rows) == {a1, b1}
    assert fail(conn, a1, rows[a1]["lease_token"], "poison", permanent=True) == "dead"
    assert complete(conn, [b1], rows[b1]["lease_token"]) == 1
    # b2 flows, a2 is held back by the dead a1
    assert [r["id"] for r in claim(conn, 10)] == [b2]
    assert claim(conn, 10) == []
    assert event(conn, a2)["state"] == "pending"
    # requeue: a1 first, then a2
    assert requeue(conn, [a1]) == 1
    (r,) = claim(conn, 10)
    assert r["id"] == a1
    assert complete(conn, [a1], r["lease_token"]) == 1
    (r,) = claim(conn, 10)
    assert r["id"] == a2


def test_discarding_a_dead_event_unblocks_its_aggregate(conn: Conn) -> None:
    set_settings(conn, max_run=1)
    a1, a2 = insert_series(conn, ["a", "a"])
    (r,) = claim(conn, 10)
    assert fail(conn, a1, r["lease_token"], "poison", permanent=True) == "dead"
    assert claim(conn, 10) == []
    assert discard(conn, [a1], "operator gave up") == 1
    assert [x["id"] for x in claim(conn, 10)] == [a2]


# --------------------------------------------------------------------------------------------
# what an INSERT may contain
# --------------------------------------------------------------------------------------------

SUBJECT_CONSTRAINT = "outbox_subject_is_valid_nats_subject"


def test_insert_rejects_invalid_subject(conn: Conn, subtests: Any) -> None:
    for subject in ["a b", "orders.*", "orders.>", ">", "*", "a..b", ".a", "a.", "", "tab\there",
                    "$JS.API.STREAM.PURGE.ORDERS", "$SYS.REQ.SERVER.PING", "$KV.bucket.key", "_INBOX.abc.1", "_INBOX",
                    "new\nline", "ctl\x01char", "x" * 1025]:
        with subtests.test(subject=subject[:40]):
            with pytest.raises(errors.CheckViolation) as exc:
                insert(conn, subject=subject)
            assert exc.value.diag.constraint_name == SUBJECT_CONSTRAINT
            assert SUBJECT_CONSTRAINT in str(exc.value)
            assert states(conn) == {}


def test_insert_rejects_invalid_default_subject(conn: Conn, subtests: Any) -> None:
    for aggregate_type, event_type in [("my order", "created"), ("order", "was created"), ("*", "created"),
                                       ("order", ">"), ("order.", "x"), ("order", ".x")]:
        with subtests.test(aggregate_type=aggregate_type, event_type=event_type):
            with pytest.raises(errors.CheckViolation) as exc:
                insert(conn, aggregate_type, "1", event_type)
            assert exc.value.diag.constraint_name == SUBJECT_CONSTRAINT
            # the names are subject tokens even on an event with a subject of its own
            with pytest.raises(errors.CheckViolation) as exc:
                insert(conn, aggregate_type, "1", event_type, subject="ok.subject")
            assert exc.value.diag.constraint_name == SUBJECT_CONSTRAINT
    assert states(conn) == {}


def test_insert_accepts_valid_subject(conn: Conn) -> None:
    subjects = ["orders", "orders.created", "a-b_c.D1.ünï", "orders.$price.changed", "_INBOXES.x", "orders._INBOX", "x" * 1024]
    allow_subjects(conn, "orders", "a-b_c", "_INBOXES", "x" * 1024)
    ids = [insert(conn, aggregate_id=str(n), subject=subject) for n, subject in enumerate(subjects)]
    assert {r["id"]: r["subject"] for r in claim(conn, 10)} == dict(zip(ids, subjects))


HEADERS_CONSTRAINT = "outbox_headers_are_string_map"


def test_insert_rejects_headers_that_are_not_a_string_map(conn: Conn, subtests: Any) -> None:
    for headers in ['{"n": 1}', '{"n": null}', '{"n": true}', '{"n": {"x": "y"}}', '{"n": ["a"]}', '{"n": []}',
                    '[]', '["a"]', '"text"', '1', 'null', '{"bad key": "v"}', '{"a:b": "v"}', '{"": "v"}',
                    '{"tab\\tkey": "v"}', '{"ok": "v", "n": 2}', '{"Nats-Rollup": "sub"}',
                    '{"nats-expected-stream": "S"}', '{"NATS-MSG-ID": "x"}']:
        with subtests.test(headers=headers):
            with pytest.raises(errors.CheckViolation) as exc:
                insert(conn, headers=headers)
            assert exc.value.diag.constraint_name == HEADERS_CONSTRAINT
            assert HEADERS_CONSTRAINT in str(exc.value)
    assert states(conn) == {}


def test_insert_accepts_string_headers(conn: Conn) -> None:
    headers = {"trace-id": "1", "X-Empty": "", "unicode": "✓ value with spaces", "X-Nats-Like": "ok"}
    i = insert(conn, headers=json.dumps(headers))
    assert event(conn, i)["headers"] == headers


def test_insert_rejects_missing_required_field(conn: Conn, subtests: Any) -> None:
    required = {"aggregate_type": "order", "aggregate_id": "1", "event_type": "created", "payload": "{}"}
    for column in required:
        with subtests.test(column=column):
            values = {k: v for k, v in required.items() if k != column}
            with pytest.raises(errors.NotNullViolation) as exc:
                conn.execute(f"INSERT INTO outbox ({', '.join(values)}) VALUES ({', '.join(['%s'] * len(values))})",
                             list(values.values()))
            assert exc.value.diag.column_name == column
            assert column in str(exc.value)
            with pytest.raises(errors.NotNullViolation):
                insert(conn, **{**required, column: None})
    assert states(conn) == {}


def test_insert_rejects_blank_or_oversized_fields(conn: Conn, subtests: Any) -> None:
    for column, too_long in [("aggregate_type", 256), ("aggregate_id", 1025), ("event_type", 256), ("msg_id", 256)]:
        for value in ["", "x" * too_long]:
            with subtests.test(column=column, length=len(value)):
                with pytest.raises(errors.CheckViolation) as exc:
                    insert(conn, **{column: value}, subject="s")
                assert exc.value.diag.constraint_name == f"outbox_{column}_not_blank"
    assert states(conn) == {}


def test_insert_rejects_null_headers_and_msg_id(conn: Conn) -> None:
    for column in ("headers", "msg_id"):
        with pytest.raises(errors.NotNullViolation) as exc:
            insert(conn, **{column: None})
        assert exc.value.diag.column_name == column


def test_insert_rejects_invalid_json_payload(conn: Conn, subtests: Any) -> None:
    for payload in ["{bad", "", "{'single': 1}", '{"a": 1', "undefined", "NaN"]:
        with subtests.test(payload=payload):
            with pytest.raises(errors.InvalidTextRepresentation, match="json"):
                insert(conn, payload=payload)
    assert states(conn) == {}


# --------------------------------------------------------------------------------------------
# outbox_stats
# --------------------------------------------------------------------------------------------

def _stats(conn: Conn) -> dict[str, Any]:
    from psycopg.rows import dict_row

    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute("SELECT * FROM outbox_stats").fetchone()
    assert row is not None
    return row


def test_stats_on_empty_outbox(conn: Conn) -> None:
    assert _stats(conn) == {"pending": 0, "scheduled": 0, "waiting_retry": 0, "processing": 0, "published": 0, "dead": 0,
                            "discarded": 0, "oldest_pending_age": None, "oldest_lease_age": None,
                            "last_claim_at": None}


def test_stats_counts_every_state(conn: Conn) -> None:
    set_settings(conn, backoff_base="1 hour", backoff_cap="1 hour")
    old = insert(conn, "order", "old", created_at="2000-01-01 00:00:00+00")
    ids = insert_series(conn, ["p1", "p2", "f", "l", "c1", "c2", "d", "x"])
    p1, p2, f, lease, c1, c2, d, x = ids
    rows = claim(conn, 100)
    assert len(rows) == 9
    tok = rows[0]["lease_token"]
    assert fail(conn, f, tok, "later") == "pending"                    # waiting for a retry
    assert complete(conn, [c1, c2], tok) == 2
    assert fail(conn, d, tok, "poison", permanent=True) == "dead"
    assert release(conn, [p1, p2, old, x], tok) == 4                   # back to pending, due
    assert discard(conn, [x], "drop") == 1
    # `lease` stays processing
    s = _stats(conn)
    assert s["pending"] == 4          # p1, p2, old, and f (waiting)
    assert s["waiting_retry"] == 1
    assert s["processing"] == 1
    assert s["published"] == 2
    assert s["dead"] == 1
    assert s["discarded"] == 1
    last_claim = conn.execute("SELECT max(claimed_at) FROM outbox").fetchone()[0]  # type: ignore[index]
    assert s["last_claim_at"] == last_claim
    # the oldest undelivered event is the one from 2000
    assert s["oldest_pending_age"] > timedelta(days=365 * 20)
    assert timedelta(0) <= s["oldest_lease_age"] < timedelta(minutes=5)

    rows = claim(conn, 100)
    assert sorted(r["id"] for r in rows) == sorted([old, p1, p2])
    assert complete(conn, [old, p1, p2], rows[0]["lease_token"]) == 3
    s = _stats(conn)
    assert (s["pending"], s["waiting_retry"], s["processing"], s["published"], s["dead"], s["discarded"]) == \
        (1, 1, 1, 5, 1, 1)
    assert timedelta(0) <= s["oldest_pending_age"] < timedelta(minutes=5)
    assert s["last_claim_at"] > last_claim


# --------------------------------------------------------------------------------------------
# outbox_next_wakeup
# --------------------------------------------------------------------------------------------

def _next_wakeup(conn: Conn) -> Any:
    row = conn.execute("SELECT outbox_next_wakeup()").fetchone()
    assert row is not None
    return row[0]


def test_next_wakeup_is_the_earliest_retry_or_lease_end(conn: Conn) -> None:
    assert _next_wakeup(conn) is None
    set_settings(conn, backoff_base="1 hour", backoff_cap="1 hour")
    a, b = insert_series(conn, ["a", "b"])
    assert _next_wakeup(conn) is None                # due now: a claim takes them, no timer needed
    rows = {r["id"]: r for r in claim(conn, 10, lease="10 minutes")}
    assert _next_wakeup(conn) == event(conn, a)["locked_until"]
    assert fail(conn, a, rows[a]["lease_token"], "later") == "pending"
    assert _next_wakeup(conn) == event(conn, b)["locked_until"]   # the lease ends before the retry
    assert complete(conn, [b], rows[b]["lease_token"]) == 1
    assert _next_wakeup(conn) == event(conn, a)["next_attempt_at"]
    assert discard(conn, [a], "gone") == 1
    assert _next_wakeup(conn) is None
