"""An application that writes an event in the transaction of its business change (README, "Use it
in your app"): the order is paid and its event is written, or neither.

    python3 examples/app.py --dsn "dbname=shop"          # a table orders (id text PRIMARY KEY, status text)
"""

from __future__ import annotations

import argparse

import psycopg

import outboxpg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dsn", default="", help="libpq connection string (default: the PG* variables)")
    p.add_argument("--order", default="o-17")
    args = p.parse_args()

    with psycopg.connect(args.dsn) as conn:
        with conn.transaction():    # BEGIN ... COMMIT: the order and its event commit together
            conn.execute("INSERT INTO orders (id, status) VALUES (%s, 'paid') "
                         "ON CONFLICT (id) DO UPDATE SET status = 'paid'", (args.order,))
            event_id = outboxpg.enqueue(conn, "order", args.order, "paid", {"amount": 42})
        # Committed here. An exception inside the block rolls back both: no event without its order.
    print(f"order {args.order} paid; event {event_id} committed with it")


if __name__ == "__main__":
    main()
