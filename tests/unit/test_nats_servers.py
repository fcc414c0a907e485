"""parse_servers: the NATS URLs nats-py would take, and a one-line reason, without the password,
for one it would retry forever."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outboxpg.relay.nats.connection import parse_servers


def test_one_url_a_comma_separated_list_or_a_list() -> None:
    assert parse_servers("nats://127.0.0.1:4222") == ["nats://127.0.0.1:4222"]
    assert parse_servers(" nats://a:4222 , tls://user:pw@b.example:4443 ") == ["nats://a:4222",
                                                                                "tls://user:pw@b.example:4443"]
    assert parse_servers(["ws://[::1]:8080", "wss://c.example/"]) == ["ws://[::1]:8080", "wss://c.example/"]


@pytest.mark.parametrize(("urls", "says"), [
    ("", "the NATS URL is empty"),
    ("nats://a:4222,", "an empty server in the NATS URL list"),
    ("localhost:4222", "NATS URL 'localhost:4222' has no scheme: write it as nats://host:port (or tls://, ws://, wss://)"),
    ("nats://a:4222 nats://b:4222", "contains a space: separate several servers with commas"),
    ("nats://a:99999", "malformed NATS URL 'nats://a:99999': Port out of range 0-65535"),
    ("http://a:4222", "NATS URL 'http://a:4222' has the scheme 'http': use nats://, tls://, ws:// or wss://"),
    ("nats://a:4222;nats://b:4222", "malformed NATS URL"),
    ("nats://bad_host!:4222", "NATS URL 'nats://bad_host!:4222' has no valid host name"),
    ("nats://a:4222/x", "has a path, query or fragment: a server URL is scheme://[user:password@]host[:port]"),
    ("nats://a:4222,ws://b:8080", "the NATS URL list mixes websocket (ws://, wss://) and other servers: nats-py cannot"),
])
def test_a_malformed_url_is_one_line(urls: str, says: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_servers(urls)
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_the_password_is_never_shown() -> None:
    with pytest.raises(ValueError) as raised:
        parse_servers("nats://relay:s3cret@a:4222/path")
    assert "s3cret" not in str(raised.value) and "nats://***@a:4222/path" in str(raised.value)


_HOSTS = st.from_regex(r"[a-z][a-z0-9-]{0,10}(\.[a-z][a-z0-9-]{0,10}){0,2}", fullmatch=True)


@given(st.lists(st.tuples(st.sampled_from(["nats", "tls"]), _HOSTS, st.integers(1, 65535)), min_size=1, max_size=4))
def test_well_formed_lists_come_back_as_given(servers: list[tuple[str, str, int]]) -> None:
    urls = [f"{scheme}://{host}:{port}" for scheme, host, port in servers]
    assert parse_servers(",".join(urls)) == urls
    assert parse_servers(urls) == urls
