"""outboxpg.enqueue / enqueue_many on each stack against a plain INSERT on the same driver.

    .venv/bin/python bench/stacks.py                 # every stack, the figures as a table
    .venv/bin/python bench/stacks.py --rounds 7 --one 300 --many 10000

Against the PostgreSQL on 127.0.0.1:5432 (user postgres, trust; --host/--port to change): a
database of its own (created, migrated with outboxpg.schema.migrate, dropped at the end).

Per stack, alternated in rounds (the median round is printed):
  one   a transaction of one event: begin, enqueue, commit (--one of them in a round), against
        begin, INSERT INTO outbox (...) VALUES (...) RETURNING id through the same object, commit;
  many  enqueue_many of --many events in one transaction, against the same rows sent by the
        driver's own bulk path by hand (psycopg's copy, psycopg2's copy_expert, asyncpg's
        copy_records_to_table; under SQLAlchemy and Django: their driver connection's),
        and against multi-row INSERT ... VALUES statements of 1,000 rows each on that driver
        connection (what one would write without COPY).
The outbox is emptied (TRUNCATE) before every measurement of many.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg  # noqa: E402
import psycopg  # noqa: E402
import psycopg2  # noqa: E402
import sqlalchemy  # noqa: E402
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

import outboxpg  # noqa: E402
from outboxpg import schema  # noqa: E402
from outboxpg.drivers.psycopg2 import copy_text  # noqa: E402

PLAIN = ("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
         "VALUES (%s, %s, 'created', %s::jsonb) RETURNING id")
COLUMNS = ["aggregate_type", "aggregate_id", "event_type", "payload"]
COPY = "COPY outbox (aggregate_type, aggregate_id, event_type, payload) FROM STDIN"


def rows(n: int) -> list[tuple[str, str, str, str]]:
    return [("order", f"o-{i % 1000}", "created", '{"n":%d}' % i) for i in range(n)]


def events(n: int) -> list[outboxpg.Event]:
    return [outboxpg.Event("order", f"o-{i % 1000}", "created", {"n": i}) for i in range(n)]


class Sync:
    """One sync stack: how to run a transaction and the driver connection under it."""

    def __init__(self, name: str, obj: Any, commit: Callable[[], Any], plain: Callable[[str, str], Any],
                 raw: Callable[[], Any], kind: str) -> None:
        self.name, self.obj, self.commit, self.plain, self.raw, self.kind = name, obj, commit, plain, raw, kind


def raw_copy(kind: str, raw: Any, data: list[tuple[str, str, str, str]]) -> None:
    if kind == "psycopg":
        with raw.cursor() as cur, cur.copy(COPY) as copy:
            for r in data:
                copy.write_row(r)
    else:
        with raw.cursor() as cur:
            cur.copy_expert(COPY, io.StringIO(copy_text(data)))


def values_sql(n: int, dollar: bool = False) -> str:
    marks = (",".join(f"(${4 * i + 1}, ${4 * i + 2}, ${4 * i + 3}, ${4 * i + 4}::jsonb)" for i in range(n)) if dollar
             else ",".join(["(%s, %s, %s, %s::jsonb)"] * n))
    return f"INSERT INTO outbox ({', '.join(COLUMNS)}) VALUES {marks}"


def time_it(f: Callable[[], Any]) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


async def atime_it(f: Callable[[], Awaitable[Any]]) -> float:
    t = time.perf_counter()
    await f()
    return time.perf_counter() - t


def sync_stacks(dsn: str, url: Callable[[str], str]) -> list[Sync]:
    import django
    from django.conf import settings
    from django.db import connection, transaction

    out = []
    pg3 = psycopg.connect(dsn)
    out.append(Sync("psycopg", pg3, pg3.commit, lambda a, p: pg3.execute(PLAIN, ("order", a, p)).fetchone(),
                    lambda: pg3, "psycopg"))
    pg2 = psycopg2.connect(dsn)

    def pg2_plain(a: str, p: str) -> Any:
        with pg2.cursor() as cur:
            cur.execute(PLAIN, ("order", a, p))
            return cur.fetchone()
    out.append(Sync("psycopg2", pg2, pg2.commit, pg2_plain, lambda: pg2, "psycopg2"))
    for dialect in ("psycopg", "psycopg2"):
        engine = sqlalchemy.create_engine(url(dialect))
        session = Session(engine)
        stmt = sqlalchemy.text("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                               "VALUES ('order', :a, 'created', CAST(:p AS jsonb)) RETURNING id")
        out.append(Sync(f"SQLAlchemy Session ({dialect})", session, session.commit,
                        lambda a, p, s=session, st=stmt: s.execute(st, {"a": a, "p": p}).scalar_one(),
                        lambda s=session: s.connection().connection.driver_connection, dialect))
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    settings.configure(DATABASES={"default": {"ENGINE": "django.db.backends.postgresql", "NAME": info["dbname"],
                                              "USER": info["user"], "HOST": info["host"], "PORT": info["port"]}},
                       USE_TZ=True)
    django.setup()
    transaction.set_autocommit(False)

    def dj_plain(a: str, p: str) -> Any:
        with connection.cursor() as cur:
            cur.execute(PLAIN, ("order", a, p))
            return cur.fetchone()
    out.append(Sync("Django (psycopg)", connection, transaction.commit, dj_plain,
                    lambda: (connection.ensure_connection(), connection.connection)[1], "psycopg"))
    return out


def truncate(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("TRUNCATE outbox")


def measure_sync(s: Sync, dsn: str, rounds: int, one: int, many: int) -> dict[str, float]:
    res: dict[str, list[float]] = {k: [] for k in ("one", "one_plain", "many", "many_copy", "many_values")}
    data, evs = rows(many), events(many)

    def helper_one() -> None:
        for i in range(one):
            outboxpg.enqueue(s.obj, "order", f"o-{i % 1000}", "created", {"n": i})
            s.commit()

    def plain_one() -> None:
        for i in range(one):
            s.plain(f"o-{i % 1000}", '{"n":%d}' % i)
            s.commit()

    def values() -> None:
        raw = s.raw()
        with raw.cursor() as cur:
            for k in range(0, many, 1000):
                chunk = data[k:k + 1000]
                cur.execute(values_sql(len(chunk)), [v for r in chunk for v in r])
        s.commit()

    helper_one(), plain_one()   # warm up (prepared statements, caches)
    for _ in range(rounds):
        res["one"].append(time_it(helper_one) / one)
        res["one_plain"].append(time_it(plain_one) / one)
        for key, f in (("many", lambda: (outboxpg.enqueue_many(s.obj, evs), s.commit())),
                       ("many_copy", lambda: (raw_copy(s.kind, s.raw(), data), s.commit())),
                       ("many_values", values)):
            truncate(dsn)
            res[key].append(time_it(f))
    return {k: statistics.median(v) for k, v in res.items()}


async def measure_async(name: str, make: Callable[[], Awaitable[tuple[Any, Any, Any, Any]]], dsn: str, rounds: int,
                        one: int, many: int) -> dict[str, float]:
    """make() -> (obj, commit, plain(a, p), raw()) where raw() is an awaitable of (kind, driver conn)."""
    obj, commit, plain, raw = await make()
    res: dict[str, list[float]] = {k: [] for k in ("one", "one_plain", "many", "many_copy", "many_values")}
    data, evs = rows(many), events(many)

    async def helper_one() -> None:
        for i in range(one):
            await outboxpg.enqueue(obj, "order", f"o-{i % 1000}", "created", {"n": i})
            await commit()

    async def plain_one() -> None:
        for i in range(one):
            await plain(f"o-{i % 1000}", '{"n":%d}' % i)
            await commit()

    async def helper_many() -> None:
        await outboxpg.enqueue_many(obj, evs)
        await commit()

    async def copy_many() -> None:
        kind, conn = await raw()
        if kind == "asyncpg":
            await conn.copy_records_to_table("outbox", columns=COLUMNS, records=data)
        else:
            async with conn.cursor() as cur, cur.copy(COPY) as copy:
                for r in data:
                    await copy.write_row(r)
        await commit()

    async def values_many() -> None:
        kind, conn = await raw()
        for k in range(0, many, 1000):
            chunk = data[k:k + 1000]
            flat = [v for r in chunk for v in r]
            if kind == "asyncpg":
                await conn.execute(values_sql(len(chunk), dollar=True), *flat)
            else:
                await conn.execute(values_sql(len(chunk)), flat)
        await commit()

    await helper_one()
    await plain_one()
    for _ in range(rounds):
        res["one"].append(await atime_it(helper_one) / one)
        res["one_plain"].append(await atime_it(plain_one) / one)
        for key, f in (("many", helper_many), ("many_copy", copy_many), ("many_values", values_many)):
            truncate(dsn)
            res[key].append(await atime_it(f))
    return {k: statistics.median(v) for k, v in res.items()}


def async_stacks(dsn: str, url: Callable[[str], str], kw: dict[str, Any]) -> dict[str, Callable[[], Awaitable[Any]]]:
    async def pg3() -> Any:
        c = await psycopg.AsyncConnection.connect(dsn)

        async def plain(a: str, p: str) -> Any:
            return await (await c.execute(PLAIN, ("order", a, p))).fetchone()

        async def raw() -> Any:
            return "psycopg", c
        return c, c.commit, plain, raw

    async def apg() -> Any:
        c = await asyncpg.connect(**kw)
        state: dict[str, Any] = {}

        async def begin() -> None:
            state["tx"] = c.transaction()
            await state["tx"].start()

        async def commit() -> None:
            await state["tx"].commit()
            await begin()

        await begin()

        async def plain(a: str, p: str) -> Any:
            return await c.fetchval("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                                    "VALUES ('order', $1, 'created', $2::jsonb) RETURNING id", a, p)

        async def raw() -> Any:
            return "asyncpg", c
        return c, commit, plain, raw

    def sa(dialect: str) -> Callable[[], Awaitable[Any]]:
        async def make() -> Any:
            engine = create_async_engine(url(dialect))
            session = AsyncSession(engine)
            stmt = sqlalchemy.text("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                                   "VALUES ('order', :a, 'created', CAST(:p AS jsonb)) RETURNING id")

            async def plain(a: str, p: str) -> Any:
                return (await session.execute(stmt, {"a": a, "p": p})).scalar_one()

            async def raw() -> Any:
                conn = await session.connection()
                r = await conn.get_raw_connection()
                if dialect == "asyncpg" and r.dbapi_connection._transaction is None:
                    await conn.exec_driver_sql("SELECT 1")
                return dialect, r.driver_connection
            return session, session.commit, plain, raw
        return make

    return {"psycopg async": pg3, "asyncpg": apg, "SQLAlchemy AsyncSession (asyncpg)": sa("asyncpg"),
            "SQLAlchemy AsyncSession (psycopg)": sa("psycopg")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=5432)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--one", type=int, default=300, help="one-event transactions per round")
    ap.add_argument("--many", type=int, default=10_000, help="events of enqueue_many")
    args = ap.parse_args()
    name = "outboxpg_bench_stacks"
    admin = f"host={args.host} port={args.port} user=postgres dbname=postgres"
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {name}")
        c.execute(f"CREATE DATABASE {name}")
    dsn = f"host={args.host} port={args.port} user=postgres dbname={name}"
    try:
        schema.migrate(dsn)

        def url(dialect: str) -> str:
            return f"postgresql+{dialect}://postgres@{args.host}:{args.port}/{name}"
        results: list[tuple[str, dict[str, float]]] = []
        for s in sync_stacks(dsn, url):
            results.append((s.name, measure_sync(s, dsn, args.rounds, args.one, args.many)))
            print(f"  measured {s.name}", file=sys.stderr)
        kw = {"host": args.host, "port": args.port, "user": "postgres", "database": name}
        for label, make in async_stacks(dsn, url, kw).items():
            results.append((label, asyncio.run(measure_async(label, make, dsn, args.rounds, args.one, args.many))))
            print(f"  measured {label}", file=sys.stderr)
        print(f"median of {args.rounds} rounds; one: {args.one} one-event transactions a round, us per transaction; "
              f"many: {args.many:,} events in one transaction, ms")
        print("| stack | enqueue, one | plain INSERT | diff | enqueue_many | driver COPY by hand | diff | "
              "INSERT ... VALUES x1,000 |")
        print("|---|---|---|---|---|---|---|---|")
        for label, r in results:
            print(f"| {label} | {r['one'] * 1e6:.0f} | {r['one_plain'] * 1e6:.0f} | "
                  f"{(r['one'] / r['one_plain'] - 1) * 100:+.1f} % | {r['many'] * 1e3:.1f} | "
                  f"{r['many_copy'] * 1e3:.1f} | {(r['many'] / r['many_copy'] - 1) * 100:+.1f} % | "
                  f"{r['many_values'] * 1e3:.1f} |")
    finally:
        from django.db import connections
        connections.close_all()
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


if __name__ == "__main__":
    main()
