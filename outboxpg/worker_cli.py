"""Compatibility: the ``outboxpg-worker`` command lives in outboxpg.cli.outboxpg_worker."""

import sys

from outboxpg.cli.outboxpg_worker import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
