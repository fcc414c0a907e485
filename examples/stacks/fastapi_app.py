"""outboxpg with async SQLAlchemy, as a FastAPI application uses it (docs/how-to/produce-stacks.md).

    DATABASE_URL=postgresql+asyncpg://app@db/shop python examples/stacks/fastapi_app.py

The route's body is place_order(); FastAPI hands it the AsyncSession from a dependency (shown in
the doc). Run as a script, it calls place_order() itself, without FastAPI. Without DATABASE_URL,
libpq's PGHOST, PGPORT, PGUSER, PGDATABASE say where; postgresql+psycopg://... works the same.
"""

import asyncio
import os

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

import outboxpg

engine = create_async_engine(os.environ.get("DATABASE_URL", "postgresql+asyncpg://"))
Sessions = async_sessionmaker(engine, expire_on_commit=False)


async def place_order(session: AsyncSession, order_id: str, total: int) -> int:
    async with session.begin():                           # commits at the end, or rolls back
        await session.execute(text("INSERT INTO orders (id, total) VALUES (:id, :total)"),
                              {"id": order_id, "total": total})
        return await outboxpg.enqueue(session, "order", order_id, "placed", {"total": total})


async def main() -> None:
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, total int)"))
    async with Sessions() as session:
        event_id = await place_order(session, "o-1", 42)
        print(f"order o-1 placed, event {event_id}")
    async with Sessions() as session:
        try:
            await place_order(session, "o-1", 7)          # a duplicate order: all of it rolls back
        except Exception as exc:                          # noqa: BLE001 (shown to the reader)
            print(f"order o-1 again: {type(exc).__name__}")
    async with Sessions() as session:
        print("events:", (await session.execute(text("SELECT count(*) FROM outbox"))).scalar_one())
    await engine.dispose()


if __name__ == "__main__":
    asyncio.run(main())
