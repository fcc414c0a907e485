"""CloudEvents binary content mode (outboxpg.cloudevents): an event's context attributes as ce-*
headers, their encoding, ce-time, the source. The messages as stored and parsed by the SDK:
tests/relay/test_cloudevents.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from urllib.parse import unquote
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st
from workers import event

from outboxpg.cloudevents import CONTENT_TYPE, HEADER_NAMES, SPEC_VERSION, CloudEvents, default_source


def test_the_attributes_come_from_the_columns_in_header_order() -> None:
    e = event(3, "x", msg_id="m-3", event_type="order.paid", aggregate_id="o-7",
              created_at=datetime(2026, 11, 23, 18, 55, 42, 5, tzinfo=UTC))
    headers = CloudEvents("https://shop.example/orders").headers(e)
    assert list(headers) == list(HEADER_NAMES)
    assert headers == {"ce-specversion": SPEC_VERSION, "ce-id": "m-3", "ce-source": "https://shop.example/orders",
                       "ce-type": "order.paid", "ce-subject": "o-7", "ce-time": "2026-11-23T18:55:42.000005Z",
                       "content-type": CONTENT_TYPE}


def test_values_are_percent_encoded_as_http_binary_mode_does() -> None:
    e = event(1, "x", msg_id='say "hi"', event_type="100%", aggregate_id="Zoë Ünal")
    headers = CloudEvents("outboxpg/shop").headers(e)
    assert (headers["ce-id"], headers["ce-type"], headers["ce-subject"]) == ("say%20%22hi%22", "100%25",
                                                                            "Zo%C3%AB%20%C3%9Cnal")


@given(st.text(min_size=1))
def test_an_encoded_value_is_printable_ascii_and_decodes_to_itself(value: str) -> None:
    encoded = CloudEvents("outboxpg/shop").headers(event(1, "x", aggregate_id=value))["ce-subject"]
    assert encoded.isascii() and encoded.isprintable() and " " not in encoded and '"' not in encoded
    assert unquote(encoded, errors="surrogatepass") == value


@given(st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.timezones()))
def test_ce_time_reads_back_as_the_same_moment(moment: datetime) -> None:
    text = CloudEvents("outboxpg/shop").time(moment)
    assert text.endswith("Z") and len(text) == len("2026-11-23T18:55:42.123456Z")
    assert datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC) - moment == timedelta(0)


def test_cloudevents_source_must_be_a_uri_reference() -> None:
    assert CloudEvents("https://shop.example/orders").source == "https://shop.example/orders"
    assert default_source("my shop") == "outboxpg/my%20shop"
    CloudEvents(default_source("my shop/é"))   # made a URI reference
    for bad in ("", "a b", "shöp", "x\ny"):
        with pytest.raises(ValueError, match="must be a non-empty URI reference"):
            CloudEvents(bad)


def test_ce_time_is_rfc_3339_in_utc_with_microseconds_whatever_the_time_zone() -> None:
    ce = CloudEvents("outboxpg/shop")
    times = [datetime(2026, 11, 23, 23, 59, 59, 999_999, tzinfo=timezone(timedelta(hours=-7))),
             datetime(2026, 11, 24, 6, 59, 59, 5, tzinfo=UTC),                 # the same second, from its cache
             datetime(2024, 2, 29, 0, 0, tzinfo=ZoneInfo("Europe/Berlin")),
             datetime(2026, 3, 29, 3, 30, 0, 1, tzinfo=ZoneInfo("Europe/Berlin"))]
    assert [ce.time(t) for t in times] == ["2026-11-24T06:59:59.999999Z", "2026-11-24T06:59:59.000005Z",
                                           "2024-02-28T23:00:00.000000Z", "2026-03-29T01:30:00.000001Z"]
