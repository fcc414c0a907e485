"""yoyo_uri: any libpq connection string as the URI yoyo-migrations takes, every parameter kept."""

from __future__ import annotations

from urllib.parse import parse_qs, unquote, urlsplit

from hypothesis import given
from hypothesis import strategies as st

from outboxpg.schema import yoyo_uri


def parts(uri: str) -> tuple[str, str, dict[str, list[str]]]:
    u = urlsplit(uri)
    return u.scheme, unquote(u.path[1:]), parse_qs(u.query)


def test_key_value_and_uri_strings() -> None:
    assert parts(yoyo_uri("dbname=shop host=/run/postgresql user=app")) == (
        "postgresql+psycopg", "shop",
        {"host": ["/run/postgresql"], "user": ["app"], "fallback_application_name": ["outboxpg"]})
    assert parts(yoyo_uri("postgresql://app:pw@db:6432/shop?sslmode=require&application_name=mine")) == (
        "postgresql+psycopg", "shop",
        {"user": ["app"], "password": ["pw"], "host": ["db"], "port": ["6432"], "sslmode": ["require"],
         "application_name": ["mine"], "fallback_application_name": ["outboxpg"]})
    assert yoyo_uri("") == "postgresql+psycopg:///?fallback_application_name=outboxpg"


_VALUES = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FF, blacklist_characters="'\\"), min_size=1,
                  max_size=12)


@given(dbname=_VALUES, user=_VALUES, password=_VALUES)
def test_every_parameter_survives(dbname: str, user: str, password: str) -> None:
    dsn = f"dbname='{dbname}' user='{user}' password='{password}' host=db"
    assert parts(yoyo_uri(dsn)) == ("postgresql+psycopg", dbname, {
        "user": [user], "password": [password], "host": ["db"], "fallback_application_name": ["outboxpg"]})
