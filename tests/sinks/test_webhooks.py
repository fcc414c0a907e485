"""The signed webhooks sink (outboxpg.sinks.webhooks) against a real HTTP receiver (http_receiver.py,
which checks signatures by the spec, independently of the sink), and through a real Worker and
database."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import aiohttp
import pytest
from commands import WORKER
from http_receiver import Answer, HttpReceiver, Request
from standardwebhooks import Webhook
from workers import count_in, equals, event, start, wait_until

from outboxpg import enqueue
from outboxpg.relay.publishers import NotSent, PermanentError
from outboxpg.sinks import open_sink as open_any_sink
from outboxpg.sinks.base import SinkSettings
from outboxpg.sinks.webhook_signing import header_value, request_headers, signature, signing_key
from outboxpg.sinks.webhooks import MAX_HOLD, WebhookFailed, WebhookRefused, WebhookSink, open_sink, retry_after_seconds

KEY = b"0123456789abcdef0123456789abcdef"
SECRET = b"whsec_" + base64.b64encode(KEY)


def sink_for(url: str, timeout: float = 3.0, secret: bytes = SECRET, **options: str) -> WebhookSink:
    return open_sink(SinkSettings(url=url, options=options, publish_timeout=timeout, secret=secret))


@pytest.fixture
def receiver() -> Any:
    with HttpReceiver(KEY) as r:
        yield r


async def publish(sink: WebhookSink, events: list[Any]) -> list[BaseException | None]:
    await sink.start()
    try:
        return list(await sink.publish_batch(events))
    finally:
        await sink.close()


# -- signing and headers, checked against the Standard Webhooks reference library --------------

def test_signature_verifies_with_the_reference_library_for_whsec_and_raw_secrets() -> None:
    body = b'{"amount": 42, "note": "caf\xc3\xa9"}'
    ts = int(time.time())
    for secret, receiver_key in ((SECRET, SECRET.decode()), (b"whsec_" + base64.b64encode(KEY).rstrip(b"="), KEY),
                                 (b"a raw secret of its own\n", b"a raw secret of its own")):
        sig = signature(signing_key(secret), "m-1", ts, body)
        Webhook(receiver_key).verify(body, {"webhook-id": "m-1", "webhook-timestamp": str(ts),
                                            "webhook-signature": sig})
    with pytest.raises(ValueError, match="not base64") as bad:
        signing_key(b"whsec_not*base64!")
    assert "not*base64" not in str(bad.value)
    with pytest.raises(ValueError, match="empty"):
        signing_key(b"whsec_")


def test_header_values_that_could_break_a_request_are_percent_encoded_and_decode_back() -> None:
    for text in ("plain-id_1.2", "line\r\nInjected: yes", "nul\x00", " spaced ", "caf\u00e9 \u2028", "100%", ""):
        value = header_value(text)
        assert all(0x21 <= ord(c) <= 0x7E for c in value), value
        assert unquote(value) == text
    assert header_value("order-17") == "order-17"
    headers = request_headers(event(1, "outbox.order.created", headers={"Tenant": "a", "tenant": "b"}), KEY, 1)
    assert isinstance(headers, PermanentError) and "differ only in case" in str(headers)


def test_retry_after_takes_seconds_and_http_dates() -> None:
    now = time.time()
    assert retry_after_seconds("7") == 7.0
    assert retry_after_seconds(None) is None
    assert retry_after_seconds("soon") is None
    later = format_datetime(datetime.fromtimestamp(now, UTC) + timedelta(seconds=30), usegmt=True)
    assert 28 <= retry_after_seconds(later, now) <= 31   # type: ignore[operator]
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0


# -- open_sink: every usage error is one line ---------------------------------------------------

@pytest.mark.parametrize(("url", "options", "secret", "message"), [
    ("https://hooks.example/in", {}, None, "signs every request: give the signing secret in $OUTBOXPG_WEBHOOK_SECRET"),
    ("https://hooks.example/in", {}, b"  \n", "signs every request"),
    ("https://hooks.example/in", {"retries": "3"}, SECRET, "--sink-option retries: the webhooks sink takes"),
    ("https://hooks.example/in?connections=0", {"connections": "0"}, SECRET, "connections must be a whole number"),
    ("https:///in", {}, SECRET, "names no host"),
    ("https://u:pw@hooks.example:99999/in", {}, SECRET, "not a valid URL"),
    ("https://hooks.example/in", {"routes": "/nonexistent/routes"}, SECRET, "cannot read it: no such file"),
    ("https://hooks.example/in", {}, b"whsec_***", "not base64"),
])
def test_open_sink_refuses_in_one_line(url: str, options: dict[str, str], secret: bytes | None, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        open_any_sink(SinkSettings(url=url, options=options, secret=secret))
    text = str(exc.value)
    assert message in text and "\n" not in text
    assert "pw" not in text.replace("--sink", "")


def test_routes_file_errors_name_the_line(tmp_path: Path) -> None:
    routes = tmp_path / "routes"
    routes.write_text("# prefix  endpoint\noutbox.order http://127.0.0.1:1/o\noutbox.pay ftp://x/y\n")
    with pytest.raises(ValueError, match=r"routes=.*line 3: an endpoint is an http:// or https:// URL, not ftp"):
        sink_for("http://127.0.0.1:1/default", routes=str(routes))
    routes.write_text("outbox.order http://127.0.0.1:1/o extra\n")
    with pytest.raises(ValueError, match="line 1: a route is 'SUBJECT_PREFIX URL', got 3 fields"):
        sink_for("http://127.0.0.1:1/default", routes=str(routes))


# -- against a real receiver ------------------------------------------------------------------

async def test_a_2xx_is_an_ack_and_the_request_carries_the_signed_event(receiver: HttpReceiver) -> None:
    ev = event(7, "outbox.order.created", aggregate_id="o-\u00e9 17", payload=b'{"i": 7, "x": "\xc3\xa9"}',
               headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                        "Authorization": "Bearer forged", "webhook-signature": "v1,forged",
                        "x-note": "two\r\nlines"})
    url = receiver.url.replace("http://", "http://user:p%40ss@") + "?token=abc&connections=3"
    sink = sink_for(url)
    assert sink.connections == 3
    assert await publish(sink, [ev]) == [None]
    (req,) = receiver.accepted()
    assert req.path == "/hook?token=abc"            # the endpoint's own query, the sink's option taken out
    assert req.body == ev.payload
    assert req.header("webhook-id") == ev.msg_id
    assert req.header("content-type") == "application/json"
    assert req.header("authorization") == "Basic " + base64.b64encode(b"user:p@ss").decode()   # from the URL, not the row
    assert req.header("webhook-signature", ) != "v1,forged"
    assert (req.header("Outbox-Id"), req.header("Outbox-Attempt"), req.header("Outbox-Subject")) == (
        "7", "0", "outbox.order.created")
    assert unquote(req.header("Outbox-Aggregate-Id") or "") == "o-\u00e9 17"
    assert req.header("traceparent") == ev.headers["traceparent"]
    assert req.header("Outbox-Header-Authorization") == "Bearer%20forged"
    assert req.header("Outbox-Header-webhook-signature") == "v1,forged"
    assert unquote(req.header("Outbox-Header-x-note") or "") == "two\r\nlines"
    assert not [k for k, _ in req.headers if k.lower() == "injected"]
    # And the Standard Webhooks reference library accepts it as it came.
    assert Webhook(SECRET.decode()).verify(req.body, dict(req.headers)) == {"i": 7, "x": "\u00e9"}


async def test_4xx_is_permanent_with_status_and_body_and_the_rest_retry(receiver: HttpReceiver) -> None:
    statuses = {1: 400, 2: 404, 3: 413, 4: 408, 5: 409, 6: 425, 7: 429, 8: 500, 9: 503, 10: 302, 11: 204}

    def answer(req: Request) -> Answer:
        status = statuses[int(req.header("Outbox-Id") or 0)]
        body = b"amount: must be positive\nsecond line " + b"x" * 300 if status == 400 else b"no"
        if status == 204:
            body = b""   # a 204 has no body (RFC 9110): bytes after its head would be read as the next answer
        return Answer(status, body, {"Location": "http://elsewhere.example/x?sig=1"} if status == 302 else {})

    receiver.answer = answer
    sink = sink_for(receiver.url.replace("http://", "http://u:sekret@") + "?key=hidden", secret=SECRET)
    outcomes = await publish(sink, [event(i, "outbox.order.created") for i in statuses])
    by_id = dict(zip(statuses, outcomes))
    assert by_id[11] is None
    for i in (1, 2, 3):
        assert isinstance(by_id[i], WebhookRefused) and isinstance(by_id[i], PermanentError)
        assert by_id[i].status == statuses[i]   # type: ignore[union-attr]
    assert str(by_id[1]).startswith(f"HTTP 400 Bad Request from {receiver.url}: amount: must be positive second line xxx")
    assert str(by_id[1]).endswith("...") and len(str(by_id[1])) < 300
    for i in (4, 5, 6, 7, 8, 9, 10):
        assert isinstance(by_id[i], WebhookFailed) and not isinstance(by_id[i], PermanentError), i
        assert by_id[i].status == statuses[i]   # type: ignore[union-attr]
    assert "redirects are not followed (to http://elsewhere.example/x)" in str(by_id[10])
    for outcome in outcomes:
        assert not any(s in str(outcome) for s in ("sekret", "hidden", SECRET.decode(), "whsec"))
    assert len(receiver.requests) == len(statuses)     # nothing followed the redirect or was sent twice


async def test_runs_keep_order_and_go_in_parallel_up_to_the_connection_limit(receiver: HttpReceiver) -> None:
    receiver.answer = lambda req: Answer(200, delay=0.03)
    events = [event(i, "outbox.order.updated", aggregate_id=f"a{i % 8}") for i in range(1, 49)]
    outcomes = await publish(sink_for(receiver.url, connections="4"), events)
    assert outcomes == [None] * 48
    per_aggregate: dict[str, list[int]] = defaultdict(list)
    for req in receiver.accepted():
        per_aggregate[unquote(req.header("Outbox-Aggregate-Id") or "")].append(int(req.header("Outbox-Id") or 0))
    assert {k: sorted(v) for k, v in per_aggregate.items()} == per_aggregate
    assert len(per_aggregate) == 8
    assert receiver.most_in_flight == 4
    assert len(receiver.posted_on) == 4   # kept alive: 48 requests over 4 connections


async def test_a_run_stops_at_its_first_failure(receiver: HttpReceiver) -> None:
    receiver.answer = lambda req: Answer(500 if req.header("Outbox-Id") == "3" else 200)
    events = [event(i, "outbox.order.updated", aggregate_id="a" if i <= 5 else "b") for i in range(1, 9)]
    outcomes = await publish(sink_for(receiver.url), events)
    assert outcomes[:2] == [None, None] and isinstance(outcomes[2], WebhookFailed)
    assert all(isinstance(o, NotSent) for o in outcomes[3:5])
    assert outcomes[5:] == [None, None, None]
    assert sorted(int(r.header("Outbox-Id") or 0) for r in receiver.requests) == [1, 2, 3, 6, 7, 8]


async def test_retry_after_within_the_batch_is_waited_for_beyond_it_holds_the_host(receiver: HttpReceiver) -> None:
    first: list[float] = []

    def answer(req: Request) -> Answer:
        if req.header("Outbox-Id") == "1" and not first:
            first.append(req.at)
            return Answer(503, headers={"Retry-After": "1"})
        return Answer(200)

    receiver.answer = answer
    sink = sink_for(receiver.url, timeout=3.0)
    await sink.start()
    try:
        t0 = time.monotonic()
        batch = asyncio.ensure_future(sink.publish_batch([event(1, "outbox.a.b")]))
        while not first:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)   # the 503 reaches the sink
        # Another batch to the same host, meanwhile: it waits for the Retry-After too.
        assert await sink.publish_batch([event(2, "outbox.a.b")]) == [None]
        assert await batch == [None]
        assert time.monotonic() - t0 >= 1.0
        resent = [r for r in receiver.requests if r.header("Outbox-Id") == "1"]
        assert len(resent) == 2 and resent[1].at - resent[0].at >= 0.95
        assert [r for r in receiver.requests if r.header("Outbox-Id") == "2"][0].at - resent[0].at >= 0.95

        receiver.answer = lambda req: Answer(429, b"slow down", {"Retry-After": "600"})
        (outcome,) = await sink.publish_batch([event(3, "outbox.a.b")])
        assert isinstance(outcome, WebhookFailed) and outcome.retry_after == 600
        assert "HTTP 429 Too Many Requests" in str(outcome) and "Retry-After 600s" in str(outcome)
        sent = len(receiver.requests)
        t1 = time.monotonic()
        (held,) = await sink.publish_batch([event(4, "outbox.a.b")])
        assert time.monotonic() - t1 < 0.5
        assert isinstance(held, WebhookFailed) and "asked to wait" in str(held) and "over the publish timeout" in str(held)
        assert held.retry_after is not None and MAX_HOLD - 5 < held.retry_after <= MAX_HOLD
        assert len(receiver.requests) == sent                   # held back: not sent
    finally:
        await sink.close()


async def test_no_answer_within_the_publish_timeout_costs_the_batch_one_timeout(receiver: HttpReceiver) -> None:
    receiver.answer = lambda req: Answer(200, delay=5)
    events = [event(1, "outbox.a.b", aggregate_id="x"), event(2, "outbox.a.b", aggregate_id="x"),
              *(event(i, "outbox.a.b", aggregate_id=f"y{i}") for i in range(3, 8))]
    t0 = time.monotonic()
    outcomes = await publish(sink_for(receiver.url, timeout=0.5, connections="1"), events)
    assert time.monotonic() - t0 < 2
    assert isinstance(outcomes[0], WebhookFailed) and "no answer within the publish timeout of 0.5s" in str(outcomes[0])
    assert isinstance(outcomes[1], NotSent)
    # One connection: the other runs waited for it, and were not sent once the host had failed.
    for outcome in outcomes[2:]:
        assert isinstance(outcome, WebhookFailed)
        assert "not sent, an earlier request of this batch to this host failed: no answer within 0.5s" in str(outcome)
    assert len(receiver.requests) == 1


async def test_down_at_start_is_logged_not_fatal_and_delivery_resumes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="outboxpg.webhooks")
    receiver = HttpReceiver(KEY).start()
    receiver.stop()                                # a port that nothing listens on
    sink = sink_for(receiver.url.replace("http://", "http://u:sekret@"))
    await sink.start()
    try:
        assert [r.getMessage() for r in caplog.records if "event=webhook_unreachable" in r.getMessage()]
        assert "sekret" not in caplog.text
        (down,) = await sink.publish_batch([event(1, "outbox.a.b")])
        assert isinstance(down, WebhookFailed) and "ClientConnectorError: Cannot connect to host" in str(down) and "sekret" not in str(down)
        receiver.start()
        assert await sink.publish_batch([event(1, "outbox.a.b")]) == [None]
    finally:
        await sink.close()
        receiver.stop()


async def test_routes_send_each_subject_prefix_to_its_endpoint(receiver: HttpReceiver, tmp_path: Path) -> None:
    with HttpReceiver(KEY) as orders:
        routes = tmp_path / "routes"
        routes.write_text(f"# subject prefix -> endpoint\noutbox.order.  {orders.url}  # the order service\n")
        sink = sink_for(receiver.url, routes=str(routes))
        assert "(+1 routed by subject prefix)" in sink.describe()
        subjects = ["outbox.order.paid", "outbox.orders.paid", "outbox.order", "outbox.user.created"]
        assert await publish(sink, [event(i, s) for i, s in enumerate(subjects, 1)]) == [None] * 4
        # Different aggregates: posted in parallel, in either order.
        assert sorted(r.header("Outbox-Subject") or "" for r in orders.accepted()) == ["outbox.order", "outbox.order.paid"]
        assert sorted(r.header("Outbox-Subject") or "" for r in receiver.accepted()) == [
            "outbox.orders.paid", "outbox.user.created"]


async def test_proxies_from_the_environment_are_followed_with_their_credentials(
        receiver: HttpReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """$HTTP_PROXY (its user and password as Proxy-Authorization), and $NO_PROXY's hosts reached
    directly: the receiver stands in for the proxy, which gets the absolute URL."""
    monkeypatch.setenv("HTTP_PROXY", receiver.url.replace("http://", "http://pu:p%40w@").removesuffix("/hook"))
    monkeypatch.setenv("NO_PROXY", "direct.invalid")
    monkeypatch.delenv("http_proxy", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    sink = sink_for("http://u:pw@proxied.invalid:8080/in?token=t")
    assert await publish(sink, [event(1, "outbox.a.b")]) == [None]
    (req,) = receiver.accepted()
    assert req.path == "http://proxied.invalid:8080/in?token=t"
    assert req.header("Proxy-Authorization") == "Basic " + base64.b64encode(b"pu:p@w").decode()
    assert req.header("Authorization") == "Basic " + base64.b64encode(b"u:pw").decode()
    (direct,) = await publish(sink_for("http://direct.invalid/in", timeout=2.0), [event(2, "outbox.a.b")])
    assert isinstance(direct, WebhookFailed) and "direct.invalid" in str(direct)   # not through the proxy
    assert len(receiver.requests) == 1


async def test_through_a_worker_order_dead_letters_and_retries(dsn: str, conn: Any, fast_retries: None) -> None:
    refused_once: set[str] = set()

    def answer(req: Request) -> Answer:
        if req.header("Outbox-Aggregate-Id") == "flaky" and req.msg_id not in refused_once:
            refused_once.add(req.msg_id)
            return Answer(503, b"busy")
        return Answer(200)

    with HttpReceiver(KEY, max_body=2000) as receiver:
        receiver.answer = answer
        ids = [enqueue(conn, "order", f"o{i % 5}", "updated", {"i": i}) for i in range(40)]
        flaky = [enqueue(conn, "order", "flaky", "updated", {"n": n}) for n in range(3)]
        big = enqueue(conn, "order", "big", "created", {"blob": "x" * 5000})
        after_big = enqueue(conn, "order", "big", "updated", {})
        sink = open_sink(SinkSettings(url=receiver.url + "?connections=4", publish_timeout=2.0, secret=SECRET))
        running = start(dsn, sink, batch_size=20)
        await wait_until(lambda: equals(count_in(dsn, "published"), 43), 30, "43 events published")
        await wait_until(lambda: equals(count_in(dsn, "dead"), 1), 10, "the 413 dead")
        await running.stop()
        state, attempts, error = conn.execute("SELECT state, attempts, last_error FROM outbox WHERE id = %s",
                                              (big,)).fetchone()
        assert (state, attempts) == ("dead", 1)
        assert error.startswith("WebhookRefused: HTTP 413 Request Entity Too Large from http://127.0.0.1:")
        assert "payload too large for this receiver" in error and "whsec" not in error
        assert conn.execute("SELECT state FROM outbox WHERE id = %s", (after_big,)).fetchone() == ("pending",)
        assert conn.execute("SELECT max(attempts) FROM outbox WHERE aggregate_id = 'flaky'").fetchone() == (2,)
        stored = receiver.stored()
        assert sorted(int(r.header("Outbox-Id") or 0) for r in stored) == sorted(ids + flaky)
        per_aggregate: dict[str, list[int]] = defaultdict(list)
        for req in stored:
            per_aggregate[req.header("Outbox-Aggregate-Id") or ""].append(int(req.header("Outbox-Id") or 0))
        for aggregate, got in per_aggregate.items():
            assert got == sorted(got), aggregate
        msg_ids = dict(conn.execute("SELECT id, msg_id FROM outbox").fetchall())
        assert all(r.msg_id == msg_ids[int(r.header("Outbox-Id") or 0)] for r in stored)
        assert uuid.UUID(stored[0].msg_id)


async def test_a_request_that_is_not_signed_right_is_refused_by_the_receiver(receiver: HttpReceiver) -> None:
    """The receiver these tests use does check: a wrong key's signature is not accepted."""
    sink = sink_for(receiver.url, secret=b"another key")
    (outcome,) = await publish(sink, [event(1, "outbox.a.b")])
    assert isinstance(outcome, WebhookRefused) and outcome.status == 401
    async with aiohttp.ClientSession() as client:
        ok = request_headers(event(2, "outbox.a.b"), KEY, int(time.time()) - 3600)
        assert isinstance(ok, dict)
        async with client.post(receiver.url, data=b'{"i": 2}', headers=ok) as answer:
            assert answer.status == 401   # too old
    assert receiver.accepted() == []


