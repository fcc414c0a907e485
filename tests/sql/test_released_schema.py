"""Releases (docs/migrations.md): schema/ is the current schema, written once; a release is one
step produced from it (tools/schema_step.py), frozen once released.

Why frozen: yoyo knows an applied step by its id alone (the sha256 of the file name,
yoyo.migrations.get_migration_hash), never by its content. A step edited after a release is not
applied again to a database that has it: `outboxpg migrate` says "schema is up to date" on the old
schema, and neither `require_schema` nor the worker's start-up check (both look for the functions
by name and signature) can notice. So:

  * migrations/RELEASED lists every released file (a step and its rollback) with its sha256 and
    its release, and the commit the release's annotated tag points at. A released file that
    changes fails test_released_files_are_unchanged.
  * every released file at the tag (or, when the clone has no tag, at the recorded commit) has
    the recorded checksum: RELEASED cannot be edited along with a file to hide the change.
  * a step's `-- depends:` header names (directly or through the steps it names) every earlier
    step whose objects its SQL uses, and only earlier steps: yoyo orders and rolls back by those
    headers, psql by the file order, and both orders must work.
  * the unreleased step, if any, is what tools/schema_step.py produces from schema/ now, and
    there is one exactly when schema/ differs from the released steps.
  * SECURITY DEFINER and the SET clauses of every outbox_* function are pinned in
    outboxpg/sql_api.py (a function written without them would run as its caller).
  * a database installed from each release (its files, read from git), with events in every
    state, migrated with `outboxpg migrate`, has the catalog of a fresh install (outboxpg.catalog:
    functions with definitions and settings, tables, columns, indexes, storage, triggers,
    constraints, domains, views, comments, grants), and its events are still delivered; rolling
    the newest step back gives the catalog of the release before it, with its runs in flight
    still held.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from catalog import catalog, differences
from yoyo import get_backend, read_migrations

from outboxpg import schema, sql_api, sql_files
from outboxpg.sql_files import Release, releases

ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS = ROOT / "migrations"
RELEASED = MIGRATIONS / "RELEASED"


# -- migrations/RELEASED ------------------------------------------------------------------------

def released_files() -> dict[str, tuple[str, str]]:
    """Every released file -> (its sha256, its release)."""
    return {f: (digest, r.name) for r in releases() for f, digest in r.files.items()}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def step_of(filename: str) -> str:
    return filename.removesuffix(".sql").removesuffix(".rollback")


def git(*args: str) -> bytes | None:
    """git's stdout, or None when git, the repository or the object is not there."""
    try:
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, timeout=60)
    except FileNotFoundError:
        return None
    return r.stdout if r.returncode == 0 else None


def release_ref(release: Release) -> str | None:
    """Where git has the release: its tag, else the commit RELEASED records (a clone of a branch
    pushed without its tags), else None (a shallow clone)."""
    for ref in (f"refs/tags/{release.name}", release.commit):
        if git("cat-file", "-e", f"{ref}^{{commit}}") is not None:
            return ref
    return None


def release_text(release: Release, ref: str | None, filename: str) -> bytes:
    """A released file as the release made it: from git; in a clone without the release's history
    (shallow), the working tree's file, which test_released_files_are_unchanged holds to the
    recorded checksum."""
    data = git("show", f"{ref}:migrations/{filename}") if ref else (MIGRATIONS / filename).read_bytes()
    assert data is not None, f"{filename} of release {release.name} is not in git at {ref}"
    assert sha256(data) == release.files[filename], f"{filename} at {ref or 'the working tree'} is not the " \
                                                    f"file released as {release.name} (sha256 differs from RELEASED)"
    return data


def test_released_is_well_formed() -> None:
    rel = releases()
    assert rel, "migrations/RELEASED names no release"
    files = released_files()
    for filename in files:
        assert re.fullmatch(r"\d{4}_\w+(\.rollback)?\.sql", filename), filename
    # A step is released with its rollback, and only whole steps are released.
    steps = {step_of(f) for f in files}
    assert set(files) == {f"{s}.sql" for s in steps} | {f"{s}.rollback.sql" for s in steps}


