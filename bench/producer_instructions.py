"""Producer cost in CPU instructions, free of the machine's noise: instructions per one-event
INSERT transaction, for several revisions of the schema side by side.

    .venv/bin/python bench/producer_instructions.py                       # 3451e34 against the working tree
    .venv/bin/python bench/producer_instructions.py --rev 3451e34 --rev ff4a26e --rev WORKTREE

Each revision's migrations/ (git archive; WORKTREE: the working tree) are installed with psql
into a database of its own, in a throwaway PostgreSQL cluster this command makes (initdb, run as
user postgres) in a temp dir. The cluster is then stopped and a single-user backend (postgres
--single) runs under valgrind --tool=callgrind, twice per revision: N1 and N2 times
`EXECUTE ins(...)` of a PREPAREd INSERT of one event (as pgbench -M prepared sends it; each
statement commits on its own in single-user mode). (Ir(N2) - Ir(N1)) / (N2 - N1) is the cost of
one transaction, start-up cost taken out. Aggregates cycle over 1,000 ids.

Instructions are not time: fsync, lock waits and cache misses are left out. They are the figure
that does not move when other processes share the machine; pgbench (bench/key_mix.py --only 5)
gives the throughput under the noise. Needs valgrind, PostgreSQL's server binaries (pg_config
--bindir or /usr/lib/postgresql/*/bin) and root (to run the cluster as postgres). Removes its
temp dir on exit.
"""

from __future__ import annotations

import argparse
import glob
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# postgres --single -j ends a command at ";" followed by an empty line: one transaction each.
INSERT = ("PREPARE ins(text) AS INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
          "VALUES ('order', $1, 'created', '{\"n\":1}');\n\n")


def bindir() -> Path:
    try:
        return Path(subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True,
                                   check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
        if not found:
            sys.exit("producer_instructions: no PostgreSQL server binaries found")
        return Path(found[-1]).parent


def as_postgres(*cmd: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", "postgres", "--", *cmd], text=True, **kw)  # type: ignore[call-overload]


def migrations_of(rev: str, into: Path) -> Path:
    if rev == "WORKTREE":
        return ROOT / "migrations"
    into.mkdir()
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "migrations"],
                         capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    return into / "migrations"


def instructions(bin_: Path, data: Path, db: str, n: int) -> int:
    script = INSERT + "".join(f"EXECUTE ins('{i % 1000}');\n\n" for i in range(n))
    p = as_postgres("valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                    str(bin_ / "postgres"), "--single", "-D", str(data), "-j", db,
                    input=script, capture_output=True)
    m = re.search(r"Collected : (\d+)", p.stderr)
    if not m:
        sys.exit(f"producer_instructions: callgrind gave no total for {db}:\n{p.stderr[-1500:]}")
    return int(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", action="append", help="a git revision, or WORKTREE (default: 3451e34 and WORKTREE)")
    ap.add_argument("--n1", type=int, default=100)
    ap.add_argument("--n2", type=int, default=600)
    args = ap.parse_args()
    revs = args.rev or ["3451e34", "WORKTREE"]
    if shutil.which("valgrind") is None:
        sys.exit("producer_instructions: needs valgrind (apt-get install valgrind)")
    bin_ = bindir()
    tmp = Path(tempfile.mkdtemp(prefix="outboxpg-ir-"))
    tmp.chmod(0o777)
    data = tmp / "data"
    try:
        as_postgres(str(bin_ / "initdb"), "-D", str(data), "-A", "trust", capture_output=True, check=True)
        sock = str(tmp)
        as_postgres(str(bin_ / "pg_ctl"), "-D", str(data), "-o", f"-p 5433 -k {sock} -c listen_addresses=''",
                    "-l", str(tmp / "log"), "-w", "start", capture_output=True, check=True)
        try:
            for i, rev in enumerate(revs):
                db = f"rev{i}"
                as_postgres(str(bin_ / "createdb"), "-h", sock, "-p", "5433", db, check=True)
                steps = migrations_of(rev, tmp / f"m{i}")
                for f in sorted(steps.glob("[0-9]*.sql")):
                    if not f.name.endswith(".rollback.sql"):
                        as_postgres("psql", "-q", "-X", "-v", "ON_ERROR_STOP=1", "-h", sock, "-p", "5433",
                                    "-d", db, "-f", str(f), capture_output=True, check=True)
        finally:
            as_postgres(str(bin_ / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop", capture_output=True)
        base = None
        print(f"instructions per one-event INSERT transaction (callgrind, (Ir({args.n2}) - Ir({args.n1})) / "
              f"{args.n2 - args.n1}):")
        for i, rev in enumerate(revs):
            per = (instructions(bin_, data, f"rev{i}", args.n2) - instructions(bin_, data, f"rev{i}", args.n1)) \
                / (args.n2 - args.n1)
            base = base or per
            print(f"  {rev:<12} {per:10,.0f}   {100 * (per / base - 1):+6.1f}% against {revs[0]}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
