"""Configuration mistakes raise to the developer; infrastructure errors reach the model as a short,
safe text.

A guard built with sync backends only and run through ``ainvoke`` used to turn
every call into an error ToolMessage (``rejected by toolguard
(configuration)``): the graph finished, nothing was written, exit code 0. A
sync tool on the async path failed with ``'coroutine' object has no attribute
'fetchone'``. Both now raise ``GuardMisconfigured`` (a ``ConfigurationError``)
out of the graph, audited once. A lock server that cannot be reached used to
reach the model as ``rejected by toolguard (backend_unavailable): redis: Error
111 connecting to 127.0.0.1:...``; the detail now goes to the audit row and the
log only.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import warnings
from pathlib import Path

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import StructuredTool
from servers import free_port

from guard.harness import Harness, HarnessFactory
from guard.tools import (
    EFFECT,
    LEAD_POLICY,
    LeadTools,
    calls_message,
    scripted,
    tool_graph,
    tool_messages,
)
from toolguard.adapters import GuardedToolCalls, ToolGuardMiddleware, guard_tool, guarded
from toolguard.call.context import current
from toolguard.call.intent import Intent
from toolguard.errors import (
    BackendUnavailable,
    ConfigurationError,
    GuardMisconfigured,
    UnknownToolWarning,
)
from toolguard.guard import ToolGuard
from toolguard.locks import connect
from toolguard.policies import Policy
from toolguard.store import AuditEntry

CALL = ("add_score", {"lead_id": "a", "delta": 1}, "c1")


def configuration_rows(h: Harness) -> list[tuple[str, str]]:
    return [(e.decision, e.reason) for e in h.audit()]


# --- the async path without async backends -------------------------------------------------


def test_a_sync_only_guard_under_ainvoke_raises_to_the_developer(harness: HarnessFactory) -> None:
    h: Harness = harness(LEAD_POLICY)
    tools = LeadTools()
    calls = GuardedToolCalls(h.guard, agent="scorer")
    app = tool_graph(scripted(calls_message(CALL), AIMessage(content="done")), tools.tools(),
                     wrap=calls.wrap_tool_call, awrap=calls.awrap_tool_call)

    with pytest.raises(GuardMisconfigured, match="no asyncio lock manager and store"):
        asyncio.run(app.ainvoke({"messages": [HumanMessage("go")]}))

    assert configuration_rows(h) == [("failed", "configuration")]  # audited through the sync store
    assert tools.probe.runs == {} and h.scores() == {}


def test_the_middleware_and_guarded_tools_raise_too(harness: HarnessFactory) -> None:
    h: Harness = harness(LEAD_POLICY)
    tools = LeadTools()
    agent = create_agent(scripted(calls_message(CALL), AIMessage(content="done")), tools.tools(),
                         middleware=[ToolGuardMiddleware(h.guard, agent="scorer")])
    with pytest.raises(GuardMisconfigured):
        asyncio.run(agent.ainvoke({"messages": [HumanMessage("go")]}))

    guarded_tools = [guard_tool(h.guard, tool, agent="scorer") for tool in tools.tools()]
    app = tool_graph(scripted(calls_message(("add_score", {"lead_id": "a", "delta": 1}, "c2")),
                              AIMessage(content="done")), guarded_tools)
    with pytest.raises(GuardMisconfigured):
        asyncio.run(app.ainvoke({"messages": [HumanMessage("go")]}))

    assert configuration_rows(h) == [("failed", "configuration")] * 2
    assert tools.probe.runs == {}


def test_an_async_only_guard_refuses_a_sync_function_when_it_is_decorated(
        harness: HarnessFactory) -> None:
    """With only asyncio edges a sync body has no sync fenced transaction to run in: the
    decorator says so (naming the function), not the first call; an async one works."""
    h: Harness = harness(LEAD_POLICY)

    async def main() -> None:
        async with h.async_edges():
            guard = ToolGuard(h.policy, async_locks=h.guard.async_locks,
                              async_store=h.guard.async_store)

            with pytest.raises(GuardMisconfigured, match="add_score is a sync function"):
                @guarded(guard, agent="scorer")
                def add_score(lead_id: str, delta: int) -> int:
                    return delta

            @guarded(guard, agent="scorer", name="add_score")
            async def add_score_async(lead_id: str, delta: int) -> int:
                return delta

            assert (await add_score_async.arun({"lead_id": "a", "delta": 1}, call_id="c2",
                                               thread_id="t")).ok

    asyncio.run(main())


# --- a sync tool body on the async path -------------------------------------------------------


def test_a_sync_tool_on_the_async_path_runs_its_sync_guarded_call(harness: HarnessFactory) -> None:
    """Under ``ainvoke`` a sync tool body runs its sync guarded call in a worker thread (as
    LangGraph runs sync tools): ``current().tx`` is there, applied once, one audit row."""
    h: Harness = harness(LEAD_POLICY)

    def add_score(lead_id: str, delta: int) -> str:
        """Add to a score (sync only)."""
        ctx = current()
        row = ctx.tx.execute("SELECT score FROM lead WHERE id = %s", (lead_id,)).fetchone()
        ctx.tx.execute(EFFECT, ("add_score", lead_id, delta, ctx.intent.call_id, 1))
        return f"{lead_id}={row}"

    calls = GuardedToolCalls(h.guard, agent="scorer")
    app = tool_graph(scripted(calls_message(CALL), AIMessage(content="done")),
                     [StructuredTool.from_function(add_score)], wrap=calls.wrap_tool_call,
                     awrap=calls.awrap_tool_call)

    async def main() -> None:
        async with h.async_edges():
            await app.ainvoke({"messages": [HumanMessage("go")]})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
        gc.collect()  # a coroutine that was never awaited warns when it is collected
    assert not [w for w in caught if "never awaited" in str(w.message)]
    assert configuration_rows(h) == [("accepted", "applied")]
    assert len(h.effects()) == 1


def test_an_async_tool_using_the_sync_name_is_told_which_one_to_use(harness: HarnessFactory) -> None:
    h: Harness = harness(LEAD_POLICY)

    @guarded(h.guard, agent="scorer")
    async def add_score(lead_id: str, delta: int) -> int:
        current().tx.execute("SELECT 1")
        return delta

    async def main() -> None:
        async with h.async_edges():
            with pytest.raises(GuardMisconfigured, match=r"current\(\)\.atx"):
                await add_score.arun({"lead_id": "a", "delta": 1}, call_id="c1", thread_id="t")

    asyncio.run(main())
    with pytest.raises(GuardMisconfigured, match="coroutine function"):
        add_score.run({"lead_id": "a", "delta": 1})
    assert configuration_rows(h) == [("failed", "configuration")]


# --- construction ----------------------------------------------------------------------------


def test_a_guard_without_backends_fails_at_construction(harness: HarnessFactory) -> None:
    h: Harness = harness(LEAD_POLICY)
    with pytest.raises(GuardMisconfigured, match="needs locks= and store="):
        ToolGuard(h.policy)
    with pytest.raises(GuardMisconfigured, match="together"):
        ToolGuard(h.policy, locks=h.locks)
    with pytest.raises(GuardMisconfigured, match="needs a Policy"):
        ToolGuard("policy.yml", locks=h.locks, store=h.store)  # type: ignore[arg-type]
    assert issubclass(GuardMisconfigured, ConfigurationError)


def test_a_function_the_policy_does_not_know_warns_at_decoration(harness: HarnessFactory) -> None:
    h: Harness = harness(LEAD_POLICY)

    with pytest.warns(UnknownToolWarning, match="every call to it will be refused") as record:
        @guarded(h.guard, agent="scorer")
        def add_scroe(lead_id: str, delta: int) -> int:  # a typo: not in the policy
            return delta

    assert record[0].filename == __file__  # points at the decorated function, not at toolguard
    assert add_scroe.run({"lead_id": "a", "delta": 1}).reason == "unknown_tool"

    with pytest.warns(UnknownToolWarning):
        guard_tool(h.guard, StructuredTool.from_function(add_scroe.function, name="other",
                                                         description="Not in the policy."),
                   agent="scorer")
    allowing = ToolGuard(Policy.from_dict({"version": 1,
                                           "defaults": {"on_unknown_tool": "allow"}}),
                         locks=h.locks, store=h.store)
    with pytest.warns(UnknownToolWarning, match="without locks or fences"):
        guarded(allowing, agent="scorer")(add_scroe.function)
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        @guarded(h.guard, agent="scorer")
        def add_score(lead_id: str, delta: int) -> int:  # known: no warning
            return delta


# --- infrastructure errors -----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_an_unreachable_lock_server_reaches_the_model_as_a_short_safe_text(
        harness: HarnessFactory, caplog: pytest.LogCaptureFixture) -> None:
    h: Harness = harness(LEAD_POLICY)
    port = free_port()
    dead = connect(f"redis://127.0.0.1:{port}/0", timeout_s=1)
    guard = ToolGuard(h.policy, locks=dead, store=h.store)
    calls = GuardedToolCalls(guard, agent="scorer")
    tools = LeadTools()
    app = tool_graph(scripted(calls_message(CALL), AIMessage(content="done")), tools.tools(),
                     wrap=calls.wrap_tool_call)

    with caplog.at_level(logging.WARNING, logger="toolguard"):
        out = app.invoke({"messages": [HumanMessage("go")]})

    answer = tool_messages(out["messages"])["c1"]
    assert answer.status == "error"
    assert answer.response_metadata["toolguard"]["reason"] == "backend_unavailable"
    assert str(port) not in answer.content and "127.0.0.1" not in answer.content
    assert "rejected" not in answer.content and "try again later" in answer.content
    (entry,) = h.audit(intent_id="c1")
    assert (entry.decision, entry.reason) == ("failed", "backend_unavailable")
    assert entry.detail and str(port) in entry.detail  # the operator gets the detail
    assert str(port) in caplog.text
    assert tools.probe.runs == {}
    dead.close()


def test_refusals_keep_their_reason_in_the_model_text(harness: HarnessFactory) -> None:
    h: Harness = harness(LEAD_POLICY)

    @guarded(h.guard, agent="scorer")
    def add_score(lead_id: str, delta: int) -> int:
        raise RuntimeError("password=hunter2 for db.internal:5432")

    refused = add_score.run({"lead_id": "a", "delta": 500}, call_id="c1", thread_id="t")
    failed = add_score.run({"lead_id": "a", "delta": 5}, call_id="c2", thread_id="t")

    assert refused.model_text().startswith("rejected by toolguard (invalid_arguments): args.delta")
    assert failed.model_text() == ("not completed (error): the tool failed (RuntimeError); the "
                                   "details are in toolguard's audit log.")
    assert "hunter2" in (h.audit(intent_id="c2")[0].detail or "")


def test_when_the_store_is_what_failed_the_decision_stands_and_the_log_says_so(
        harness: HarnessFactory, caplog: pytest.LogCaptureFixture) -> None:
    h: Harness = harness(LEAD_POLICY)

    @guarded(h.guard, agent="scorer")
    def add_score(lead_id: str, delta: int) -> int:
        return delta

    def refuse(entry: AuditEntry) -> AuditEntry:
        raise BackendUnavailable("store: connection refused")

    h.store.audit = refuse  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="toolguard"):
        decision = add_score.run({"lead_id": "a", "delta": 500}, call_id=7)  # type: ignore[arg-type]

    assert (decision.kind, decision.reason) == ("rejected", "invalid_intent")
    assert "could not audit rejected/invalid_intent: store: connection refused" in caplog.text


# --- a store whose schema is behind this toolguard ----------------------------------------------


@pytest.mark.parametrize("pauses", [True, False], ids=["kill-switch-on", "kill-switch-off"])
@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_store_without_the_current_schema_raises_to_the_developer(
        tmp_path: Path, dialect: str, pauses: bool) -> None:
    """A store installed by an older toolguard (only its first migration) is a setup
    mistake: it used to reach the model as a refusal on every call (``backend_unavailable``
    from the kill switch, ``store_error`` from the fenced write) while nothing ran."""
    import os
    import uuid

    from toolguard.store import migrations, open_store

    if dialect == "sqlite":
        store = open_store(f"sqlite:///{tmp_path / 'old.db'}")
    else:
        schema = f"tg_old_{uuid.uuid4().hex[:8]}"
        store = open_store(os.environ.get("TOOLGUARD_TEST_DATABASE_URL",
                                          "postgresql://postgres@127.0.0.1:5432/test"),
                           schema=schema)
    try:
        store.install(steps=migrations(dialect)[:1])
        guard = ToolGuard(Policy.from_dict(LEAD_POLICY),
                          locks=connect(f"sqlite:///{tmp_path}/locks.db"), store=store,
                          pauses=pauses)
        ran: list[str] = []
        with pytest.raises(ConfigurationError, match="toolguard db init"):
            guard.run(Intent(tool=CALL[0], args=CALL[1], call_id=CALL[2], agent="scorer"),
                      lambda ctx: ran.append("ran"))
        assert ran == []
    finally:
        if dialect == "postgresql":
            with store.connection() as conn:
                conn.execute(f"DROP SCHEMA {schema} CASCADE")
        store.close()


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_an_async_store_without_the_current_schema_raises_too(tmp_path: Path, dialect: str) -> None:
    import os
    import uuid

    from toolguard.locks import connect_async
    from toolguard.store import migrations, open_async_store, open_store

    schema = f"tg_old_{uuid.uuid4().hex[:8]}"
    url = (f"sqlite:///{tmp_path / 'old.db'}" if dialect == "sqlite" else
           os.environ.get("TOOLGUARD_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    options = {"schema": schema} if dialect == "postgresql" else {}
    with open_store(url, **options) as old:
        old.install(steps=migrations(dialect)[:1])

    async def scenario() -> list[str]:
        ran: list[str] = []

        async def body(ctx: object) -> None:
            ran.append("ran")

        store = open_async_store(url, **options)
        try:
            guard = ToolGuard(Policy.from_dict(LEAD_POLICY),
                              async_locks=connect_async(f"sqlite:///{tmp_path}/locks.db"),
                              async_store=store)
            with pytest.raises(ConfigurationError, match="toolguard db init"):
                await guard.arun(Intent(tool=CALL[0], args=CALL[1], call_id=CALL[2],
                                        agent="scorer"), body)
        finally:
            await store.close()
        return ran

    try:
        assert asyncio.run(scenario()) == []
    finally:
        if dialect == "postgresql":
            with open_store(url) as admin, admin.connection() as conn:
                conn.execute(f"DROP SCHEMA {schema} CASCADE")
