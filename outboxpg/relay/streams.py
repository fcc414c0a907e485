"""Which subjects the outbox's events go to, and whether a JetStream stream captures each.

An event without a subject of its own goes to ``<subject_prefix>.<aggregate_type>.<event_type>``,
which a stream capturing ``<subject_prefix>.>`` takes. An event with an explicit subject
(``billing.invoice.issued``) needs a stream capturing that one: otherwise every publish of it is
answered "no responders" and the event dies after ``max_attempts``. The database names the
subjects of its unfinished events (``outbox_unfinished_subjects()``, migration 0015); JetStream
says which stream, if any, captures each. Used by the worker at start (``--ensure-stream`` adds
the explicit subjects; the stream check warns about those nothing captures) and by
``outboxpg status --nats-url``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import nats.js.errors
from nats.js import JetStreamContext

__all__ = ["MAX_SUBJECTS", "Subject", "explicit_to_add", "missing_text", "stream_for", "uncaptured",
           "under_prefix"]

# The most used subjects first; an outbox with more distinct subjects than this is checked on these.
MAX_SUBJECTS = 100


@dataclass(frozen=True)
class Subject:
    subject: str
    explicit: bool    # the event's own subject, not <subject_prefix>.<aggregate_type>.<event_type>
    events: int       # unfinished events (pending, processing, dead) going there


def under_prefix(subject: str, prefix: str) -> bool:
    """Whether ``<prefix>.>`` captures ``subject``."""
    return subject.startswith(prefix + ".")


async def stream_for(js: JetStreamContext, subject: str) -> str | None:
    """The stream that captures ``subject`` (a literal subject), or None."""
    try:
        return await js.find_stream_name_by_subject(subject)
    except nats.js.errors.NotFoundError:
        return None


async def uncaptured(js: JetStreamContext, subjects: Sequence[Subject]) -> list[Subject]:
    """The subjects no stream captures (one JetStream API request each)."""
    return [s for s in subjects if await stream_for(js, s.subject) is None]


async def explicit_to_add(js: JetStreamContext, prefix: str, subjects: Sequence[Subject]) -> list[str]:
    """The explicit subjects ``--ensure-stream`` adds to its stream: those ``<prefix>.>`` does not
    cover and no stream captures yet (a subject another stream has already must not be added:
    the server refuses streams whose subjects overlap)."""
    candidates = [s for s in subjects if s.explicit and not under_prefix(s.subject, prefix)]
    return [s.subject for s in await uncaptured(js, candidates)]


def missing_text(missing: Sequence[Subject], what: str = "subject") -> str:
    """One line: 'billing.invoice.issued' (3 events), 'audit.x' (1 event), ... (at most 5 named)."""
    named = ", ".join(f"{s.subject!r} ({s.events} event{'' if s.events == 1 else 's'})" for s in missing[:5])
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    events = sum(s.events for s in missing)
    return (f"no JetStream stream captures the {what}{'' if len(missing) == 1 else 's'} of "
            f"{events} unfinished event{'' if events == 1 else 's'}: {named}{more}")
