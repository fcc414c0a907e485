"""Hostile values for the hostile-input tests: hypothesis strategies, an SQL-injection list, and
a model of which events the outbox must take, must refuse, or may do either with.

The model is deliberately one-sided where PostgreSQL's answer depends on the database: the
CHECK constraints use the regex classes [:space:] and [:cntrl:], which for characters beyond
ASCII follow the database's LC_CTYPE (U+2028 is a space under C.UTF-8 and not under C, for
instance). Such values are "either": taken and delivered exactly, or refused by the constraint.
"""

from __future__ import annotations

import json
import reprlib
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from functools import reduce
from typing import Any

import orjson
from hypothesis import strategies as st

# -- values ---------------------------------------------------------------------------------

INJECTIONS = [
    "'); DROP TABLE outbox; --",
    "Robert'); DROP TABLE hi_canary;--",
    "x' OR '1'='1",
    "'; DELETE FROM outbox WHERE ''='",
    "$$", "$$; DROP TABLE outbox; $$", "$q$ DROP TABLE outbox $q$",
    "%s", "%(x)s", "%%", "%", "_", "%_%",
    "{}", "{0}", "{x}", "{{}}",
    "\\", "\\\\", "\\'", "\\N", "\\.", "E'\\x00'",
    "'", "''", '"', '""', "`", ";", "--", "/*", "*/", "$1", "?", ":x",
    "\t", "a\tb", "a\nb", "a\r\nb",
    "NULL", "null", "None",
    "\u202e'; DROP TABLE outbox; --",
]

# Odd but storable characters: right-to-left text and marks, emoji (one with joiners), a BOM,
# non-ASCII spaces and line separators, C1 and ASCII controls, zero-width space, the last code
# point. NUL and lone surrogates come separately: PostgreSQL text cannot hold them.
ODD = ["\u202e", "\u200f", "\u05d0\u05d1\u05d2", "\u0627\u0644\u0639\u0631\u0628\u064a\u0629", "\U0001f600",
       "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\ufeff", "\u00a0", "\u2028", "\u2029", "\u0085", "\u3000",
       "\x7f", "\x1b", "\t", "\n", "\u200b", "\u00e9", "\u00df", "\U0010ffff", "\ue000"]
NUL, SURROGATES = "\x00", ["\ud800", "\udfff"]
SPECIAL = [".", "*", ">", " ", ":", "-", "_", "$", "'"]


def huge_text() -> st.SearchStrategy[str]:
    """Long strings around the byte limits (255, 1024) and far beyond them, in 1- to 4-byte characters."""
    lengths = st.sampled_from([63, 64, 127, 128, 255, 256, 341, 342, 1023, 1024, 1025, 5000]) | st.integers(1, 200_000)
    return st.builds(lambda ch, n: ch * n, st.sampled_from(["x", "\u00e9", "\u20ac", "\U0001f600"]), lengths)


def hostile_text(max_size: int = 30) -> st.SearchStrategy[str]:
    pieces = st.sampled_from(ODD + SPECIAL + [NUL, *SURROGATES, "a", "b", "1"])
    return st.one_of(
        st.text(st.characters(exclude_categories=()), max_size=max_size),   # any code point, surrogates too
        st.lists(pieces, min_size=1, max_size=12).map("".join),
        st.sampled_from(INJECTIONS),
        huge_text(),
    )


plain_token = st.from_regex(r"[a-z][a-z0-9_-]{0,15}", fullmatch=True)


def key_field() -> st.SearchStrategy[Any]:
    """aggregate_type / aggregate_id / event_type as a caller might pass them."""
    return st.one_of(plain_token, hostile_text(), st.none(), st.integers(), st.binary(max_size=5))