def test_released_files_are_unchanged() -> None:
    for filename, (digest, release) in released_files().items():
        path = MIGRATIONS / filename
        assert path.exists(), (f"migrations/{filename} was released in {release} and is gone: released steps "
                               "stay (a database that has them records them by id); add a new step instead")
        assert sha256(path.read_bytes()) == digest, (
            f"migrations/{filename} changed after release {release}: released steps are frozen, because yoyo "
            f"knows an applied step by its id only and never applies an edited one again (`outboxpg migrate` "
            f"would say 'schema is up to date' on the old schema); undo the edit (git checkout {release} -- "
            f"migrations/{filename}) and add a new step instead (docs/migrations.md)")


def test_new_steps_come_after_the_released_ones() -> None:
    # yoyo applies a new step after the released ones on an upgrade; a fresh install (and psql,
    # outboxpg sql) applies the files in name order: the two agree only if new steps sort last.
    released = {step_of(f) for f in released_files()}
    newer = [s for s in sql_files.step_ids() if s not in released]
    assert released <= set(sql_files.step_ids())
    if newer:
        assert min(newer) > max(released), f"new step {min(newer)} sorts before released {max(released)}: " \
                                           "number it after the last released step"


def test_the_release_in_git_is_the_one_recorded() -> None:
    for release in releases():
        ref = release_ref(release)
        if ref is None:
            pytest.skip(f"this clone has neither tag {release.name} nor commit {release.commit} (shallow "
                        "clone): the released files cannot be read from git")
        if ref.startswith("refs/tags/"):
            tagged = git("rev-parse", f"{ref}^{{commit}}")
            assert tagged is not None and tagged.decode().strip() == release.commit, \
                f"tag {release.name} points at {tagged!r}, RELEASED records {release.commit}"
            assert git("cat-file", "-t", ref) == b"tag\n", f"{release.name} is a lightweight tag: make it annotated"
        for filename in release.files:
            release_text(release, ref, filename)
        # and it released every step it had (a release is the whole schema of its commit)
        listed = git("ls-tree", "--name-only", f"{ref}:migrations")
        assert listed is not None
        at_release = {n for n in listed.decode().split() if re.fullmatch(r"\d{4}_\w+(\.rollback)?\.sql", n)}
        earlier = {f for r in releases()[:releases().index(release) + 1] for f in r.files}
        assert at_release <= earlier, f"release {release.name} leaves out {sorted(at_release - earlier)}"


# -- -- depends: headers ------------------------------------------------------------------------

# Names a step uses that a later step makes, or that are not in its dependencies, on purpose.
# Each is looked up before use, or is no object reference at all.
NOT_DEPENDENCIES = {
    ("0001_outbox_settings", "outbox"): "the default subject_prefix 'outbox', a string",
    ("0011_outbox_health", "outbox_open_producers"): "called only when to_regprocedure() finds it (0013 makes it)",
    ("0013_outbox_commit_order", "outbox_worker"): "granted to only when the role exists (0012 makes the roles)",
    ("0013_outbox_commit_order", "outbox_operator"): "granted to only when the role exists (0012 makes the roles)",
}
# Objects made in dynamic SQL, which the CREATE pattern below does not see.
MADE_DYNAMICALLY = {"outbox_producer": "0012_outbox_privileges", "outbox_worker": "0012_outbox_privileges",
                    "outbox_operator": "0012_outbox_privileges"}
_CREATE = re.compile(r"\bCREATE\s+(?:OR\s+REPLACE\s+)?(?:UNIQUE\s+)?(?:FUNCTION|PROCEDURE|TABLE|VIEW|MATERIALIZED\s+VIEW"
                     r"|TYPE|DOMAIN|SEQUENCE|TRIGGER|CONSTRAINT\s+TRIGGER|INDEX|ROLE)\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)", re.I)
