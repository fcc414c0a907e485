"""option(): how an option is declared, once, as a dataclass field with its type, default and
help. The relay's WorkerConfig and the command lines' own option classes are made of these;
outboxpg.cli.options builds each one's flag and environment variable from the field."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, field
from typing import Any

__all__ = ["option"]


def option(help: str, default: Any = MISSING, *, default_factory: Callable[[], Any] | Any = MISSING,
           metavar: str | None = None, choices: Sequence[str] | None = None,
           command_default: Any = MISSING, flag: str | None = None, environment: bool = True,
           repeat: bool = False) -> Any:
    """A dataclass field that is also a command-line option. ``command_default``: the command's
    default where the field has none (WorkerConfig's dsn is required; the command's is '',
    libpq's PG* variables). ``flag``: the flag when it is not the field's name (--id for
    ``ids``); ``environment``: False where a value left in the environment must not act (the
    filters of a command that changes events). ``repeat``: a ``list[str]`` field whose flag is
    repeated, one value each, never split (a DSN may hold commas); its variable holds one value."""
    metadata = {"help": help, "metavar": metavar, "choices": tuple(choices) if choices else None,
                "command_default": command_default, "flag": flag, "environment": environment,
                "repeat": repeat}
    return field(default=default, default_factory=default_factory, metadata=metadata)
