"""An event as an MQTT 5 PUBLISH: its topic, its properties, whether it can be sent at all, and
what the broker's PUBACK says. The rules are outboxpg.sinks.mqtt's (its docstring); this module
only applies them, without a connection.

Strings. MQTT carries the topic and every user property as a UTF-8 string of at most 65535
bytes. Mosquitto (2.0) closes the connection of a client that sends one holding U+0000, a
control character (U+0001-U+001F, U+007F-U+009F) or a non-character (U+FDD0-U+FDEF, U+xFFFE,
U+xFFFF): every other event in flight on that connection would fail with it. Such a string is
refused here, before anything is sent (the MQTT 5 specification forbids U+0000 and lets a
server refuse the others).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from paho.mqtt.properties import Properties

from outboxpg.events import OutboxEvent
from outboxpg.relay.publishers import PermanentError

__all__ = ["MQTT_MAX_PACKET", "MSG_ID", "OUTBOX_PROPERTIES", "Message", "PublishProperties", "message_of",
           "puback_outcome", "publish_packet_bytes", "subject_of", "topic_of"]

# The user property that carries the event's msg_id (MQTT has no message id of its own that
# outlives a connection): a consumer deduplicates on it.
MSG_ID = "Outbox-Msg-Id"
OUTBOX_PROPERTIES = (MSG_ID, "Outbox-Id", "Outbox-Event-Type", "Outbox-Aggregate-Type", "Outbox-Aggregate-Id",
                     "Outbox-Attempt")
_TAKEN = frozenset(name.lower() for name in OUTBOX_PROPERTIES)
CONTENT_TYPE = "application/json"

# The largest packet MQTT can frame: a remaining length of at most 268,435,455 (four bytes of
# variable length integer) behind the one byte of packet type.
MQTT_MAX_PACKET = 1 + 4 + 268_435_455
_MAX_STRING = 65535

# What mosquitto refuses in a UTF-8 string (see the module's docstring).
_BAD_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\ufdd0-\ufdef\ud800-\udfff"
                        + "".join(f"{chr(plane << 16 | 0xFFFE)}{chr(plane << 16 | 0xFFFF)}" for plane in range(17))
                        + "]")

# PUBACK reason codes of 0x80 and up that no retry can fix: the event is dead-lettered at once.
# Every other one (0x80 unspecified, 0x83 implementation specific, 0x91 packet identifier in
# use, 0x97 quota exceeded, codes this list does not know) is retried with backoff.
PERMANENT_REASONS = {
    0x87: "not authorized",            # the broker's access list does not let this client publish to the topic
    0x90: "topic name invalid",
    0x95: "packet too large",
    0x99: "payload format invalid",
}
_NAMES = {0x80: "unspecified error", 0x83: "implementation specific error", 0x91: "packet identifier in use",
          0x97: "quota exceeded", **PERMANENT_REASONS}
NO_MATCHING_SUBSCRIBERS = 0x10


@dataclass(frozen=True, slots=True)
class Message:
    topic: str
    properties: PublishProperties


def topic_of(subject: str) -> str:
    """The event's subject as an MQTT topic: every '.' a level separator '/'."""
    return subject.replace(".", "/")


def subject_of(topic: str) -> str:
    """The subject an MQTT topic was made from (a consumer's way back; '/' in a subject is lost)."""
    return topic.replace("/", ".")


def _topic_problem(topic: str) -> str | None:
    if not topic:
        return "the subject is empty: an MQTT PUBLISH needs a topic"
    if "+" in topic or "#" in topic:
        return f"topic {topic!r} holds a wildcard character ('+' or '#'), which a PUBLISH topic cannot"
    if topic.startswith("$"):
        return f"topic {topic!r} starts with '$', which MQTT keeps for the broker's own topics ($SYS)"
    return None