_DEPENDS = re.compile(r"^--\s*depends:(.*)$", re.M)


def _code(text: str) -> str:
    """The SQL of a step without its comments: '--' to the end of the line, and COMMENT ON ... IS
    '...' texts (they mention other steps' objects in prose)."""
    text = re.sub(r"--[^\n]*", "", text)
    return re.sub(r"\bCOMMENT\s+ON\b.*?\bIS\s+'(?:[^']|'')*'\s*;", "", text, flags=re.S | re.I)


def test_depends_headers_name_what_each_step_uses() -> None:
    texts = {p.name.removesuffix(".sql"): p.read_text(encoding="utf-8")
             for p in sorted(sql_files.migrations_dir().glob("[0-9]*.sql")) if not p.name.endswith(".rollback.sql")}
    made: dict[str, str] = dict(MADE_DYNAMICALLY)
    for step, text in texts.items():
        for name in _CREATE.findall(_code(text)):
            made.setdefault(name, step)
    depends: dict[str, list[str]] = {}
    for step, text in texts.items():
        headers = _DEPENDS.findall(text)
        assert len(headers) <= 1, f"{step}: more than one depends: line"
        depends[step] = headers[0].split() if headers else []
        for d in depends[step]:
            assert d in texts, f"{step} depends on {d}, which is no step"
            assert d < step, f"{step} depends on the later step {d}: psql and outboxpg sql run the files in order"

    def closure(step: str) -> set[str]:
        seen: set[str] = set()
        todo = list(depends[step])
        while todo:
            d = todo.pop()
            if d not in seen:
                seen.add(d)
                todo += depends[d]
        return seen

    missing = []
    for step, text in texts.items():
        reach = closure(step)
        for name in sorted(set(re.findall(r"\b(outbox\w*)\b", _code(text)))):
            owner = made.get(name)
            if owner is None or owner == step or owner in reach or (step, name) in NOT_DEPENDENCIES:
                continue
            missing.append(f"{step} uses {name} of {owner}")
    assert not missing, ("a -- depends: header misses steps (name them, or the step naming them): "
                         + "; ".join(missing))


# -- SECURITY DEFINER and SET clauses of every function ------------------------------------------

# Every outbox_* function of a fresh install: does it run as its owner (SECURITY DEFINER), and its
# SET clauses (pg_proc.proconfig; <schema> is the install schema), from the one list of the SQL API
# (outboxpg/sql_api.py). A new step's CREATE OR REPLACE FUNCTION resets both unless it restates
# them; a new function is added there on purpose.
FUNCTIONS: dict[str, tuple[bool, tuple[str, ...]]] = {f.signature: (f.definer, f.settings) for f in sql_api.FUNCTIONS}


def test_every_function_keeps_its_security_and_settings(conn: psycopg.Connection[Any]) -> None:
    rows = conn.execute(
        """SELECT p.oid::regprocedure::text, p.prosecdef, coalesce(p.proconfig, '{}')
             FROM pg_proc p
            WHERE p.pronamespace = current_schema()::regnamespace AND p.proname LIKE 'outbox\\_%%'
            ORDER BY 1""").fetchall()
    schema_name = conn.execute("SELECT current_schema()").fetchone()[0]  # type: ignore[index]
    # SET clauses in any order: sorted on both sides
    have = {sig: (definer, tuple(sorted(c.replace(f"search_path={schema_name}, ", "search_path=<schema>, ")
                                        for c in config))) for sig, definer, config in rows}
    want = {sig: (definer, tuple(sorted(config))) for sig, (definer, config) in FUNCTIONS.items()}
    new = {sig: have[sig] for sig in have.keys() - FUNCTIONS.keys()}
    gone = sorted(FUNCTIONS.keys() - have.keys())
    assert not new and not gone, (
        f"functions made {sorted(new)} or dropped {gone}: state each new one's SECURITY DEFINER and SET clauses "
        "in outboxpg/sql_api.py, as a fresh install has them now: "
        + "; ".join(f"{sig!r}: ({definer}, {config!r})," for sig, (definer, config) in sorted(new.items())))
    def text(attrs: tuple[bool, tuple[str, ...]]) -> str:
        return f"{'SECURITY DEFINER' if attrs[0] else 'SECURITY INVOKER'} SET {', '.join(attrs[1]) or '(none)'}"

    wrong = [f"{sig} is {text(have[sig])}, expected {text(w)}" for sig, w in want.items() if have[sig] != w]
    assert not wrong, ("CREATE OR REPLACE FUNCTION resets SECURITY DEFINER and every SET clause it does not "
                       "restate: " + "; ".join(wrong))


