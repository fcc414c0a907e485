"""What the worker and ``outboxpg status`` say about subjects no stream captures
(outboxpg.relay.nats.streams) and about who holds back the xmin horizon (outboxpg.relay.horizon)."""

from __future__ import annotations

from datetime import UTC, datetime

from outboxpg.relay.horizon import XminHolder
from outboxpg.relay.nats.subjects import Subject, missing_text, under_prefix


def test_under_prefix_is_what_prefix_dot_gt_captures() -> None:
    assert under_prefix("shop.order.created", "shop")
    assert not under_prefix("shopping.order", "shop") and not under_prefix("shop", "shop")


def test_missing_subjects_are_named_five_at_most_with_their_events() -> None:
    one = [Subject("billing.invoice.issued", True, 1)]
    assert missing_text(one) == ("no JetStream stream captures the subject of 1 unfinished event: "
                                 "'billing.invoice.issued' (1 event)")
    many = [Subject(f"s{n}", True, n) for n in range(1, 8)]
    assert missing_text(many, "explicit subject") == (
        "no JetStream stream captures the explicit subjects of 28 unfinished events: 's1' (1 event), 's2' (2 events), "
        "'s3' (3 events), 's4' (4 events), 's5' (5 events) and 2 more")


def holder(**kw: object) -> XminHolder:
    fields: dict[str, object] = dict(kind="session", pid=4242, name=None, since=datetime(2026, 11, 23, tzinfo=UTC),
                                     age_seconds=125.0, xmin_age=307, state="idle in transaction",
                                     role="reporting", application_name="report")
    fields.update(kw)
    return XminHolder(**fields)  # type: ignore[arg-type]


def test_a_holder_for_people_and_what_to_do_about_it() -> None:
    session = holder()
    assert session.text() == ("session pid 4242 of role 'reporting' (application 'report'), idle in transaction, "
                              "for 2 min 05 s, 307 transactions ago")
    assert session.advice().endswith("end the transaction in its application, or SELECT pg_terminate_backend(4242)")
    prepared = holder(kind="prepared transaction", pid=None, name="order-2pc", state="prepared", role=None,
                      application_name=None, xmin_age=None)
    assert prepared.text() == "prepared transaction 'order-2pc', prepared, for 2 min 05 s"
    assert prepared.advice().endswith("COMMIT PREPARED or ROLLBACK PREPARED 'order-2pc'")
    slot = holder(kind="replication slot", pid=None, name="standby1", since=None, age_seconds=None, state=None,
                  role=None, application_name=None)
    assert slot.advice().endswith("SELECT pg_drop_replication_slot('standby1') if nothing uses it any more")
    # A name is pasted into psql as a literal, whatever it holds.
    hostile = holder(kind="prepared transaction", pid=None, name="x'; DROP TABLE outbox; --", role=None)
    assert hostile.advice().endswith("ROLLBACK PREPARED 'x''; DROP TABLE outbox; --'")


def test_the_same_holder_from_one_look_to_the_next() -> None:
    assert holder().identity == holder(age_seconds=999.0, role="other").identity
    assert holder().identity != holder(since=datetime(2026, 11, 24, tzinfo=UTC)).identity
