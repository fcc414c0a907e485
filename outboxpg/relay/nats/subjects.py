"""The subjects of the outbox's events, as the stream checks and ``outboxpg status`` name them:
the Subject record, whether a prefix captures a subject, and the one-line text about subjects no
stream captures. No nats-py here: ``outboxpg status`` imports this without loading the client
(streams.py, which talks to JetStream, builds on it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MAX_SUBJECTS", "Subject", "missing_text", "under_allowed", "under_prefix"]

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


def under_allowed(subject: str, prefixes: Sequence[str]) -> bool:
    """Whether ``subject`` is under one of ``prefixes`` (whole tokens), as the insert checks it."""
    return any(subject == p or under_prefix(subject, p) for p in prefixes)


def missing_text(missing: Sequence[Subject], what: str = "subject") -> str:
    """One line: 'billing.invoice.issued' (3 events), 'audit.x' (1 event), ... (at most 5 named)."""
    named = ", ".join(f"{s.subject!r} ({s.events} event{'' if s.events == 1 else 's'})" for s in missing[:5])
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    events = sum(s.events for s in missing)
    return (f"no JetStream stream captures the {what}{'' if len(missing) == 1 else 's'} of "
            f"{events} unfinished event{'' if events == 1 else 's'}: {named}{more}")
