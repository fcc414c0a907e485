"""Command-line options built from their one declaration: a dataclass field made with
outboxpg.option.option() (type, default, help). Field ``batch_size`` becomes the flag
--batch-size and the environment variable OUTBOXPG_BATCH_SIZE; the flag wins over the
variable, the variable over the field's default. A value that does not parse, from either, is a
CliError: one line, exit 2."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from collections.abc import Sequence
from typing import Any, NoReturn

from outboxpg.cli.errors import EXIT_USAGE, CliError

__all__ = ["OneLineParser", "add_options", "env_name", "flag_name", "from_args"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def flag_name(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def env_name(f: dataclasses.Field[Any]) -> str:
    return "OUTBOXPG_" + f.name.upper()


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, exit 2, without the usage block:
    'tool: argument --x: ... (see tool sub --help)'. Its subcommands' parsers are of this class too
    (argparse makes them of the parent's class); an argument none of them knows is an error of the
    (sub)command it follows, so the hint names that one's --help."""

    def error(self, message: str) -> NoReturn:
        tool = self.prog.split()[0]   # a subcommand's prog is 'tool sub'
        print(f"{tool}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, unknown = super().parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed, unknown


def _parse(kind: type, text: str, where: str, choices: tuple[str, ...] | None) -> Any:
    if typing.get_origin(kind) is list:   # a list from the environment: comma-separated, as the flag takes it
        (item,) = typing.get_args(kind)
        return [_parse(item, part, where, choices) for part in text.split(",")] if text else None
    if kind is bool:
        if text.strip().lower() in _TRUE:
            return True
        if text.strip().lower() in _FALSE:
            return False
        raise CliError(f"{where}: not a yes/no value (1, true, yes, on; 0, false, no, off): {text!r}", EXIT_USAGE)
    if choices is not None and text not in choices:
        raise CliError(f"{where}: must be one of {', '.join(choices)}: {text!r}", EXIT_USAGE)
    try:
        return kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise CliError(f"{where}: not {what}: {text!r}", EXIT_USAGE) from None


def _list_of(kind: type) -> Any:
    """An argparse ``type=`` for a list field: '5,7' -> [5, 7] (the flag may be repeated too)."""
    what = "whole numbers" if kind is int else "values"

    def parse(text: str) -> list[Any]:
        try:
            return [kind(part) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma-separated list of {what}: {text!r}") from None
    return parse


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.metadata.get("command_default", dataclasses.MISSING) is not dataclasses.MISSING:
        return f.metadata["command_default"]
    if f.default is not dataclasses.MISSING:
        return f.default
    if callable(f.default_factory):
        return f.default_factory()
    return None


class _Repeat(argparse.Action):
    """Each use of the flag adds one value; the first use replaces the default (the
    environment's value): the flags win over the variable."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        current = getattr(namespace, self.dest, None)
        if current is self.default or current is None:
            current = []
        setattr(namespace, self.dest, [*current, values])


def add_options(parser: argparse.ArgumentParser, declared: type, leave_out: Sequence[str] = ()) -> None:
    """A flag for every field of the dataclass ``declared``, its default read from the
    environment now (a variable that does not parse raises CliError, also before --help: the
    help would show it as the default), unless the field says ``environment=False``. A
    ``list[X] | None`` field is a repeatable flag taking comma-separated values (one declared
    with ``repeat``: one value per flag, and one in its variable). ``leave_out``: fields that
    get no flag (another declaration gives the command its flag)."""
    hints = typing.get_type_hints(declared)
    for f in dataclasses.fields(declared):
        if f.name in leave_out:
            continue
        kind = hints[f.name]
        kind = next((k for k in typing.get_args(kind) if k is not type(None)), kind)   # str | None: str
        env = env_name(f)
        choices = f.metadata.get("choices")
        from_env = f.metadata.get("environment", True)
        text = os.environ.get(env) if from_env else None
        if f.metadata.get("repeat"):
            default = _default(f) if text is None else [text]
            parser.add_argument(flag_name(f), dest=f.name, action=_Repeat, default=default,
                                metavar=f.metadata.get("metavar"),
                                help=f"{f.metadata['help']} [{env}]" if from_env else f.metadata["help"])
            continue
        default = _default(f) if text is None else _parse(kind, text, env, choices)
        help = f"{f.metadata['help']} [{env}]" if from_env else f.metadata["help"]
        if kind is bool:
            parser.add_argument(flag_name(f), dest=f.name, action="store_true", default=default, help=help)
        elif typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            parser.add_argument(flag_name(f), dest=f.name, action="extend", type=_list_of(item), default=default,
                                metavar=f.metadata.get("metavar"), help=help)
        else:
            parser.add_argument(flag_name(f), dest=f.name, type=kind, default=default, choices=choices,
                                metavar=f.metadata.get("metavar"), help=help)


def from_args(declared: type, args: argparse.Namespace, **given: Any) -> Any:
    """An instance of the dataclass ``declared`` with the parsed values of its fields (``given``:
    values of fields that have no flag of their own, see add_options' ``leave_out``)."""
    return declared(**{f.name: given[f.name] if f.name in given else getattr(args, f.name)
                       for f in dataclasses.fields(declared)})
