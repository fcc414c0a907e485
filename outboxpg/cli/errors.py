"""How the command lines fail: CliError, one line on stderr, and the exit codes of both commands."""

from __future__ import annotations

__all__ = ["EXIT_CONNECT", "EXIT_FAILED", "EXIT_SCHEMA", "EXIT_USAGE", "CliError"]

# Exit codes of both command lines: 1 a command failed or was refused, 2 cannot connect or bad
# input (argparse uses 2 for usage errors too), 3 the schema is missing or older than this version.
EXIT_FAILED, EXIT_CONNECT, EXIT_SCHEMA = 1, 2, 3
EXIT_USAGE = EXIT_CONNECT   # a flag, an environment variable or a setting that is not valid


class CliError(Exception):
    """A failure a command line reports as one line, with exit code ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code
