"""outboxpg in a FastAPI application on async SQLAlchemy (docs/how-to/produce-stacks.md).

    DATABASE_URL=postgresql+asyncpg://app@db/shop python examples/stacks/fastapi_app.py

A route takes an AsyncSession from a dependency and writes the order and its event in one
transaction. Run as a script, it calls the route in-process (httpx's ASGI transport: no server,
no port). Without DATABASE_URL, libpq's PGHOST, PGPORT, PGUSER, PGDATABASE say where;
postgresql+psycopg://... works the same.
"""

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Annotated

import httpx
from fastapi import Depends, FastAPI, HTTPException
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

import outboxpg

engine = create_async_engine(os.environ.get("DATABASE_URL", "postgresql+asyncpg://"))
Sessions = async_sessionmaker(engine, expire_on_commit=False)
app = FastAPI()


async def get_session() -> AsyncIterator[AsyncSession]:
    async with Sessions() as session:
        yield session


async def place_order(session: AsyncSession, order_id: str, total: int) -> int:
    async with session.begin():                           # commits at the end, or rolls back
        await session.execute(text("INSERT INTO orders (id, total) VALUES (:id, :total)"),
                              {"id": order_id, "total": total})
        return await outboxpg.enqueue(session, "order", order_id, "placed", {"total": total})


@app.post("/orders/{order_id}")
async def create_order(order_id: str, total: int,
                       session: Annotated[AsyncSession, Depends(get_session)]) -> dict[str, int]:
    try:
        return {"event": await place_order(session, order_id, total)}
    except IntegrityError:                                # the order and its event: neither written
        raise HTTPException(409, f"order {order_id} exists") from None


async def main() -> None:
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, total int)"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shop") as client:
        for total in (42, 7):                             # the second is a duplicate order
            r = await client.post("/orders/o-1", params={"total": total})
            print(f"POST /orders/o-1?total={total}: {r.status_code} {r.json()}")
    async with Sessions() as session:
        print("events:", (await session.execute(text("SELECT count(*) FROM outbox"))).scalar_one())
    await engine.dispose()


if __name__ == "__main__":
    asyncio.run(main())
