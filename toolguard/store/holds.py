"""The wait-for graph of holds, kept in the store so that every process sees it.

A read with ``hold: true`` keeps its key's lock for its caller until the caller
writes the key (``toolguard.steps.holds``). Holds taken across calls can wait on
each other in a cycle (A holds X and waits for Y, B holds Y and waits for X),
and no lock server sees it: each sees one key. So the guards write it down
here (``toolguard_hold``: who holds each key and since when;
``toolguard_hold_wait``: which keys a holding caller waits for) and each waiter
searches it for a cycle through itself when it starts waiting and while it
waits. The rule (``yields``, pure): **the youngest caller on a cycle yields**,
the age of a caller being when its oldest current hold began. Every waiter on
a cycle computes the same answer from the same rows, so exactly one of them
yields, and only that one; the others keep waiting.

Times are seconds since the epoch on the writing guard's clock. A row past its
``expires`` counts as gone: a dead process's rows lapse with its hold or wait.
Clock skew between machines only shifts which caller counts as younger.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["AsyncBoard", "Board", "Graph", "yields"]

_EDGES = ("SELECT w.caller, h.caller FROM toolguard_hold_wait w "
          "JOIN toolguard_hold h ON h.key = w.key "
          "WHERE w.expires > {p} AND h.expires > {p} AND h.caller <> w.caller")
_AGES = "SELECT caller, min(since) FROM toolguard_hold WHERE expires > {p} GROUP BY caller"
_HELD = ("INSERT INTO toolguard_hold (key, caller, since, expires) VALUES ({p}, {p}, {p}, {p}) "
         "ON CONFLICT (key) DO UPDATE SET caller = excluded.caller, since = excluded.since, "
         "expires = excluded.expires")
_FREED = "DELETE FROM toolguard_hold WHERE key = {p} AND caller = {p}"
_WAITING = ("INSERT INTO toolguard_hold_wait (caller, key, expires) VALUES ({p}, {p}, {p}) "
            "ON CONFLICT (caller, key) DO UPDATE SET expires = excluded.expires")
_STOPPED = "DELETE FROM toolguard_hold_wait WHERE caller = {p}"


def _sql(template: str, dialect: str) -> str:
    return template.format(p="?" if dialect == "sqlite" else "%s")


@dataclass(frozen=True, slots=True)
class Graph:
    """Who waits for whom (``edges``: waiter -> holder) and each holder's age (``ages``)."""

    edges: Sequence[tuple[str, str]]
    ages: Mapping[str, float]


def yields(me: str, graph: Graph) -> tuple[str, ...] | None:
    """The cycle through ``me`` on which ``me`` is the youngest caller, or None (pure).

    Younger is a later oldest-hold start (ties: the greater caller id). ``me``
    yields iff some cycle through it has no caller younger than it: a path from
    ``me`` back to ``me`` through callers all older than ``me``.
    """
    def rank(caller: str) -> tuple[float, str]:
        return (graph.ages.get(caller, float("inf")), caller)

    mine = rank(me)
    following: dict[str, list[str]] = {}
    for waiter, holder in graph.edges:
        following.setdefault(waiter, []).append(holder)
    trail: dict[str, str] = {}
    frontier = [me]
    while frontier:
        current = frontier.pop()
        for holder in following.get(current, ()):
            if holder == me:
                cycle = [current]
                while cycle[-1] != me:
                    cycle.append(trail[cycle[-1]])
                return tuple(reversed(cycle))
            if holder not in trail and rank(holder) < mine:
                trail[holder] = current
                frontier.append(holder)
    return None


def _rows(conn: Any, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
    return [tuple(row) for row in conn.execute(sql, tuple(params)).fetchall()]


class Board:
    """The wait-for graph on a sync store (``SqliteStore`` or ``PostgresStore``)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.dialect: str = store.dialect

    def _run(self, template: str, rows: Iterable[Sequence[Any]]) -> None:
        sql = _sql(template, self.dialect)
        with self.store.connection() as conn:
            for row in rows:
                conn.execute(sql, tuple(row))

    def held(self, caller: str, keys: Iterable[str], since: float, expires: float) -> None:
        self._run(_HELD, [(key, caller, since, expires) for key in keys])

    def freed(self, caller: str, keys: Iterable[str]) -> None:
        self._run(_FREED, [(key, caller) for key in keys])

    def waiting(self, caller: str, keys: Iterable[str], expires: float) -> None:
        self._run(_WAITING, [(caller, key, expires) for key in keys])

    def stopped(self, caller: str) -> None:
        self._run(_STOPPED, [(caller,)])

    def graph(self) -> Graph:
        now = time.time()
        with self.store.connection() as conn:
            edges = _rows(conn, _sql(_EDGES, self.dialect), (now, now))
            ages = _rows(conn, _sql(_AGES, self.dialect), (now,))
        return Graph([(str(w), str(h)) for w, h in edges],
                     {str(c): float(s) for c, s in ages})


class AsyncBoard:
    """The asyncio twin of ``Board`` (an ``AsyncSqliteStore`` runs ``Board`` in a thread)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.dialect: str = store.dialect
        sync = getattr(store, "sync", None)
        self._sync = Board(sync) if sync is not None else None

    async def _run(self, template: str, rows: Sequence[Sequence[Any]]) -> None:
        sql = _sql(template, self.dialect)
        async with self.store.connection() as conn:
            for row in rows:
                await conn.execute(sql, tuple(row))

    async def held(self, caller: str, keys: Iterable[str], since: float,
                   expires: float) -> None:
        if self._sync is not None:
            return await asyncio.to_thread(self._sync.held, caller, list(keys), since, expires)
        await self._run(_HELD, [(key, caller, since, expires) for key in keys])

    async def freed(self, caller: str, keys: Iterable[str]) -> None:
        if self._sync is not None:
            return await asyncio.to_thread(self._sync.freed, caller, list(keys))
        await self._run(_FREED, [(key, caller) for key in keys])

    async def waiting(self, caller: str, keys: Iterable[str], expires: float) -> None:
        if self._sync is not None:
            return await asyncio.to_thread(self._sync.waiting, caller, list(keys), expires)
        await self._run(_WAITING, [(caller, key, expires) for key in keys])

    async def stopped(self, caller: str) -> None:
        if self._sync is not None:
            return await asyncio.to_thread(self._sync.stopped, caller)
        await self._run(_STOPPED, [(caller,)])

    async def graph(self) -> Graph:
        if self._sync is not None:
            return await asyncio.to_thread(self._sync.graph)
        now = time.time()
        async with self.store.connection() as conn:
            edges = await (await conn.execute(_sql(_EDGES, self.dialect), (now, now))).fetchall()
            ages = await (await conn.execute(_sql(_AGES, self.dialect), (now,))).fetchall()
        return Graph([(str(w), str(h)) for w, h in edges],
                     {str(c): float(s) for c, s in ages})