# -- the example receiver ------------------------------------------------------------------------

RECEIVER = Path(__file__).resolve().parents[2] / "examples" / "webhook_receiver.py"


async def test_the_example_receiver_verifies_handles_each_event_once_and_refuses_forgeries() -> None:
    """examples/webhook_receiver.py, run as its docstring says, with a raw (not whsec_) secret."""
    raw = b"a raw secret, not whsec_"
    p = subprocess.Popen([sys.executable, str(RECEIVER), "--port", "0", "--max-body", "1000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "WEBHOOK_SECRET": raw.decode()})
    try:
        assert p.stdout is not None
        line = (await asyncio.to_thread(p.stdout.readline)).decode()
        assert line.startswith("listening on http://127.0.0.1:"), line
        url = line.split()[-1] + "hooks"
        sink = sink_for(url, secret=raw)
        first = event(1, "outbox.order.paid", aggregate_id="o 17\n", payload=b'{"amount": 42}')
        big = event(3, "outbox.order.paid", aggregate_id="o-3", payload=b'{"x": "' + b"x" * 1000 + b'"}')
        second = event(2, "outbox.order.paid", aggregate_id="o-2")
        outcomes = await publish(sink, [first, second, big])
        assert outcomes[:2] == [None, None]
        assert isinstance(outcomes[2], WebhookRefused) and outcomes[2].status == 413
        assert await publish(sink_for(url, secret=raw), [first]) == [None]                    # again: a duplicate
        (forged,) = await publish(sink_for(url, secret=b"another secret"), [first])
        assert isinstance(forged, WebhookRefused) and forged.status == 401
        assert "signature not verified: No matching signature found" in str(forged)
        async with aiohttp.ClientSession() as client:
            headers = request_headers(event(9, "outbox.a.b"), raw, int(time.time()))
            assert isinstance(headers, dict)
            async with client.post(url, data=b'{"i": 10}', headers=headers) as tampered:
                assert tampered.status == 401
    finally:
        p.terminate()
        out, err = await asyncio.to_thread(p.communicate, timeout=10)
    assert p.returncode == 0, err
    lines = out.decode().splitlines()
    handled = f"{first.msg_id} outbox.order.paid order/'o 17\\n' id=1 attempt=0 {{\"amount\": 42}}"
    assert sorted(lines[:2]) == sorted([f"event {handled}",
                                         f"event {second.msg_id} outbox.order.paid order/o-2 id=2 attempt=0 {{\"i\": 2}}"])
    assert lines[2:] == [f"duplicate {handled}"]
    assert err == b""


def test_the_worker_without_a_secret_exits_2_in_one_line() -> None:
    """outboxpg-worker --sink http://... and no secret: open_sink's usage error, before any connection."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "OUTBOXPG_"))}
    r = subprocess.run([WORKER, "--dsn", "host=127.0.0.1 port=1 dbname=nowhere", "--sink", "http://u:pw@127.0.0.1:1/h"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert (r.returncode, r.stdout, r.stderr.splitlines()) == (2, "", [
        "outboxpg-worker: the http:// sink signs every request: give the signing secret in $OUTBOXPG_WEBHOOK_SECRET "
        "or --webhook-secret-file"]), r.stderr