# -- upgrade from each release ------------------------------------------------------------------

def install_release(dsn: str, release: Release, directory: Path) -> list[str]:
    """Install the steps of ``release`` and the releases before it, as released, with yoyo (as
    `outboxpg migrate` of that release did); returns the step ids applied."""
    directory.mkdir()
    for r in releases()[:releases().index(release) + 1]:
        ref = release_ref(r)
        for filename in r.files:
            (directory / filename).write_bytes(release_text(r, ref, filename))
    backend = get_backend(schema.yoyo_uri(dsn))
    try:
        with backend.lock():
            todo = backend.to_apply(read_migrations(str(directory)))
            backend.apply_migrations(todo)
        return [m.id for m in todo]
    finally:
        backend.connection.close()


def outboxpg(*args: str) -> subprocess.CompletedProcess[str]:
    console = Path(sys.executable).parent / "outboxpg"
    cmd = [str(console)] if console.exists() else [sys.executable, "-m", "outboxpg.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)


def seed(dsn: str) -> dict[str, Any]:
    """Events in every state, written through the release's SQL API: published, in flight under a
    lease, dead, pending behind the dead one, pending and due."""
    with psycopg.connect(dsn, autocommit=True) as c:
        def insert(agg: str, n: int) -> int:
            row = c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                            "VALUES ('order', %s, 'created', jsonb_build_object('n', %s)) RETURNING id",
                            (agg, n)).fetchone()
            assert row is not None
            return int(row[0])

        ids = {agg: [insert(agg, n) for n in range(3)] for agg in ("a", "b", "c")}
        claimed: dict[int, Any] = {r[0]: r[1] for r in c.execute("SELECT id, lease_token FROM outbox_claim(100)")}
        assert set(claimed) == {i for v in ids.values() for i in v}
        a, b = ids["a"], ids["b"]
        assert c.execute("SELECT outbox_complete(%s::bigint[], %s)", (a, claimed[a[0]])).fetchone() == (3,)
        assert c.execute("SELECT outbox_fail(%s::bigint, %s, 'broken', true)", (b[0], claimed[b[0]])).fetchone() == ("dead",)
        assert c.execute("SELECT outbox_release(%s::bigint[], %s)", (b[1:], claimed[b[0]])).fetchone() == (2,)
        # "c" stays in flight under its lease; "d" is new and never claimed
        ids["d"] = [insert("d", n) for n in range(2)]
        return {"ids": ids, "c_token": claimed[ids["c"][0]]}


def drain(dsn: str, seeded: dict[str, Any]) -> None:
    """After the upgrade: the lease taken before it still completes, the dead letter is requeued,
    and every event is delivered, each aggregate's in order."""
    ids = seeded["ids"]
    with psycopg.connect(dsn, autocommit=True) as c:
        assert c.execute("SELECT outbox_complete(%s::bigint[], %s)", (ids["c"], seeded["c_token"])).fetchone() == (3,)
        assert c.execute("SELECT outbox_requeue(%s::bigint[])", (ids["b"][:1],)).fetchone() == (1,)
        order: list[tuple[str, int]] = []
        for _ in range(20):
            rows = c.execute("SELECT id, aggregate_id, lease_token FROM outbox_claim(100)").fetchall()
            if not rows:
                break
            order += [(r[1], r[0]) for r in rows]
            for token in {r[2] for r in rows}:
                c.execute("SELECT outbox_complete(%s::bigint[], %s)", ([r[0] for r in rows if r[2] == token], token))
        assert sorted(order) == sorted([("b", i) for i in ids["b"]] + [("d", i) for i in ids["d"]])
        for agg in ("b", "d"):
            assert [i for a, i in order if a == agg] == ids[agg]
        assert c.execute("SELECT count(*) FILTER (WHERE state <> 'published'), count(*) FROM outbox").fetchone() \
            == (0, sum(len(v) for v in ids.values()))


