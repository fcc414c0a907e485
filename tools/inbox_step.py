"""Write the inbox's unreleased step, migrations/inbox/0001_inbox_1.sql and its rollback, from schema/inbox/.

  python tools/inbox_step.py           # write them
  python tools/inbox_step.py --check   # exit 1 when they are not what schema/inbox/ gives
"""

from __future__ import annotations

import sys

from outboxpg import sql_files


def main(argv: list[str]) -> int:
    upgrade, rollback = sql_files.inbox_first_step()
    base = sql_files.inbox_migrations_dir() / sql_files.INBOX_FIRST_STEP
    want = {base.with_suffix(".sql"): upgrade, base.with_name(base.name + ".rollback.sql"): rollback}
    stale = [p for p, text in want.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    if "--check" in argv:
        for p in stale:
            print(f"{p.name} is not what schema/inbox/ gives: run python tools/inbox_step.py", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.parent.mkdir(exist_ok=True)
        p.write_text(want[p], encoding="utf-8")
        print(f"wrote {p.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
