import psycopg


def test_template_is_migrated(conn: psycopg.Connection) -> None:
    row = conn.execute("SELECT count(*) FROM outbox_partitions WHERE NOT is_default").fetchone()
    assert row is not None and row[0] >= 1
