"""JetStream stream administration: which subjects the outbox's events go to and whether a
stream captures each, the check of the stream the worker publishes into (check_stream), and
creating or updating it (ensure_stream).

The subjects themselves (the Subject record, which prefix captures which) are in subjects.py.

An event without a subject of its own goes to ``<subject_prefix>.<aggregate_type>.<event_type>``,
which a stream capturing ``<subject_prefix>.>`` takes. An event with an explicit subject
(``billing.invoice.issued``) needs a stream capturing that one: otherwise every publish of it is
answered "no responders" and the event dies after ``max_attempts``. The database names the
subjects of its unfinished events (``outbox_unfinished_subjects()``, migration 0015); JetStream
says which stream, if any, captures each. Used by the worker at start (``--ensure-stream`` adds
the explicit subjects under ``outbox_settings.allowed_subject_prefixes``, never others: a subject
a producer wrote is no reason to widen a stream; the stream check warns about those nothing
captures, and the streams it finds are the ones whose acks the publisher counts at once) and by
``outboxpg status --nats-url``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from outboxpg.relay.nats.subjects import Subject, under_allowed, under_prefix

__all__ = ["check_stream", "ensure_stream", "explicit_to_add", "stream_for", "streams_for", "uncaptured"]


async def stream_for(js: JetStreamContext, subject: str) -> str | None:
    """The stream that captures ``subject`` (a literal subject), or None."""
    try:
        return await js.find_stream_name_by_subject(subject)
    except nats.js.errors.NotFoundError:
        return None


async def streams_for(js: JetStreamContext, subjects: Sequence[str]) -> dict[str, str | None]:
    """The stream that captures each subject, or None (one JetStream API request each)."""
    return {subject: await stream_for(js, subject) for subject in subjects}


async def uncaptured(js: JetStreamContext, subjects: Sequence[Subject]) -> list[Subject]:
    """The subjects no stream captures (one JetStream API request each)."""
    return [s for s in subjects if await stream_for(js, s.subject) is None]


async def explicit_to_add(js: JetStreamContext, prefix: str, subjects: Sequence[Subject],
                          allowed: Sequence[str]) -> list[str]:
    """The explicit subjects ``--ensure-stream`` adds to its stream: those under
    ``allowed`` (outbox_settings.allowed_subject_prefixes) that ``<prefix>.>`` does not cover and
    no stream captures yet (a subject another stream has already must not be added: the server
    refuses streams whose subjects overlap). A subject outside them (written before the insert
    refused it, or since disallowed) is never added: the stream stays what the operator allowed."""
    candidates = [s for s in subjects if s.explicit and not under_prefix(s.subject, prefix)
                  and under_allowed(s.subject, allowed)]
    return [s.subject for s in await uncaptured(js, candidates)]


async def check_stream(js: JetStreamContext, subject: str, needed_window: timedelta) -> list[str]:
    """Problems with the stream that would capture ``subject``, as human-readable lines."""
    name = await stream_for(js, subject)
    if name is None:
        return [f"no JetStream stream captures {subject!r}: every publish will fail until one does "
                f"(create one, e.g. with --ensure-stream NAME)"]
    info = await js.stream_info(name)
    window = info.config.duplicate_window or 0
    problems = []
    if window < needed_window.total_seconds():
        problems.append(
            f"stream {name!r} has a duplicate window of {window:g}s, shorter than lease + backoff cap "
            f"({needed_window.total_seconds():g}s): a re-published event could be stored twice")
    return problems


async def ensure_stream(js: JetStreamContext, name: str, subjects: list[str], window: timedelta,
                        atomic: bool = False) -> str:
    """Create stream ``name`` capturing ``subjects``, or update it to capture them with at least
    ``window`` of deduplication; with ``atomic`` (the server has atomic batch publish, see
    outboxpg.relay.nats.connection.supports_atomic_batch), also with allow_atomic. Returns what it did."""
    try:
        info = await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        await js.add_stream(StreamConfig(name=name, subjects=subjects, duplicate_window=window.total_seconds(),
                                         allow_atomic=True if atomic else None))
        return (f"created stream {name} subjects={subjects} duplicate_window={window.total_seconds():g}s"
                + (" allow_atomic=true" if atomic else ""))
    config = info.config
    want_subjects = sorted(set(config.subjects or []) | set(subjects))
    want_window = max(config.duplicate_window or 0, window.total_seconds())
    want_atomic = bool(config.allow_atomic) or atomic
    if (want_subjects == sorted(config.subjects or []) and want_window == (config.duplicate_window or 0)
            and want_atomic == bool(config.allow_atomic)):
        return (f"stream {name} already captures {subjects} with duplicate_window={want_window:g}s"
                + (" allow_atomic=true" if want_atomic else ""))
    config.subjects = want_subjects
    config.duplicate_window = want_window
    if want_atomic:
        config.allow_atomic = True
    await js.update_stream(config)
    return (f"updated stream {name} subjects={want_subjects} duplicate_window={want_window:g}s"
            + (" allow_atomic=true" if want_atomic else ""))
