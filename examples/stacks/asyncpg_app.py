"""outboxpg with asyncpg (docs/how-to/produce-stacks.md): a connection from a pool.

    python examples/stacks/asyncpg_app.py      # PGHOST, PGPORT, PGUSER, PGDATABASE say where
"""

import asyncio

import asyncpg

import outboxpg


async def main() -> None:
    async with asyncpg.create_pool(min_size=1, max_size=2) as pool:
        async with pool.acquire() as conn:
            async with conn.transaction():
                await conn.execute("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, total int)")
                await conn.execute("INSERT INTO orders VALUES ($1, $2)", "o-1", 42)
                await outboxpg.enqueue(conn, "order", "o-1", "placed", {"total": 42})
            async with conn.transaction():                # one copy_records_to_table
                n = await outboxpg.enqueue_many(conn, [outboxpg.Event("order", f"o-{i}", "imported", {"i": i})
                                                       for i in range(1000)])
            print(f"wrote 1 + {n} events;", await conn.fetchval("SELECT count(*) FROM outbox"), "in the outbox")


asyncio.run(main())
