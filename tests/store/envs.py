"""The two store setups every shared test runs against, as picklable descriptions.

``StoreEnv`` pairs a store with the lock backend used with it in these tests:
PostgreSQL (a schema of its own in the ``test`` database) with Redis, and
SQLite (a file of its own) with SQLite locks (another file). Spawned worker
processes get the ``StoreEnv`` and open their own store and lock manager.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from toolguard.locks import AsyncLockManager, LockManager, connect, connect_async
from toolguard.store import AsyncGuardedStore, GuardedStore, open_async_store, open_store
from toolguard.store.base import qmark

__all__ = ["StoreEnv", "adeposit", "check_ledger", "create_ledger", "deposit", "drop_schema",
           "ledger_state", "rows"]


@dataclass(frozen=True)
class StoreEnv:
    kind: str  # "postgresql" | "sqlite"
    url: str
    lock_url: str
    prefix: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def schema(self) -> str | None:
        return self.options.get("schema")

    def key(self, name: str) -> str:
        """A lock key private to this test (the Redis server is shared)."""
        return f"{self.prefix}:{name}"

    def open(self, **options: Any) -> GuardedStore:
        return open_store(self.url, **{**self.options, **options})

    def open_async(self, **options: Any) -> AsyncGuardedStore:
        return open_async_store(self.url, **{**self.options, **options})

    def locks(self, **options: Any) -> LockManager:
        return connect(self.lock_url, **options)

    def alocks(self, **options: Any) -> AsyncLockManager:
        return connect_async(self.lock_url, **options)

    def drop(self) -> None:
        if self.kind == "postgresql" and self.schema:
            drop_schema(self.url, self.schema)


def drop_schema(url: str, schema: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


#: the advisory lock that lets one test at a time use the demo's fixed-name CRM schema
DEMO_CRM_LOCK = 0x7467_6372  # "tgcr"


@contextmanager
def demo_crm_schema(url: str) -> Iterator[None]:
    """The demo's CRM schema on PostgreSQL has a fixed name: tests on other xdist workers
    (or another suite on the same server) take turns, each starting it empty and dropping it."""
    from toolguard.demo.crm import PG_SCHEMA

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (DEMO_CRM_LOCK,))
        try:
            drop_schema(url, PG_SCHEMA)
            yield
        finally:
            drop_schema(url, PG_SCHEMA)
            conn.execute("SELECT pg_advisory_unlock(%s)", (DEMO_CRM_LOCK,))


def rows(store: GuardedStore, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """Run one statement outside any fenced transaction (``%s`` placeholders on both stores)."""
    with store.connection() as conn:
        text = qmark(query) if store.dialect == "sqlite" else query
        cursor = conn.execute(text, tuple(params))
        return [tuple(row) for row in cursor.fetchall()] if cursor.description else []


def create_ledger(store: GuardedStore, accounts: Sequence[str]) -> None:
    """Accounts (balance, version) and a log of every accepted change, keyed by (account, version)."""
    rows(store, "CREATE TABLE IF NOT EXISTS ledger_account (id TEXT PRIMARY KEY, "
                "balance BIGINT NOT NULL, version BIGINT NOT NULL)")
    rows(store, "CREATE TABLE IF NOT EXISTS ledger_log (account TEXT NOT NULL, "
                "version BIGINT NOT NULL, token BIGINT NOT NULL, delta BIGINT NOT NULL, "
                "intent_id TEXT NOT NULL, PRIMARY KEY (account, version))")
    for account in accounts:
        rows(store, "INSERT INTO ledger_account (id, balance, version) VALUES (%s, 0, 0)", (account,))


def ledger_state(store: GuardedStore) -> tuple[dict[str, tuple[int, int]],
                                               dict[str, list[tuple[int, int, int, str]]]]:
    """Balances/versions per account, and each account's log in commit (version) order."""
    balances = {a: (int(b), int(v)) for a, b, v in
                rows(store, "SELECT id, balance, version FROM ledger_account")}
    log: dict[str, list[tuple[int, int, int, str]]] = {a: [] for a in balances}
    for account, version, token, delta, intent_id in rows(
            store, "SELECT account, version, token, delta, intent_id FROM ledger_log "
                   "ORDER BY account, version"):
        log[account].append((int(version), int(token), int(delta), str(intent_id)))
    return balances, log


def deposit(tx: Any, account: str, delta: int, intent_id: str) -> int:
    """Read-modify-write inside the fenced transaction (the pattern the docs recommend)."""
    balance, version = tx.execute("SELECT balance, version FROM ledger_account WHERE id = %s",
                                  (account,)).fetchone()
    token = tx.tokens[next(iter(tx.tokens))]
    tx.execute("UPDATE ledger_account SET balance = %s, version = %s WHERE id = %s",
               (balance + delta, version + 1, account))
    tx.execute("INSERT INTO ledger_log (account, version, token, delta, intent_id) "
               "VALUES (%s, %s, %s, %s, %s)", (account, version + 1, token, delta, intent_id))
    return int(balance + delta)


async def adeposit(tx: Any, account: str, delta: int, intent_id: str) -> int:
    """``deposit`` for an async fenced transaction."""
    cursor = await tx.execute("SELECT balance, version FROM ledger_account WHERE id = %s",
                              (account,))
    balance, version = await cursor.fetchone()
    token = tx.tokens[next(iter(tx.tokens))]
    await tx.execute("UPDATE ledger_account SET balance = %s, version = %s WHERE id = %s",
                     (balance + delta, version + 1, account))
    await tx.execute("INSERT INTO ledger_log (account, version, token, delta, intent_id) "
                     "VALUES (%s, %s, %s, %s, %s)", (account, version + 1, token, delta, intent_id))
    return int(balance + delta)


def check_ledger(store: GuardedStore, env: StoreEnv, reports: list[dict[str, Any]],
                 retried: Iterable[str] = ()) -> None:
    """Balances equal the accepted deltas; rejections are audited; tokens never go back.

    ``reports`` hold one dict per attempt: ``outcome`` (accepted, rejected, or anything
    else for an attempt that never reached the store), ``account``, ``delta``, ``intent_id``.
    ``retried``: intents accepted on a retry after a stale first attempt (re-seed).
    """
    balances, log = ledger_state(store)
    accepted = [r for r in reports if r["outcome"] == "accepted"]
    rejected = [r for r in reports if r["outcome"] == "rejected"]
    per_account: dict[str, int] = defaultdict(int)
    for report in accepted:
        per_account[report["account"]] += report["delta"]
    for account, (balance, version) in balances.items():
        entries = log[account]
        assert balance == per_account[account] == sum(delta for _, _, delta, _ in entries), account
        assert version == len(entries) and [v for v, *_ in entries] == list(range(1, version + 1))
        tokens = [token for _, token, _, _ in entries]
        assert tokens == sorted(tokens), f"a stale write was accepted on {account}: {tokens}"
        if tokens:
            assert store.high_water(env.key(f"acct:{account}")) == tokens[-1]
    assert {i for entries in log.values() for *_, i in entries} == {r["intent_id"] for r in accepted}
    stale_audit = store.query_audit(reason="stale_fencing_token", limit=None)
    assert {e.intent_id for e in stale_audit} == {r["intent_id"] for r in rejected} | set(retried)
    assert all(e.decision == "rejected" for e in stale_audit)
    accepted_audit = store.query_audit(decision="accepted", limit=None)
    assert {e.intent_id for e in accepted_audit} == {r["intent_id"] for r in accepted}