# Half of them under the tests' subject_prefix ('outbox'), where only the subject's own rules
# decide; the others are refused at insert whatever they hold (no other prefix is allowed).
subjects = st.one_of(
    st.none(),
    st.from_regex(r"[a-z]{1,6}(\.[a-z0-9]{1,6}){0,3}", fullmatch=True),
    st.lists(st.one_of(plain_token, hostile_text(8)), min_size=1, max_size=4).map(".".join),
    hostile_text(),
    st.from_regex(r"[a-z]{1,6}(\.[a-z0-9]{1,6}){0,3}", fullmatch=True).map("outbox.".__add__),
    st.lists(st.one_of(plain_token, hostile_text(8)), min_size=1, max_size=4).map(".".join).map("outbox.".__add__),
    hostile_text().map("outbox.".__add__),
)

header_maps = st.one_of(
    st.none(),
    st.dictionaries(st.one_of(st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,12}", fullmatch=True), st.just("Nats-Rollup"),
                              hostile_text(12)),
                    st.one_of(hostile_text(30), st.just("plain")), max_size=3),
    st.dictionaries(plain_token, st.one_of(st.integers(), st.none(), st.booleans(), st.lists(st.text(max_size=2))),
                    min_size=1, max_size=2),
    st.dictionaries(st.integers(), st.just("v"), min_size=1, max_size=1),
)

msg_ids = st.one_of(st.none(), st.uuids().map(str), hostile_text())

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                       st.floats(allow_nan=True, allow_infinity=True), hostile_text(20))
json_values = st.recursive(
    _json_leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(hostile_text(8), kids, max_size=4),
    max_leaves=15)


def _nest(depth: int, kind: str) -> Any:
    return reduce(lambda inner, _: {"a": inner} if kind == "dict" else [inner], range(depth), {})


payloads = st.one_of(
    st.dictionaries(hostile_text(8), json_values, max_size=5),
    st.lists(json_values, max_size=5),
    json_values.map(lambda v: json.dumps(v, ensure_ascii=False)),           # raw JSON text (NaN too)
    json_values.map(lambda v: json.dumps(v).encode()),                      # raw JSON bytes
    st.binary(max_size=64),                                                 # bytes, mostly not JSON
    st.text(max_size=20),                                                   # text, mostly not JSON
    st.builds(_nest, st.sampled_from([10, 250, 253, 254, 255, 300]), st.sampled_from(["dict", "list"])),
    st.sampled_from([10, 1000, 5000, 100_000]).map(lambda d: b"[" * d + b"]" * d),
    st.sampled_from([1_100_000, 2_500_000]).map(lambda n: {"blob": "x" * n}),  # over NATS' 1 MiB
    st.sampled_from([42, None, 1.5, (1, 2), {1: 2}, {"k": object()}]),
)


@dataclass(repr=False)
class Spec:
    aggregate_type: Any
    aggregate_id: Any
    event_type: Any
    payload: Any
    subject: Any = None
    headers: Any = None
    msg_id: Any = None

    def __repr__(self) -> str:   # short: some values are megabytes long
        r = reprlib.Repr()
        r.maxstring, r.maxother, r.maxlevel, r.maxdict, r.maxlist = 80, 80, 4, 6, 6
        return "Spec(" + ", ".join(f"{k}={r.repr(getattr(self, k))}" for k in self.__dataclass_fields__) + ")"

    def kwargs(self) -> dict[str, Any]:
        return {"subject": self.subject, "headers": self.headers, "msg_id": self.msg_id}


HOSTILE = {"aggregate_type": key_field(), "aggregate_id": key_field(), "event_type": key_field(), "payload": payloads,
           "subject": subjects, "headers": header_maps, "msg_id": msg_ids}
plain_payloads = st.dictionaries(plain_token, st.one_of(st.integers(-(2**53), 2**53), plain_token), max_size=3)


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    """A plain event with one to three fields made hostile (all seven hostile at once would be
    refused for one reason or another nearly every time, and show little)."""
    spec = Spec(draw(plain_token), draw(plain_token), draw(plain_token), draw(plain_payloads))
    for name in draw(st.lists(st.sampled_from(sorted(HOSTILE)), min_size=1, max_size=3, unique=True)):
        setattr(spec, name, draw(HOSTILE[name]))
    return spec


# -- the model ------------------------------------------------------------------------------

