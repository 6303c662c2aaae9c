"""``open_guard``: one call builds a guard with both faces, from URLs, the environment or the default.

Before it, a guard that served sync and asyncio calls took a policy loader, two
lock connectors, two store openers and the guard (about 13 names), and an
asyncio pair opened at startup belonged to the first event loop that used it:
the second ``asyncio.run`` failed with "Event loop is closed". Each loop now
gets a pair of its own, closed when the loop ends.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from guard.harness import Backend
from toolguard import open_guard
from toolguard.adapters import guarded
from toolguard.call.context import current
from toolguard.errors import ConfigurationError, GuardMisconfigured
from toolguard.open import OpenedGuard
from toolguard.policies import Policy
from toolguard.store import open_store

POLICY = Policy.from_dict({"version": 1, "tools": {"add": {"locks": ["counter:{name}"]}}})
POLICY_YAML = "version: 1\ntools:\n  add:\n    locks: ['counter:{name}']\n"


def opened(backend: Backend, **options: Any) -> OpenedGuard:
    guard = open_guard(POLICY, locks=backend.lock_url, store=backend.store_url,
                       lock_options=backend.lock_options, store_options=backend.store_options,
                       **options)
    with guard.store.connection() as conn:  # type: ignore[union-attr]
        conn.execute("CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, n INT)")
        conn.execute("INSERT INTO counters VALUES ('c', 0) ON CONFLICT (name) DO NOTHING")
    return guard


def tools(guard: OpenedGuard) -> tuple[Any, Any]:
    @guarded(guard, agent="counter")
    def add(name: str, by: int) -> int:
        tx = current().tx
        (n,) = tx.execute("SELECT n FROM counters WHERE name = %s", (name,)).fetchone()
        tx.execute("UPDATE counters SET n = %s WHERE name = %s", (n + by, name))
        return int(n + by)

    @guarded(guard, agent="counter", name="add")  # both are the policy's `add`
    async def aadd(name: str, by: int) -> int:
        tx = current().atx
        cursor = await tx.execute("SELECT n FROM counters WHERE name = %s", (name,))
        (n,) = await cursor.fetchone()
        await tx.execute("UPDATE counters SET n = %s WHERE name = %s", (n + by, name))
        return int(n + by)

    return add, aadd


def test_one_call_serves_sync_calls_and_async_calls_in_every_event_loop(backend: Backend) -> None:
    with opened(backend) as guard:
        add, aadd = tools(guard)

        async def burst() -> list[int]:
            return list(await asyncio.gather(*(aadd(name="c", by=1) for _ in range(4))))

        assert add(name="c", by=10) == 10
        first = asyncio.run(burst())
        second = asyncio.run(burst())  # a loop of its own: a pair of its own
        assert sorted(first) == [11, 12, 13, 14] and sorted(second) == [15, 16, 17, 18]
        assert add(name="c", by=1) == 19
        rows = guard.store.query_audit(tool="add")  # type: ignore[union-attr]
        assert [row.decision for row in rows] == ["accepted"] * 10


def test_each_loop_pair_is_closed_when_its_loop_ends(backend: Backend) -> None:
    with opened(backend) as guard:
        async def edges() -> tuple[Any, Any]:
            locks, store = guard.async_locks, guard.async_store
            assert locks is guard.async_locks and store is guard.async_store  # one per loop
            assert await store.schema_version() > 0  # type: ignore[union-attr]
            return locks, store

        first = asyncio.run(edges())
        assert not guard._pairs  # asyncio.run shut the pair down with its loop
        second = asyncio.run(edges())
        assert first[0] is not second[0] and first[1] is not second[1]
        if backend.kind == "postgresql":
            assert first[1]._pool.closed and second[1]._pool.closed


def test_closing_refuses_later_calls_and_is_idempotent(backend: Backend) -> None:
    guard = opened(backend)
    add, _ = tools(guard)
    assert add(name="c", by=1) == 1
    guard.close()
    guard.close()
    assert guard.locks is None and guard.store is None
    with pytest.raises(GuardMisconfigured, match="closed"):
        add(name="c", by=1)


def test_aclose_closes_the_loop_pair_and_the_sync_pair(backend: Backend) -> None:
    guard = opened(backend)
    _, aadd = tools(guard)

    async def main() -> int:
        async with guard:
            added = int(await aadd(name="c", by=2))
            with pytest.raises(GuardMisconfigured, match="aclose"):
                guard.close()  # this loop's pair needs the loop to close it
            return added

    assert asyncio.run(main()) == 2
    assert not guard._pairs and guard.store is None
    with pytest.raises(GuardMisconfigured, match="closed"):
        asyncio.run(aadd(name="c", by=1))


def test_bad_urls_are_configuration_errors_naming_the_url(tmp_path: Path,
                                                         postgres_url: str) -> None:
    with pytest.raises(ConfigurationError, match=r"lock URL.*mysql://x/y"):
        open_guard(POLICY, locks="mysql://x/y", store=f"sqlite:///{tmp_path}/s.db")
    with pytest.raises(ConfigurationError, match=r"store URL 'mysql://x/y'.*unknown store URL"):
        open_guard(POLICY, locks=f"sqlite:///{tmp_path}/l.db", store="mysql://x/y")
    with pytest.raises(ConfigurationError, match=r"store URL.*sqlite:///"):
        open_guard(POLICY, locks=f"sqlite:///{tmp_path}/l.db", store="sqlite:///")
    missing = postgres_url.replace("://postgres@", "://postgres:s3cret@").rsplit("/", 1)[0]
    with pytest.raises(ConfigurationError, match="does not exist") as caught:
        open_guard(POLICY, locks=f"sqlite:///{tmp_path}/l.db", store=f"{missing}/no_such_db")
    assert "no_such_db" in str(caught.value) and "s3cret" not in str(caught.value)
    with pytest.raises(ConfigurationError, match="lock URL must be a string"):
        open_guard(POLICY, locks=7)  # type: ignore[arg-type]


def test_without_urls_the_settings_then_the_embedded_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_url: str, postgres_url: str,
        unique: str) -> None:
    for name in ("TOOLGUARD_LOCK_URL", "TOOLGUARD_REDIS_URL", "TOOLGUARD_DATABASE_URL",
                 "TOOLGUARD_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "policy.yml").write_text(POLICY_YAML)
    with open_guard("policy.yml") as guard:
        assert guard.lock_url == f"sqlite:///{tmp_path}/.toolguard/locks.db"
        assert guard.store_url == f"sqlite:///{tmp_path}/.toolguard/store.db"
        assert guard.store.schema_version() > 0  # type: ignore[union-attr]  # installed
    monkeypatch.setenv("TOOLGUARD_REDIS_URL", redis_url)
    monkeypatch.setenv("TOOLGUARD_DATABASE_URL", postgres_url)
    schema = f"tg_open_{unique}"
    try:
        with open_guard("policy.yml", store_options={"schema": schema},
                        lock_options={"prefix": f"tgopen:{unique}"}) as guard:
            assert (guard.lock_url, guard.store_url) == (redis_url, postgres_url)
            with guard.store.connection() as conn:  # type: ignore[union-attr]
                conn.execute("CREATE TABLE counters (name TEXT PRIMARY KEY, n INT)")
                conn.execute("INSERT INTO counters VALUES ('c', 0)")
            add, aadd = tools(guard)
            assert add(name="c", by=1) == 1 and asyncio.run(aadd(name="c", by=3)) == 4
    finally:
        with open_store(postgres_url, schema=schema).connection() as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")



def test_a_tool_node_runs_async_tools_under_ainvoke_in_two_event_loops(backend: Backend) -> None:
    """The adapters need nothing but the opened guard: ``ainvoke`` finds this loop's pair."""
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    from toolguard.adapters import GuardedToolCalls

    with opened(backend) as guard:
        @tool
        async def add(name: str, by: int) -> str:
            """Add to a counter."""
            tx = current().atx
            cursor = await tx.execute("SELECT n FROM counters WHERE name = %s", (name,))
            (n,) = await cursor.fetchone()
            await tx.execute("UPDATE counters SET n = %s WHERE name = %s", (n + by, name))
            return str(n + by)

        calls = GuardedToolCalls(guard, agent="counter")
        node = ToolNode([add], wrap_tool_call=calls.wrap_tool_call,
                        awrap_tool_call=calls.awrap_tool_call)
        graph = StateGraph(MessagesState).add_node("tools", node).add_edge(START, "tools").compile()

        async def ask(call_id: str) -> str:
            message = AIMessage(content="", tool_calls=[
                {"name": "add", "args": {"name": "c", "by": 5}, "id": call_id}])
            reply = await graph.ainvoke({"messages": [message]},
                                        {"configurable": {"thread_id": "t"}})
            return str(reply["messages"][-1].content)

        assert asyncio.run(ask("call-1")) == "5"
        assert asyncio.run(ask("call-2")) == "10"
        assert asyncio.run(ask("call-1")) == "5"  # a replay: the recorded answer
        rows = guard.store.query_audit(tool="add")  # type: ignore[union-attr]
        assert sorted(row.decision for row in rows) == ["accepted", "accepted", "replayed"]


