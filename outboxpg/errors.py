"""Turning exceptions into the one-line messages logs and command lines show."""

from __future__ import annotations

__all__ = ["first_line"]


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (libpq's details follow on later lines),
    or its class name when it has no message."""
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__