LIMITS = {"aggregate_type": 255, "aggregate_id": 1024, "event_type": 255, "msg_id": 255}
# outbox_settings' defaults: explicit subjects are refused at insert unless under subject_prefix
# (or allowed_subject_prefixes, empty here); payload and headers together at most
# max_event_bytes, counted as jsonb (pg_column_size).
SUBJECT_PREFIX = "outbox"
MAX_EVENT_BYTES = 1_000_000
# The insert trigger's refusals name the setting in the message, not a constraint.
SETTINGS_REFUSALS = ("max_event_bytes", "allowed_subject_prefixes")
CONSTRAINTS = {"outbox_aggregate_type_not_blank", "outbox_aggregate_id_not_blank", "outbox_event_type_not_blank",
               "outbox_msg_id_not_blank", "outbox_subject_is_valid_nats_subject", "outbox_headers_are_string_map"}


@dataclass
class Verdict:
    refused: list[str] = field(default_factory=list)   # reasons it must be refused
    unsure: list[str] = field(default_factory=list)    # reasons the database may go either way

    @property
    def outcome(self) -> str:
        return "refused" if self.refused else "either" if self.unsure else "stored"


def _bad_text(s: str) -> str | None:
    if NUL in s:
        return "NUL"
    if any("\ud800" <= c <= "\udfff" for c in s):
        return "surrogate"
    return None


def _locale_dependent(c: str) -> bool:
    """A non-ASCII character that a [:space:] or [:cntrl:] class may or may not match."""
    return ord(c) > 127 and (unicodedata.category(c)[0] in "CZ" or c in "\u0085")


def _ascii_bad(c: str, also: str) -> bool:
    return ord(c) < 32 or ord(c) == 127 or c in " " + also


def _token_verdict(s: str, v: Verdict, what: str, also: str = ".*>") -> None:
    """A string that must be free of ASCII whitespace, controls and ``also``."""
    if s == "" or any(_ascii_bad(c, also) for c in s):
        v.refused.append(what)
    elif any(_locale_dependent(c) for c in s):
        v.unsure.append(what)


def _subject_verdict(subject: str, v: Verdict) -> None:
    if subject.split(".")[0] != SUBJECT_PREFIX:
        # Refused whatever else it holds: by the domain, or else by the insert trigger (the
        # tests allow no other prefix).
        v.refused.append(f"subject outside subject_prefix {SUBJECT_PREFIX!r} and allowed_subject_prefixes")
        return
    if len(subject.encode("utf-8", "surrogatepass")) > 1024:
        v.refused.append("subject over 1024 bytes")
        return
    if subject.startswith("$") or subject.split(".")[0] == "_INBOX":
        v.refused.append("subject in the server's $ namespaces ($JS.API..., $SYS...) or _INBOX")
        return
    for token in subject.split("."):
        _token_verdict(token, v, "subject", also="*>")


def _strings(value: Any) -> Iterator[str]:
    """Every string in a parsed JSON value, keys too."""
    stack = [value]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            yield x
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


def _json_bad(value: Any) -> str | None:
    """What PostgreSQL's jsonb refuses in a parsed JSON value: NUL and lone surrogates in strings."""
    return next(filter(None, map(_bad_text, _strings(value))), None)


def _string_bytes(value: Any) -> int:
    """The UTF-8 bytes of every string (keys too) in a parsed JSON value: a lower bound of its
    jsonb size, which stores each string's bytes as they are."""
    return sum(len(x.encode("utf-8", "surrogatepass")) for x in _strings(value))


