"""outboxpg's error classes, and the one way an exception becomes text for a log line, a
command line's message or an event's last_error."""

from __future__ import annotations

__all__ = ["EXIT_CONNECT", "EXIT_FAILED", "EXIT_SCHEMA", "EXIT_USAGE", "CliError", "HandInstalled", "NotSent",
           "PermanentError", "PublisherNotFound", "describe", "first_line", "one_line"]

# Exit codes of both command lines: 1 a command failed or was refused, 2 cannot connect or bad
# input (argparse uses 2 for usage errors too), 3 the schema is missing or older than this version.
EXIT_FAILED, EXIT_CONNECT, EXIT_SCHEMA = 1, 2, 3
EXIT_USAGE = EXIT_CONNECT   # a flag, an environment variable or a setting that is not valid


class PermanentError(Exception):
    """Raise (or return) this from a publisher for an event that can never be published:
    the event is dead-lettered at once with the message as its reason, instead of retried."""


class NotSent(Exception):
    """The outcome a publisher gives an event it did not try to publish because an earlier event
    of its run failed (or the batch ran out of time first). The worker hands such events back
    with outbox_release (no attempt counted); the first failure of a run is what outbox_fail
    records."""


class PublisherNotFound(ValueError):
    """``load_publisher``: the module named in the spec does not exist on ``sys.path``."""


class HandInstalled(Exception):
    """The outbox schema is there, but yoyo has no record of it (installed with psql)."""


class CliError(Exception):
    """A failure a command line reports as one line, with exit code ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def describe(exc: BaseException, *, with_type: bool = True, whole: bool = False) -> str:
    """``exc`` as text: 'ValueError: its message' (``with_type``), only the message's first line
    unless ``whole`` (libpq's details follow on later lines); the class name alone when the
    exception has no message."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    if not whole:
        text = _every_host(text) or text.splitlines()[0].strip()
    return f"{type(exc).__name__}: {text}" if with_type else text


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its class name when it has no message."""
    return describe(exc, with_type=False)


_MULTI_HOST = "Multiple connection attempts failed. All failures were:"
_HOST_FAILED = "connection failed: "


def _every_host(text: str) -> str | None:
    """A multi-host DSN's connection error in one line: why each host failed (psycopg's first
    line names only the last one). None for any other text."""
    lines = text.splitlines()
    if _MULTI_HOST not in lines:
        return None
    reasons = [line.split(_HOST_FAILED, 1)[-1].strip() for line in lines[lines.index(_MULTI_HOST) + 1:]
               if line.startswith("- ")]
    return _HOST_FAILED + "; ".join(reasons) if reasons else None


def one_line(text: str) -> str:
    """A message of several lines as one: a multi-host connection error as _every_host puts it
    (after what preceded it on its first line), any other text with its lines joined by blanks."""
    every_host = _every_host(text)
    first = text.splitlines()[0] if text else ""
    if every_host is not None:
        cut = first.find(_HOST_FAILED)
        return (first[:cut] if cut >= 0 else first + " ") + every_host
    return " ".join(part.strip() for part in text.splitlines() if part.strip())
