"""Options declared once (outboxpg.option) and read by the command lines (outboxpg.cli.options):
flag and variable names, defaults from the environment, values that do not parse; the worker's
own checks of its options; and the secrets no message may show."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import pytest

from outboxpg.cli.common import number_type, redact, restore_double_dash, secrets_of
from outboxpg.cli.errors import EXIT_USAGE, CliError
from outboxpg.cli.options import OneLineParser, add_options, env_name, flag_name, from_args
from outboxpg.cli.worker_sink import sink_secrets, url_secrets
from outboxpg.option import option
from outboxpg.relay.worker import WorkerConfig


@dataclass
class Options:
    dsn: str = option("the DSN", command_default="")
    batch_size: int = option("events per claim", 500)
    lease: float = option("seconds", 30.0)
    poll_only: bool = option("poll", False)
    level: str = option("log level", "INFO", choices=("INFO", "DEBUG"))
    ids: list[int] | None = option("event ids", None, flag="--id", environment=False)


def parse(argv: list[str]) -> Options:
    parser = OneLineParser(prog="tool")
    add_options(parser, Options)
    result: Options = from_args(Options, parser.parse_args(argv))
    return result


def test_a_field_is_a_flag_and_a_variable() -> None:
    by_name = {f.name: f for f in fields(Options)}
    assert [flag_name(by_name[n]) for n in ("batch_size", "ids")] == ["--batch-size", "--id"]
    assert env_name(by_name["poll_only"]) == "OUTBOXPG_POLL_ONLY"


def test_defaults_then_the_environment_then_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse([]) == Options(dsn="")
    monkeypatch.setenv("OUTBOXPG_BATCH_SIZE", "50")
    monkeypatch.setenv("OUTBOXPG_POLL_ONLY", " Yes ")
    monkeypatch.setenv("OUTBOXPG_IDS", "1,2")   # environment=False: not read
    assert parse([]) == Options(batch_size=50, poll_only=True, dsn="")
    assert parse(["--batch-size", "7", "--id", "5,7", "--id", "9", "--level", "DEBUG"]) == \
        Options(batch_size=7, poll_only=True, level="DEBUG", ids=[5, 7, 9], dsn="")


@pytest.mark.parametrize(("name", "value", "says"), [
    ("OUTBOXPG_BATCH_SIZE", "many", "OUTBOXPG_BATCH_SIZE: not a whole number: 'many'"),
    ("OUTBOXPG_LEASE", "1m", "OUTBOXPG_LEASE: not a number: '1m'"),
    ("OUTBOXPG_POLL_ONLY", "maybe", "OUTBOXPG_POLL_ONLY: not a yes/no value (1, true, yes, on; 0, false, no, off): "
                                    "'maybe'"),
    ("OUTBOXPG_LEVEL", "LOUD", "OUTBOXPG_LEVEL: must be one of INFO, DEBUG: 'LOUD'"),
])
def test_a_variable_that_does_not_parse_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, name: str, value: str,
                                                         says: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(CliError) as raised:
        parse([])
    assert (str(raised.value), raised.value.code) == (says, EXIT_USAGE)


def test_a_flag_that_does_not_parse_is_one_line_naming_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, says in ((["--id", "1,x"], "argument --id: not a comma-separated list of whole numbers: '1,x'"),
                       (["--nope"], "unrecognized arguments: --nope")):
        with pytest.raises(SystemExit) as raised:
            parse(argv)
        assert raised.value.code == EXIT_USAGE
        assert capsys.readouterr().err == f"tool: {says} (see tool --help)\n"


def test_number_types_and_the_double_dash() -> None:
    positive = number_type(int, "not a count: {!r}", lambda n: n > 0, "must be positive: {!r}")
    assert positive("3") == 3
    for text, says in (("x", "not a count: 'x'"), ("0", "must be positive: '0'")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            positive(text)
    args = argparse.Namespace(event_type=[], aggregate_id="a")
    restore_double_dash(args, ("event_type", "aggregate_id", "absent"))
    assert (args.event_type, args.aggregate_id) == ("--", "a")


@pytest.mark.parametrize(("changes", "says"), [
    ({"batch_size": 0}, "batch size must be at least 1"),
    ({"concurrency": 0}, "concurrency must be at least 1"),
    ({"poll_interval": 0}, "poll interval must be positive"),
    ({"xmin_check_interval": -1}, "xmin check interval must be 0 (never) or positive"),
    ({"publish_timeout": 0}, "publish timeout must be positive"),
    ({"standby_flushed": " any"}, "standby name ' any' has leading or trailing blanks"),
    ({"lease": 15, "publish_timeout": 10}, "lease (15s) must be at least twice the publish timeout (10s)"),
])
def test_the_worker_refuses_options_that_cannot_work(changes: dict[str, object], says: str) -> None:
    WorkerConfig(dsn="").validate()
    with pytest.raises(ValueError) as raised:
        WorkerConfig(dsn="", **changes).validate()  # type: ignore[arg-type]
    assert str(raised.value).startswith(says)


def test_every_form_of_a_password_is_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGPASSWORD", raising=False)
    assert secrets_of("host=db user=app password='p w%'") == ["p%20w%25", "p w%"]
    uri = secrets_of("postgresql://app:p%40ss@db/shop?sslmode=require")
    assert uri == ["p%2540ss", "p%40ss", "p@ss"], "as written, decoded and encoded; the longest first"
    monkeypatch.setenv("PGPASSWORD", "envpw")
    assert secrets_of("host=db") == ["envpw"]
    assert redact("connect as app:p@ss failed (p%40ss)", uri) == "connect as app:*** failed (***)"
    assert url_secrets("nats://relay:pw@a:4222, nats://tok3n@b:4222,nats://c:4222", token=True) == ["tok3n", "pw"]


@dataclass
class ListOptions:
    sink_option: list[str] | None = option("KEY=VALUE, repeatable", None)
    ids: list[int] | None = option("ids", None)


def test_a_list_from_the_environment_is_split_on_commas_as_the_flag_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOXPG_SINK_OPTION", "exchange=orders,qos=1")
    monkeypatch.setenv("OUTBOXPG_IDS", "5,7")
    parser = OneLineParser(prog="tool")
    add_options(parser, ListOptions)
    assert from_args(ListOptions, parser.parse_args([])) == ListOptions(["exchange=orders", "qos=1"], [5, 7])
    monkeypatch.setenv("OUTBOXPG_IDS", "5,x")
    with pytest.raises(CliError, match="OUTBOXPG_IDS: not a whole number: 'x'"):
        add_options(OneLineParser(prog="tool"), ListOptions)


def test_the_sink_url_and_the_webhook_secret_are_secrets() -> None:
    args = argparse.Namespace(sink="amqp://relay:p%40ss@rabbit:5672/", webhook_secret=b"whsec-1")
    assert sorted(sink_secrets(args)) == ["p%40ss", "p@ss", "whsec-1"]
    token = argparse.Namespace(sink="nats://s3cr3t-token@127.0.0.1:4222", webhook_secret=None)
    assert sink_secrets(token) == ["s3cr3t-token"]
    user_only = argparse.Namespace(sink="amqp://guest@rabbit/", webhook_secret=None)
    assert sink_secrets(user_only) == []   # a user name is not a secret (a NATS token is)
