"""The command lines: ``outboxpg`` (outboxpg.cli.outboxpg: migrate, sql, status, dead, maintain,
replay, demo; ``python -m outboxpg.cli``) and ``outboxpg-worker`` (outboxpg.cli.outboxpg_worker:
runs the relay), and what they share (errors: CliError and the exit codes; common: DSN,
connecting, one-line errors; options: flags and environment variables from one declaration;
render: plain-text tables). The relay never imports from here.
"""
