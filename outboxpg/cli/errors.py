"""How the command lines fail: CliError, one line on stderr, and the exit codes of both commands.

One table for ``outboxpg`` and ``outboxpg-worker`` (docs/reference/cli.md shows it):

  0  done
  1  the command failed or was refused (a database error, no permission, a "no" at the prompt)
  2  usage: a flag, an argument, an environment variable or a connection string that is not valid,
     or a command that writes without a named database; caught before connecting
  3  cannot connect: PostgreSQL cannot be reached or refuses the login, a server is not the
     kind the flag names (--nats-url pointing at something that is not NATS), or the --sink
     server cannot be reached or refuses the login
  4  the outbox schema is missing from the database, or older than this version
  5  the broker cannot take the events: JetStream is off, or no stream captures the outbox's
     subjects, or the --sink server refuses them (no exchange, no permission) (outboxpg-worker only)
  130 interrupted (Ctrl-C)
"""

from __future__ import annotations

__all__ = ["EXIT_BROKER", "EXIT_CONNECT", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_SCHEMA",
           "EXIT_USAGE", "EXIT_CODES", "CliError"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CONNECT, EXIT_SCHEMA, EXIT_BROKER = 0, 1, 2, 3, 4, 5
EXIT_INTERRUPTED = 130

# The table as the commands' --help epilog and the reference show it.
EXIT_CODES = ("Exit codes: 0 done, 1 failed or refused, 2 bad usage, 3 cannot connect, "
              "4 outbox schema missing or not up to date, 5 the broker cannot take the events (worker), "
              "130 interrupted.")


class CliError(Exception):
    """A failure a command line reports as one line, with exit code ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code
