"""Test helpers for JetStream: a stream per test, and reading back what it holds."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamConfig


@dataclass
class StreamHandle:
    nc: Client
    js: JetStreamContext
    name: str
    prefix: str


async def make_stream(url: str, duplicate_window: float = 600.0) -> StreamHandle:
    """A fresh stream capturing '<prefix>.>' for a unique prefix (set it as subject_prefix)."""
    tag = uuid.uuid4().hex[:10]
    nc = await nats.connect(url)
    js = nc.jetstream()
    name, prefix = f"T{tag}", f"t{tag}"
    await js.add_stream(StreamConfig(name=name, subjects=[f"{prefix}.>"], duplicate_window=duplicate_window))
    return StreamHandle(nc, js, name, prefix)


@dataclass
class StoredMsg:
    seq: int
    subject: str
    msg_id: str
    outbox_id: int
    aggregate: str
    data: bytes


async def read_stream(handle: StreamHandle) -> list[StoredMsg]:
    """Every message in the stream, in stream order."""
    info = await handle.js.stream_info(handle.name)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        m = await handle.js.get_msg(handle.name, seq)
        h = m.headers or {}
        out.append(StoredMsg(seq=m.seq, subject=m.subject, msg_id=h["Nats-Msg-Id"], outbox_id=int(h["Outbox-Id"]),
                             aggregate=f'{h["Outbox-Aggregate-Type"]}/{h["Outbox-Aggregate-Id"]}', data=m.data))
    return out