def message_of(event: OutboxEvent, max_packet: int) -> Message | PermanentError:
    """The event's topic and PUBLISH properties, or why it can never be sent: a topic MQTT cannot
    publish to, a string mosquitto refuses, or a packet over ``max_packet`` bytes (the broker's
    Maximum Packet Size, or the sink's max_packet_size)."""
    topic = topic_of(event.subject)
    problem = _topic_problem(topic)
    if problem is not None:
        return PermanentError(problem)
    row_headers = event.headers
    if row_headers and any(k.lower() in _TAKEN for k in row_headers):
        # A row header named like one of ours, in any case, gives way.
        row_headers = {k: v for k, v in row_headers.items() if k.lower() not in _TAKEN}
    pairs = [(MSG_ID, event.msg_id), ("Outbox-Id", str(event.id)), ("Outbox-Event-Type", event.event_type),
             ("Outbox-Aggregate-Type", event.aggregate_type), ("Outbox-Aggregate-Id", event.aggregate_id),
             ("Outbox-Attempt", str(event.attempt))]
    if row_headers:
        pairs.extend((k, str(v)) for k, v in row_headers.items())
    strings = [topic, event.msg_id, event.event_type, event.aggregate_type, event.aggregate_id]
    if row_headers:
        strings.extend(k + str(v) for k, v in row_headers.items())
    joined = "".join(strings)
    # Printable ASCII (the usual case) holds none of them: str's own checks, without the regex.
    if not (joined.isascii() and joined.isprintable()) and _BAD_CHARS.search(joined):
        return PermanentError(_bad_string(topic, pairs))
    try:
        properties = PublishProperties(pairs)
    except StringTooLong as exc:
        return PermanentError(str(exc))
    topic_bytes = len(topic.encode())
    if topic_bytes > _MAX_STRING:
        return PermanentError(f"the topic is {topic_bytes} bytes long; an MQTT string holds at most {_MAX_STRING}")
    size = publish_packet_bytes(topic, properties, len(event.payload))
    if size > max_packet:
        return PermanentError(f"MQTT PUBLISH of {size} bytes (payload {len(event.payload)}) exceeds the broker's "
                              f"maximum packet size of {max_packet} bytes")
    return Message(topic, properties)


class StringTooLong(ValueError):
    pass


class PublishProperties(Properties):
    """The properties of the sink's PUBLISH: Content Type and the User Property pairs, encoded once.

    paho-mqtt's Properties builds its tables of every property anew for each instance and packs
    by looking each of them up: most of the CPU of a publish. paho only calls ``pack()`` on the
    properties it is given, so this subclass keeps the packed bytes and nothing else (it does not
    call Properties.__init__; read its pairs from ``pairs``). StringTooLong for a name or value
    over 65535 bytes."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        body = bytearray(_CONTENT_TYPE_PROPERTY)
        for name, value in pairs:
            name_bytes, value_bytes = name.encode(), value.encode()
            if len(name_bytes) > _MAX_STRING or len(value_bytes) > _MAX_STRING:
                what = f"the name of user property {name[:40]!r}" if len(name_bytes) > _MAX_STRING \
                    else f"user property {name[:40]!r}"
                size = max(len(name_bytes), len(value_bytes))
                raise StringTooLong(f"{what} is {size} bytes long; an MQTT string holds at most {_MAX_STRING}")
            body += _USER_PROPERTY
            body += len(name_bytes).to_bytes(2, "big")
            body += name_bytes
            body += len(value_bytes).to_bytes(2, "big")
            body += value_bytes
        object.__setattr__(self, "pairs", pairs)
        object.__setattr__(self, "_packed", _variable_int(len(body)) + bytes(body))

    def pack(self) -> bytes:
        packed: bytes = object.__getattribute__(self, "_packed")
        return packed

    def __str__(self) -> str:
        return f"[ContentType : {CONTENT_TYPE}, UserProperty : {object.__getattribute__(self, 'pairs')}]"


_USER_PROPERTY = b"\x26"   # the property identifier of a User Property (a UTF-8 string pair)
_CONTENT_TYPE_PROPERTY = b"\x03" + len(CONTENT_TYPE).to_bytes(2, "big") + CONTENT_TYPE.encode()


def _variable_int(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bad_string(topic: str, pairs: list[tuple[str, str]]) -> str:
    for what, s in [("topic", topic), *((f"user property {k[:40]!r}", k + v) for k, v in pairs)]:
        found = _BAD_CHARS.search(s)
        if found is not None:
            return (f"{what} holds the character U+{ord(found.group()):04X}, which MQTT brokers refuse in a "
                    "string (a control character, U+0000 or a non-character)")
    return "a string holds a character MQTT brokers refuse"   # not reached: the joined text had one


def publish_packet_bytes(topic: str, properties: PublishProperties, payload_bytes: int) -> int:
    """The size of a QoS 1 PUBLISH on the wire, as the broker compares it with its maximum packet
    size: fixed header, topic, packet identifier, properties, payload."""
    remaining = 2 + len(topic.encode()) + 2 + len(properties.pack()) + payload_bytes
    length_bytes = 1 if remaining < 128 else 2 if remaining < 16384 else 3 if remaining < 2097152 else 4
    return 1 + length_bytes + remaining


def puback_outcome(code: int, reason: str | None) -> BaseException | None:
    """What a PUBACK's reason code says: None for accepted (0x00 success, 0x10 no matching
    subscribers), a PermanentError for a refusal no retry can fix, else a failure to retry."""
    if code < 0x80:
        return None
    name = _NAMES.get(code, "error")
    text = f"the MQTT broker refused the message: {name} (0x{code:02X})"
    if reason:
        text += f": {reason[:200]}"
    if code in PERMANENT_REASONS:
        return PermanentError(text)
    return RuntimeError(text)
