"""outboxpg with SQLAlchemy 2 (sync ORM Session), as in docs/how-to/produce-stacks.md.

    DATABASE_URL=postgresql+psycopg://app@db/shop python examples/stacks/sqlalchemy_app.py

Without DATABASE_URL, libpq's PGHOST, PGPORT, PGUSER, PGDATABASE say where. psycopg2 works the
same way: postgresql+psycopg2://...
"""

import os

from sqlalchemy import create_engine, func, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import outboxpg


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[str] = mapped_column(primary_key=True)
    status: Mapped[str]


def place_order(session: Session, order_id: str) -> None:
    session.add(Order(id=order_id, status="placed"))
    outboxpg.enqueue(session, "order", order_id, "placed", {"id": order_id})


engine = create_engine(os.environ.get("DATABASE_URL", "postgresql+psycopg://"))
Base.metadata.create_all(engine)

with Session(engine) as session:
    place_order(session, "o-1")
    session.commit()                                      # the order and its event, together

with Session(engine) as session:
    place_order(session, "o-2")
    session.rollback()                                    # neither

with Session(engine) as session, session.begin():      # 1,000 events, one COPY
    outboxpg.enqueue_many(session, [outboxpg.Event("order", f"o-{i}", "imported", {"i": i}) for i in range(1000)])

with Session(engine) as session:
    orders = session.scalar(select(func.count()).select_from(Order))
    events = session.scalar(text("SELECT count(*) FROM outbox"))
    print(f"orders: {orders}, events: {events}")
