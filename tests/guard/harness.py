"""The two setups every guard test runs on, the tables its tools write, and small helpers.

``Backend`` describes one setup: the embedded default (SQLite locks and SQLite
store, two files under ``tmp_path``) or Redis locks with a PostgreSQL store (a
schema of its own per test, lock keys under a prefix of their own). ``Harness``
opens a ``ToolGuard`` on it and creates two tables the test tools write:
``lead (id, score)`` and ``effect`` (one row per applied effect, in commit
order, with the fencing token it was written under).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from toolguard.guard import ToolGuard
from toolguard.locks import AsyncLockManager, LockManager, connect, connect_async
from toolguard.policies import Policy
from toolguard.store import AuditEntry, GuardedStore, open_async_store, open_store
from toolguard.store.base import qmark

__all__ = ["KINDS", "Backend", "Harness", "HarnessFactory", "LoopThread", "Probe", "wait_until"]

KINDS = ("sqlite", "postgresql")

_TABLES = {
    "sqlite": [
        "CREATE TABLE lead (id TEXT PRIMARY KEY, score BIGINT NOT NULL)",
        "CREATE TABLE effect (seq INTEGER PRIMARY KEY AUTOINCREMENT, tool TEXT NOT NULL, "
        "lead TEXT NOT NULL, delta BIGINT NOT NULL, call TEXT, token BIGINT)",
    ],
    "postgresql": [
        "CREATE TABLE lead (id TEXT PRIMARY KEY, score BIGINT NOT NULL)",
        "CREATE TABLE effect (seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
        "tool TEXT NOT NULL, lead TEXT NOT NULL, delta BIGINT NOT NULL, call TEXT, token BIGINT)",
    ],
}


@dataclass(frozen=True)
class Backend:
    """Where locks and the store live for one test."""

    kind: str  # "sqlite" | "postgresql"
    store_url: str
    lock_url: str
    store_options: Mapping[str, Any] = field(default_factory=dict)
    lock_options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def sqlite(cls, folder: Any) -> Backend:
        return cls("sqlite", f"sqlite:///{folder}/store.db", f"sqlite:///{folder}/locks.db")

    @classmethod
    def postgresql(cls, postgres_url: str, redis_url: str, unique: str) -> Backend:
        return cls("postgresql", postgres_url, redis_url, {"schema": f"tg_guard_{unique}"},
                   {"prefix": f"tgguard:{unique}"})

    @classmethod
    def for_test(cls, request: Any, unique: str, tmp_path: Any) -> Iterator[Backend]:
        """The backend ``request.param`` names, dropped after the test (a fixture's body)."""
        if request.param == "postgresql":
            chosen = cls.postgresql(request.getfixturevalue("postgres_url"),
                                    request.getfixturevalue("redis_url"), unique)
        else:
            chosen = cls.sqlite(tmp_path)
        try:
            yield chosen
        finally:
            chosen.drop()

    def locks(self, **options: Any) -> LockManager:
        return connect(self.lock_url, **{**self.lock_options, **options})

    def alocks(self, **options: Any) -> AsyncLockManager:
        return connect_async(self.lock_url, **{**self.lock_options, **options})

    def store(self) -> GuardedStore:
        return open_store(self.store_url, **self.store_options)

    def drop(self) -> None:
        schema = self.store_options.get("schema")
        if self.kind == "postgresql" and schema:
            with psycopg.connect(self.store_url, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    sql.Identifier(schema)))


