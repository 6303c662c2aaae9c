"""``PostgresStore.connection()``: ``pool.connection()``'s contract, kept by toolguard's own borrow.

Every guarded call borrows one connection, so the store does it with less work
than ``pool.connection()``. What that context manager promised must still hold:
a transaction left open is committed when the block ends and rolled back when it
raises, psycopg's errors become toolguard's, and the connection always goes back.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from toolguard.errors import BackendUnavailable
from toolguard.store.postgres import PostgresStore, StatementTimeout


@pytest.fixture
def store(postgres_url: str, unique: str) -> Iterator[PostgresStore]:
    schema = f"tg_borrow_{unique}"
    store = PostgresStore(postgres_url, schema=schema, min_size=1, max_size=1, timeout_s=1.0)
    store.install()
    with store.connection() as conn:
        conn.execute("CREATE TABLE note (id integer PRIMARY KEY)")
    yield store
    store.close()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def notes(store: PostgresStore) -> list[int]:
    with store.connection() as conn:
        return [row[0] for row in conn.execute("SELECT id FROM note ORDER BY id")]


def test_a_transaction_left_open_is_committed_when_the_block_ends(store: PostgresStore) -> None:
    with store.connection() as conn:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO note VALUES (1)")
    assert notes(store) == [1]


def test_a_transaction_left_open_is_rolled_back_when_the_block_raises(
        store: PostgresStore) -> None:
    with pytest.raises(RuntimeError, match="the block's own"), store.connection() as conn:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO note VALUES (2)")
        raise RuntimeError("the block's own error")
    assert notes(store) == []


def test_errors_are_mapped_as_before_and_the_connection_goes_back(store: PostgresStore) -> None:
    for _ in range(3):  # one connection in the pool: each borrow must have returned it
        with pytest.raises(StatementTimeout), store.connection() as conn:
            conn.execute("SET statement_timeout = 1")
            conn.execute("SELECT pg_sleep(1)")
        with pytest.raises(psycopg.errors.UndefinedTable), store.connection() as conn:
            conn.execute("SELECT * FROM no_such_table")  # no toolguard meaning: as it is
    assert notes(store) == []


def test_a_commit_that_fails_at_the_end_is_raised_and_nothing_lands(store: PostgresStore) -> None:
    with store.connection() as conn:
        conn.execute("CREATE TABLE tag (name text, UNIQUE (name) DEFERRABLE INITIALLY DEFERRED)")
    with pytest.raises(psycopg.errors.UniqueViolation), store.connection() as conn:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO tag VALUES ('a'), ('a')")  # checked only at the commit
    with store.connection() as conn:  # the one connection went back, idle
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert conn.execute("SELECT count(*) FROM tag").fetchone() == (0,)


def test_an_empty_pool_is_backend_unavailable_and_the_holder_keeps_its_connection(
        store: PostgresStore) -> None:
    with store.connection() as held:
        with pytest.raises(BackendUnavailable, match="no connection"), \
                store.connection(timeout=0.2):
            pass  # pragma: no cover - never entered
        assert held.execute("SELECT 1").fetchone() == (1,)
    assert notes(store) == []