@pytest.fixture(params=[r.name for r in releases()])
def release(request: pytest.FixtureRequest) -> Iterator[Release]:
    yield next(r for r in releases() if r.name == request.param)


def test_upgrade_from_a_release_equals_a_fresh_install(release: Release, empty_dsn: str, dsn: str,
                                                       tmp_path: Path) -> None:
    installed = install_release(empty_dsn, release, tmp_path / release.name)
    assert installed == sorted({step_of(f) for r in releases()[:releases().index(release) + 1] for f in r.files})
    seeded = seed(empty_dsn)

    result = outboxpg("migrate", "--dsn", empty_dsn)
    assert result.returncode == 0, result.stderr
    newer = [s for s in sql_files.step_ids() if s not in installed]
    assert result.stdout.splitlines() == ([f"applied {s}" for s in newer] or ["schema is up to date"])

    upgraded, fresh = catalog(empty_dsn), catalog(dsn)
    assert upgraded == fresh, (f"a database upgraded from {release.name} differs from a fresh install "
                               "(first: upgraded, second: fresh): " + "\n".join(differences(upgraded, fresh)))
    drain(empty_dsn, seeded)


# -- the unreleased step: produced from schema/ ---------------------------------------------------

def _schema_step() -> Any:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import schema_step
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return schema_step


def test_the_unreleased_step_is_what_schema_step_produces(dsn: str) -> None:
    """schema/ is the one place a function, view or trigger is written: the step of the next
    release is produced from it, and a change to schema/ that is not in that step yet (or a step
    left over after schema/ went back) fails here, saying what to run."""
    tool = _schema_step()
    with psycopg.connect(dsn) as conn:
        step = tool.produce(conn)
    released = set(sql_files.released_steps())
    unreleased = sorted(p.name for p in sql_files.migrations_dir().glob("[0-9]*.sql")
                        if p.name.removesuffix(".sql").removesuffix(".rollback") not in released)
    if step is None:
        assert unreleased == [], f"{unreleased}: schema/ is what the released steps make: run bin/schema-step"
        return
    assert unreleased == [f"{step.step_id}.rollback.sql", f"{step.step_id}.sql"], \
        f"the unreleased steps are {unreleased}, schema/ needs {step.step_id}: run bin/schema-step"
    for name, text in ((f"{step.step_id}.sql", step.upgrade), (f"{step.step_id}.rollback.sql", step.rollback)):
        assert (MIGRATIONS / name).read_text(encoding="utf-8") == text, \
            f"migrations/{name} is not what schema/ and migrations/next/ give now: run bin/schema-step"


def test_at_most_one_step_is_unreleased() -> None:
    released = set(sql_files.released_steps())
    assert len([s for s in sql_files.step_ids() if s not in released]) <= 1, \
        "the next release is one step, produced from schema/ (bin/schema-step)"


# -- rolling the newest step back ----------------------------------------------------------------