class Harness:
    """A ``ToolGuard`` on one backend, with the test tables and read helpers."""

    def __init__(self, backend: Backend, policy: Policy | Mapping[str, Any], *,
                 lock_options: Mapping[str, Any] | None = None) -> None:
        self.backend = backend
        self.policy = policy if isinstance(policy, Policy) else Policy.from_dict(dict(policy))
        self.store = backend.store()
        self.store.install()
        self.locks = backend.locks(**(lock_options or {}))
        self.guard = ToolGuard(self.policy, locks=self.locks, store=self.store)
        for statement in _TABLES[backend.kind]:
            self.sql(statement)

    # --- reads -------------------------------------------------------------------------

    def sql(self, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """One statement outside any fenced transaction (``%s`` placeholders on both stores)."""
        with self.store.connection() as conn:
            text = qmark(query) if self.backend.kind == "sqlite" else query
            cursor = conn.execute(text, tuple(params))
            return [tuple(row) for row in cursor.fetchall()] if cursor.description else []

    def scores(self) -> dict[str, int]:
        return {lead: int(score) for lead, score in self.sql("SELECT id, score FROM lead")}

    def effects(self, tool: str | None = None) -> list[tuple[str, str, int, str | None, int]]:
        """``(tool, lead, delta, call, token)`` per applied effect, in commit order."""
        rows = self.sql("SELECT tool, lead, delta, call, token FROM effect ORDER BY seq")
        return [(r[0], r[1], r[2], r[3], r[4]) for r in rows if tool is None or r[0] == tool]

    def audit(self, **filters: Any) -> list[AuditEntry]:
        """Audit rows, oldest first."""
        return self.store.query_audit(limit=None, newest_first=False, **filters)

    def decisions(self, call_id: str) -> list[tuple[str, str]]:
        return [(e.decision, e.reason) for e in self.audit(intent_id=call_id)]

    def intent_status(self, idempotency_key: str) -> str | None:
        rows = self.sql("SELECT status FROM toolguard_intent WHERE idempotency_key = %s",
                        (idempotency_key,))
        return rows[0][0] if rows else None

    # --- asyncio edges -------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def async_edges(self) -> AsyncIterator[ToolGuard]:
        """Give the guard an asyncio lock manager and store for the running loop."""
        self.guard.async_locks = self.backend.alocks()
        self.guard.async_store = open_async_store(self.backend.store_url,
                                                  **self.backend.store_options)
        try:
            yield self.guard
        finally:
            astore, alocks = self.guard.async_store, self.guard.async_locks
            self.guard.async_store = self.guard.async_locks = None
            with contextlib.suppress(Exception):
                await astore.close()
            with contextlib.suppress(Exception):
                await alocks.aclose()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.locks.close()
        self.store.close()


#: The ``harness`` fixture: ``harness(policy, **options) -> Harness``.
HarnessFactory = Callable[..., "Harness"]


class LoopThread:
    """An event loop in a thread of its own, with the harness's async edges open on it.

    Lets a synchronous test (a hypothesis property) drive the async path many
    times without opening a store and a lock manager for every example.
    """

    def __init__(self, harness: Harness) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self.thread.start()
        self._edges = harness.async_edges()
        self.run(self._edges.__aenter__())

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float = 60.0) -> Any:
        future: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(coroutine,
                                                                                   self.loop)
        return future.result(timeout_s)

    def close(self) -> None:
        try:
            self.run(self._edges.__aexit__(None, None, None))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


class Probe:
    """What the test tools report: how many bodies are inside at once, per resource.

    ``visit(resource)`` brackets a tool body; ``peak[resource]`` is the most
    bodies ever inside together, ``overlap`` the most inside across resources.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.inside: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self.overlap = 0
        self.entered: dict[str, threading.Event] = {}
        self.runs: Counter[str] = Counter()

    def event(self, name: str) -> threading.Event:
        with self._lock:
            return self.entered.setdefault(name, threading.Event())

    @contextlib.contextmanager
    def visit(self, resource: str) -> Iterator[None]:
        with self._lock:
            self.inside[resource] += 1
            self.runs[resource] += 1
            self.peak[resource] = max(self.peak[resource], self.inside[resource])
            self.overlap = max(self.overlap, sum(self.inside.values()))
        self.event(resource).set()
        try:
            yield
        finally:
            with self._lock:
                self.inside[resource] -= 1


def wait_until(predicate: Callable[[], Any], timeout_s: float = 10.0,
               what: str = "condition") -> Any:
    """Poll ``predicate`` until it is truthy (test synchronisation, never a speed assertion)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            msg = f"timed out waiting for {what}"
            raise AssertionError(msg)
        time.sleep(0.005)


def invoke_graph(h: Harness, app: Any, mode: str, inputs: Any,
                 config: dict[str, Any] | None = None) -> Any:
    """``app.invoke`` (mode "sync") or ``app.ainvoke`` with the harness's asyncio edges open."""
    if mode == "sync":
        return app.invoke(inputs, config)

    async def main() -> Any:
        async with h.async_edges():
            return await app.ainvoke(inputs, config)

    return asyncio.run(main())