class _HeldAfterEdges:
    """The guard's schema check, holding the call in the thread ``hold_in`` (after it chose its
    edges and controls, before it uses them) until ``release`` is set."""

    def __init__(self, inner: Any, hold_in: str, reached: threading.Event,
                 release: threading.Event) -> None:
        self.inner, self.hold_in, self.reached, self.release = inner, hold_in, reached, release

    def check(self, store: Any) -> None:
        self.inner.check(store)

    async def acheck(self, store: Any) -> None:
        await self.inner.acheck(store)
        if threading.current_thread().name == self.hold_in:
            self.reached.set()
            await asyncio.to_thread(self.release.wait, 120)


def test_two_event_loops_at_once_each_use_the_controls_of_their_own_pair(
        postgres_url: str, redis_url: str, unique: str) -> None:
    """A call in loop A that chose its edges, then waited while a call in loop B ran to its
    end, used B's quota backend (B's pool, closed with B's loop): the controls were one
    attribute, rebuilt by whichever loop called last. Each loop now keeps its own."""
    policy = Policy.from_dict({"version": 1, "tools": {"add": {
        "locks": ["counter:{name}"], "quotas": [{"calls": 1000, "window": "1m", "per": "agent"}]}}})
    backend = Backend.postgresql(postgres_url, redis_url, unique)
    reached, released = threading.Event(), threading.Event()
    results: dict[str, Any] = {}
    try:
        guard = open_guard(policy, locks=backend.lock_url, store=backend.store_url,
                           lock_options=backend.lock_options, store_options=backend.store_options)
        with guard, guard.store.connection() as conn:  # type: ignore[union-attr]
            conn.execute("CREATE TABLE counters (name TEXT PRIMARY KEY, n INT)")
            conn.execute("INSERT INTO counters VALUES ('c', 0)")
            _, aadd = tools(guard)
            guard._schema = _HeldAfterEdges(guard._schema, "loop-a", reached, released)

            def in_loop(name: str) -> None:
                try:
                    results[name] = asyncio.run(aadd.arun({"name": "c", "by": 1},
                                                          call_id=name, thread_id="t"))
                finally:
                    released.set()

            a = threading.Thread(target=in_loop, args=("loop-a",), name="loop-a")
            a.start()
            assert reached.wait(120)
            b = threading.Thread(target=in_loop, args=("loop-b",), name="loop-b")
            b.start()
            b.join()
            a.join()
        assert results["loop-b"].kind == "accepted", results["loop-b"]
        assert results["loop-a"].kind == "accepted", results["loop-a"]
    finally:
        backend.drop()
