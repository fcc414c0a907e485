"""An event's NATS headers and the sizes the server counts: which header wins, what can never be
sent, and that the size check never lets through a message the server would refuse."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from workers import event

from outboxpg.cloudevents import CloudEvents
from outboxpg.relay.nats.headers import JS_MAX_HEADER_BYTES, header_block_bytes, message_headers
from outboxpg.relay.publishers import PermanentError

LIMIT = 1024 * 1024


def test_the_outbox_headers_come_first_and_row_headers_named_like_them_in_any_case_give_way() -> None:
    e = event(42, "shop.order.created", aggregate_id="o-7", msg_id="m-42", attempt=3,
              headers={"traceparent": "00-abc", "Outbox-Id": "forged", "outbox-id": "forged",
                       "OUTBOX-ATTEMPT": "9", "nats-msg-id": "forged", "X-Note": "Nats-Msg-Id: forged"})
    headers = message_headers(e, None, LIMIT)
    assert headers == {"Nats-Msg-Id": "m-42", "Outbox-Id": "42", "Outbox-Event-Type": "created",
                       "Outbox-Aggregate-Type": "order", "Outbox-Aggregate-Id": "o-7", "Outbox-Attempt": "3",
                       "traceparent": "00-abc", "X-Note": "Nats-Msg-Id: forged"}
    assert list(headers) == ["Nats-Msg-Id", "Outbox-Id", "Outbox-Event-Type", "Outbox-Aggregate-Type",
                             "Outbox-Aggregate-Id", "Outbox-Attempt", "traceparent", "X-Note"]
    # A dropped header's value is not looked at (nor counted): only what is sent.
    dropped = event(1, "x", headers={"outbox-event-type": "a\nb"})
    assert not isinstance(message_headers(dropped, None, LIMIT), PermanentError)


def test_cloudevents_attributes_replace_row_headers_of_the_same_name_in_any_case() -> None:
    e = event(1, "x", msg_id="m 1", created_at=datetime(2026, 11, 23, 18, 55, 42, 123456, tzinfo=UTC),
              headers={"CE-Type": "forged", "ce-dataschema": "https://shop.example/schema"})
    headers = message_headers(e, CloudEvents("outboxpg/shop"), LIMIT)
    assert not isinstance(headers, PermanentError)
    assert "CE-Type" not in headers and headers["ce-dataschema"] == "https://shop.example/schema"
    assert (headers["ce-type"], headers["ce-id"], headers["ce-time"]) == ("created", "m%201",
                                                                          "2026-11-23T18:55:42.123456Z")


@pytest.mark.parametrize("where", ["msg_id", "event_type", "aggregate_id", "header"])
def test_a_line_break_in_any_value_can_never_be_sent(where: str) -> None:
    e = event(1, "x", headers={"X-Note": "a\r\nb"}) if where == "header" else event(1, "x", **{where: "a\nb"})
    outcome = message_headers(e, None, LIMIT)
    assert isinstance(outcome, PermanentError)
    assert str(outcome) == "a header value contains a line break, which NATS headers cannot carry"


def test_a_message_over_max_payload_says_its_sizes() -> None:
    fits = message_headers(event(1, "x", payload=b"x" * 800), None, 1000)
    assert not isinstance(fits, PermanentError)
    h = header_block_bytes(fits)   # the same for every payload below
    exact = message_headers(event(1, "x", payload=b"x" * (1000 - h)), None, 1000)
    assert not isinstance(exact, PermanentError), "a message of exactly max_payload is sent"
    over = message_headers(event(1, "x", payload=b"x" * (1001 - h)), None, 1000)
    assert isinstance(over, PermanentError)
    assert str(over) == (f"message of 1001 bytes (payload {1001 - h}, headers {h}) exceeds the NATS server's "
                         "max_payload of 1000")


def test_headers_over_64_kib_can_never_be_sent_and_batch_headers_count() -> None:
    e = event(1, "x", headers={"X-Big": "v" * (JS_MAX_HEADER_BYTES - 250)})
    headers = message_headers(e, None, 0)
    assert not isinstance(headers, PermanentError) and header_block_bytes(headers) < JS_MAX_HEADER_BYTES
    room = JS_MAX_HEADER_BYTES - header_block_bytes(headers)
    assert not isinstance(message_headers(e, None, 0, extra=room), PermanentError)
    too_big = message_headers(e, None, 0, extra=room + 1)
    assert str(too_big) == "headers of 65536 bytes exceed JetStream's limit of 65535 (64 KiB)"


def _written_header_bytes(headers: dict[str, str], payload: bytes) -> int:
    """The header block's length in the HPUB command nats-py writes for this message."""
    sent: list[bytes] = []

    async def capture(cmd: bytes, priority: bool = False) -> None:
        sent.append(bytes(cmd))

    async def publish() -> None:
        nc = Client()
        nc._send_command = capture  # type: ignore[method-assign]
        await nc._send_publish("s", "_INBOX.r.1", payload, len(payload), headers)

    asyncio.run(publish())
    return int(sent[0].split(b"\r\n", 1)[0].split()[3])


_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=40)
_NAMES = st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,15}", fullmatch=True)


@given(headers=st.dictionaries(_NAMES, _TEXT, max_size=5), aggregate_id=_TEXT.filter(bool),
       payload=st.binary(max_size=600), max_payload=st.integers(200, 1200), cloudevents=st.booleans())
def test_what_is_sent_fits_and_what_is_refused_would_not(headers: dict[str, str], aggregate_id: str, payload: bytes,
                                                         max_payload: int, cloudevents: bool) -> None:
    """Against nats-py's own encoding: a message given headers fits max_payload as nats-py
    writes it (the quick bound never lets one through that does not), and one refused for its
    size would not have."""
    e = event(5, "x", aggregate_id=aggregate_id, headers=headers, payload=payload)
    ce = CloudEvents("outboxpg/shop") if cloudevents else None
    unchecked = message_headers(e, ce, 0)   # max_payload unknown: the headers, unchecked
    assert not isinstance(unchecked, PermanentError)
    written = _written_header_bytes(unchecked, payload)
    assert header_block_bytes(unchecked) == written
    outcome = message_headers(e, ce, max_payload)
    if isinstance(outcome, PermanentError):
        assert "exceeds the NATS server's max_payload" in str(outcome)
        assert written + len(payload) > max_payload
    else:
        assert outcome == unchecked and written + len(payload) <= max_payload