def _size_verdict(payload: Any, headers: Any, v: Verdict) -> None:
    """Over max_event_bytes for sure (its strings alone are), near it (jsonb's own overhead
    decides: either), or well under. Called for a payload and headers that are otherwise fine."""
    if isinstance(payload, (bytes, str)):
        text = payload.encode() if isinstance(payload, str) else payload
        parsed = json.loads(text)
    else:
        text, parsed = orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS), payload
    head = orjson.dumps(headers or {})
    if _string_bytes(parsed) + _string_bytes(headers or {}) > MAX_EVENT_BYTES:
        v.refused.append("payload and headers over max_event_bytes")
    elif len(text) + len(head) > MAX_EVENT_BYTES // 2:
        v.unsure.append("payload and headers near max_event_bytes")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def payload_verdict(payload: Any, v: Verdict) -> None:
    if isinstance(payload, (dict, list)):
        try:   # keys that are not strings are written as their JSON text (docs/reference/python.md)
            text = orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)
        except TypeError:
            v.refused.append("payload orjson cannot encode")
            return
        if b"\\u0000" in text:
            v.refused.append("payload with NUL")
        return
    if isinstance(payload, (bytes, str)):
        if isinstance(payload, bytes):
            try:
                payload = payload.decode("utf-8")
            except UnicodeDecodeError:
                v.refused.append("payload not UTF-8")
                return
        if r := _bad_text(payload):
            v.refused.append(f"payload text with {r}")
            return
        try:
            parsed = json.loads(payload, parse_constant=_no_constant)
        except RecursionError:
            v.unsure.append("payload nested too deep for this model")
            return
        except ValueError:
            v.refused.append("payload not JSON")
            return
        if r := _json_bad(parsed):
            v.refused.append(f"payload JSON with {r}")
        elif payload.count("[") > 900:
            v.unsure.append("payload nested deeper than PostgreSQL's stack may allow")
        return
    v.refused.append("payload of another type")


def verdict(spec: Spec) -> Verdict:
    v = Verdict()
    keys = {}
    for name in ("aggregate_type", "aggregate_id", "event_type"):
        value = getattr(spec, name)
        if value is None or isinstance(value, bytes):
            v.refused.append(f"{name} {type(value).__name__}")
            continue
        s = keys[name] = str(value)
        if r := _bad_text(s):
            v.refused.append(f"{name} {r}")
        elif s == "" or len(s.encode()) > LIMITS[name]:
            v.refused.append(f"{name} blank or too long")
    if spec.msg_id is not None:
        if r := _bad_text(spec.msg_id):
            v.refused.append(f"msg_id {r}")
        elif spec.msg_id == "" or len(spec.msg_id.encode()) > LIMITS["msg_id"]:
            v.refused.append("msg_id blank or too long")
    if spec.subject is not None:
        if r := _bad_text(spec.subject):
            v.refused.append(f"subject {r}")
        else:
            _subject_verdict(spec.subject, v)
    if "aggregate_type" in keys and "event_type" in keys and not v.refused:
        # Both name the default subject p.<aggregate_type>.<event_type>, so both must be subject
        # tokens (any length), subject of its own or not: dots inside either make more tokens,
        # which is fine as long as none is empty.
        for token in f"p.{keys['aggregate_type']}.{keys['event_type']}".split("."):
            _token_verdict(token, v, "default subject", also="*>")
    if spec.headers is not None:
        if any(not isinstance(k, str) for k in spec.headers):
            v.refused.append("header name not a str")
        elif any(_bad_text(k) or _bad_text(x) for k, x in spec.headers.items() if isinstance(x, str)) or \
                any(_bad_text(k) for k in spec.headers):
            v.refused.append("header with NUL or surrogate")
        elif any(not isinstance(x, str) for x in spec.headers.values()):
            v.refused.append("header value not a string")
        else:
            for k in spec.headers:
                if k.lower().startswith("nats-"):
                    v.refused.append("header name in NATS's own Nats- namespace")
                _token_verdict(k, v, "header name", also=":")
    payload_verdict(spec.payload, v)
    if not v.refused and not any(r.startswith("payload") for r in v.unsure):
        _size_verdict(spec.payload, spec.headers, v)
    return v


def same_json(written: str, stored: str) -> bool:
    """The JSON value written equals the one stored, numbers compared as decimals: jsonb keeps
    numbers exactly but spells them its own way (1e300 comes back as 1 and 300 zeros)."""
    try:
        a = json.loads(written, parse_float=Decimal, parse_int=Decimal)
        b = json.loads(stored, parse_float=Decimal, parse_int=Decimal)
    except RecursionError:   # deep nesting of empty containers only: compare the spelling
        return written.replace(" ", "") == stored.replace(" ", "")
    return bool(a == b)