def test_rolling_the_newest_step_back_gives_the_steps_before_it(empty_dsn: str, second_empty_dsn: str) -> None:
    """With a busy aggregate's head parked, a run in flight under its lease with an event behind
    it, a dead letter and a pending event: the rollback gives the catalog of a fresh install of
    the steps before it; the run in flight stays held until its worker reports it (under the same
    token), the parked head goes, everything is delivered in order, and migrating again works."""
    steps = sql_files.step_ids()
    schema.migrate(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        def insert(agg: str) -> int:
            row = c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                            "VALUES ('order', %s, 'created', '{}') RETURNING id", (agg,)).fetchone()
            assert row is not None
            return int(row[0])

        def claim(n: int, lease: str | None = None) -> list[tuple[int, Any]]:
            return [(r[0], r[1]) for r in c.execute("SELECT id, lease_token FROM outbox_claim(%s, %s::interval)",
                                                     (n, lease)).fetchall()]

        busy = [insert("busy") for _ in range(4)]       # four runs: its line empty after the last
        for i in busy:
            ((got, token),) = claim(1)
            assert got == i and c.execute("SELECT outbox_complete(ARRAY[%s]::bigint[], %s)", (i, token)).fetchone() == (1,)
        assert c.execute("SELECT parked FROM outbox_heads WHERE aggregate_id = 'busy'").fetchone() == (True,)
        flying = [insert("flying"), insert("flying")]
        run = claim(10, "10 minutes")
        assert [i for i, _ in run] == flying
        behind = insert("flying")
        dead = insert("dead")
        ((got, token),) = claim(10)
        assert got == dead and c.execute("SELECT outbox_fail(%s, %s, 'broken', true)", (dead, token)).fetchone() == ("dead",)
        waiting = insert("waiting")

    assert schema.rollback(empty_dsn, count=1) == [steps[-1]]
    backend = get_backend(schema.yoyo_uri(second_empty_dsn))
    try:
        with backend.lock():
            before_steps = read_migrations(str(sql_files.migrations_dir())).filter(lambda m: m.id in steps[:-1])
            backend.apply_migrations(backend.to_apply(before_steps))
    finally:
        backend.connection.close()
    rolled, before = catalog(empty_dsn), catalog(second_empty_dsn)
    assert rolled == before, (f"rolling {steps[-1]} back does not give the steps before it (first: rolled back, "
                              "second: fresh): " + "\n".join(differences(rolled, before)))

    with psycopg.connect(empty_dsn, autocommit=True) as c:
        # Where the steps before it park no head, the parked head is gone; where they do, it stays.
        parks = c.execute("SELECT to_regclass('outbox_heads') IS NOT NULL AND EXISTS (SELECT FROM pg_attribute "
                          "WHERE attrelid = 'outbox_heads'::regclass AND attname = 'parked')").fetchone() == (True,)
        assert c.execute("SELECT count(*) FROM outbox_heads WHERE aggregate_id = 'busy'").fetchone() == (int(parks),)
        got = c.execute("SELECT id, lease_token FROM outbox_claim(100)").fetchall()
        assert [r[0] for r in got] == [waiting]              # the run in flight and the dead letter hold theirs
        assert c.execute("SELECT outbox_complete(%s::bigint[], %s)", ([waiting], got[0][1])).fetchone() == (1,)
        assert c.execute("SELECT outbox_complete(%s::bigint[], %s)", (flying, run[0][1])).fetchone() == (2,)
        got = c.execute("SELECT id, lease_token FROM outbox_claim(100)").fetchall()
        assert [r[0] for r in got] == [behind]
        assert c.execute("SELECT outbox_complete(%s::bigint[], %s)", ([behind], got[0][1])).fetchone() == (1,)
        assert c.execute("SELECT outbox_requeue(%s::bigint[])", ([dead],)).fetchone() == (1,)
        got = c.execute("SELECT id, lease_token FROM outbox_claim(100)").fetchall()
        assert [r[0] for r in got] == [dead]
        assert c.execute("SELECT outbox_complete(%s::bigint[], %s)", ([dead], got[0][1])).fetchone() == (1,)
        assert c.execute("SELECT count(*) FILTER (WHERE state <> 'published') FROM outbox").fetchone() == (0,)
    assert schema.migrate(empty_dsn) == [steps[-1]]
