"""PydanticAI agents with ``GuardedToolset``, driven by ``FunctionModel`` emitting tool calls.

Each test runs on the embedded default and on Redis + PostgreSQL (the
``harness`` fixture). ``FunctionModel`` answers as a real model does: a
response of parallel ``ToolCallPart``s (PydanticAI runs them as concurrent
tasks), then text once it has read the tool results.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from adapters.hostile import ODD_TEXT, hostile_value
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import FunctionToolset

from guard.harness import Harness
from toolguard.adapters.pydantic_ai import GuardedToolset
from toolguard.call.context import current

POLICY: dict[str, Any] = {
    "version": 1,
    "tools": {
        "add_score": {"locks": ["lead:{lead_id}"], "agents": ["scorer", "router"],
                      "args": {"delta": {"ge": -100, "le": 100}}},
        "reassign_lead": {"locks": ["lead:{lead_id}"], "agents": ["router"]},
        "add": {"locks": ["calc:{a}"]},
        "echo": {"read_only": True},
    },
}

UPSERT = ("INSERT INTO lead (id, score) VALUES (%s, %s) "
          "ON CONFLICT (id) DO UPDATE SET score = excluded.score")
EFFECT = "INSERT INTO effect (tool, lead, delta, call, token) VALUES (%s, %s, %s, %s, %s)"
READ = "SELECT score FROM lead WHERE id = %s"

Call = tuple[str, Any, str]  # (tool name, args as the model sends them, call id)


class Probe:
    """How many tool bodies are inside at once, per lead."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.inside: dict[str, int] = {}
        self.peak: dict[str, int] = {}

    def enter(self, lead: str) -> None:
        with self._lock:
            self.inside[lead] = self.inside.get(lead, 0) + 1
            self.peak[lead] = max(self.peak.get(lead, 0), self.inside[lead])

    def leave(self, lead: str) -> None:
        with self._lock:
            self.inside[lead] -= 1


def lead_tools(probe: Probe, *, sync: bool) -> FunctionToolset[Any]:
    """``add_score`` (a read-modify-write with a pause inside) and ``reassign_lead``."""
    tools: FunctionToolset[Any] = FunctionToolset()
    if sync:
        @tools.tool_plain
        def add_score(lead_id: str, delta: int) -> int:
            """Add ``delta`` to the lead's score."""
            ctx = current()
            probe.enter(lead_id)
            try:
                row = ctx.tx.execute(READ, (lead_id,)).fetchone()
                score = (row[0] if row else 0) + delta
                time.sleep(0.005)  # a lost update shows if two bodies overlap here
                ctx.tx.execute(UPSERT, (lead_id, score))
                ctx.tx.execute(EFFECT, ("add_score", lead_id, delta, ctx.intent.call_id,
                                        ctx.tokens[f"lead:{lead_id}"]))
            finally:
                probe.leave(lead_id)
            return score

        @tools.tool_plain
        def reassign_lead(lead_id: str, owner: str) -> str:
            """Give the lead to ``owner``."""
            current().tx.execute(EFFECT, ("reassign_lead", lead_id, 0, owner, 0))
            return f"{lead_id} -> {owner}"
    else:
        @tools.tool_plain(name="add_score")
        async def add_score_async(lead_id: str, delta: int) -> int:
            """Add ``delta`` to the lead's score."""
            ctx = current()
            probe.enter(lead_id)
            try:
                row = await (await ctx.atx.execute(READ, (lead_id,))).fetchone()
                score = (row[0] if row else 0) + delta
                await asyncio.sleep(0.005)
                await ctx.atx.execute(UPSERT, (lead_id, score))
                await ctx.atx.execute(EFFECT, ("add_score", lead_id, delta, ctx.intent.call_id,
                                               ctx.tokens[f"lead:{lead_id}"]))
            finally:
                probe.leave(lead_id)
            return score

        @tools.tool_plain(name="reassign_lead")
        async def reassign_lead_async(lead_id: str, owner: str) -> str:
            """Give the lead to ``owner``."""
            await current().atx.execute(EFFECT, ("reassign_lead", lead_id, 0, owner, 0))
            return f"{lead_id} -> {owner}"
    return tools


@dataclass
class Script:
    """A ``FunctionModel`` that sends ``turns`` of parallel calls, then text; keeps what it read."""

    turns: Sequence[Sequence[Call]]

    def __post_init__(self) -> None:
        self.read: dict[str, ToolReturnPart] = {}
        self._next = 0

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        last = messages[-1]
        if isinstance(last, ModelRequest):
            self.read.update({p.tool_call_id: p for p in last.parts if isinstance(p, ToolReturnPart)})
        if self._next >= len(self.turns):
            return ModelResponse(parts=[TextPart("done")])
        calls = self.turns[self._next]
        self._next += 1
        return ModelResponse(parts=[ToolCallPart(name, args, tool_call_id=cid)
                                    for name, args, cid in calls])

    def model(self) -> FunctionModel:
        return FunctionModel(self)


def run(h: Harness, mode: str, agent: Agent[Any, str], **options: Any) -> Any:
    if mode == "sync":
        return agent.run_sync("go", **options)

    async def main() -> Any:
        async with h.async_edges():
            return await agent.run("go", **options)

    return asyncio.run(main())


MODES = ["sync", "async"]


@pytest.mark.parametrize("mode", MODES)
def test_parallel_calls_are_serialized_and_refusals_are_tool_errors(harness, mode: str) -> None:
    h: Harness = harness(POLICY)
    probe = Probe()
    on_a = [("add_score", {"lead_id": "a", "delta": d}, f"a{d}") for d in range(1, 6)]
    refused = [("add_score", {"lead_id": "a", "delta": "9"}, "c-type"),
               ("add_score", {"lead_id": "a", "delta": 1, "agent": "router"}, "c-extra"),
               ("add_score", '{"lead_id": "a", "delta": 1', "c-json"),
               ("reassign_lead", {"lead_id": "a", "owner": "x"}, "c-denied")]
    script = Script([[*on_a, *refused]])
    toolset = GuardedToolset(lead_tools(probe, sync=mode == "sync"), guard=h.guard, agent="scorer")
    agent = Agent(script.model(), toolsets=[toolset])

    result = run(h, mode, agent)

    assert result.output == "done"
    assert all(script.read[cid].outcome == "success" for _, _, cid in on_a)
    assert probe.peak["a"] == 1
    assert h.scores() == {"a": 15}
    assert sorted(e[2] for e in h.effects()) == [1, 2, 3, 4, 5]
    # arguments the model can fix: a retry prompt; a refusal it cannot argue with: a failed result
    answers = {cid: script.read[cid] for _, _, cid in refused}
    assert {cid: a.outcome for cid, a in answers.items()} == {
        "c-type": "retried", "c-extra": "retried", "c-json": "retried", "c-denied": "failed"}
    assert "rejected by toolguard (not_authorized)" in answers["c-denied"].content
    for _, _, cid in [*on_a, *refused]:
        assert len(h.decisions(cid)) == 1, cid
    assert {cid: h.decisions(cid)[0] for _, _, cid in refused} == {
        "c-type": ("rejected", "invalid_arguments"), "c-extra": ("rejected", "invalid_arguments"),
        "c-json": ("rejected", "invalid_arguments"), "c-denied": ("rejected", "not_authorized")}


@pytest.mark.parametrize("mode", MODES)
def test_a_rerun_of_the_same_run_replays_instead_of_writing_again(harness, mode: str) -> None:
    """A durable engine re-executing a run: same run and conversation ids, same call ids."""
    h: Harness = harness(POLICY)
    probe = Probe()
    calls = [("add_score", {"lead_id": "b", "delta": 10}, "c1"),
             ("add_score", {"lead_id": "b", "delta": 20}, "c2")]
    ids = {"run_id": "run-1", "conversation_id": "conv-1"}
    first, second = Script([calls]), Script([calls])
    for script in (first, second):
        toolset = GuardedToolset(lead_tools(probe, sync=mode == "sync"), guard=h.guard,
                                 agent="scorer")
        assert run(h, mode, Agent(script.model(), toolsets=[toolset]), **ids).output == "done"

    assert h.scores() == {"b": 30}
    assert len(h.effects()) == 2
    assert {cid: first.read[cid].content for cid in ("c1", "c2")} == \
        {cid: second.read[cid].content for cid in ("c1", "c2")}
    assert [d for d, _ in h.decisions("c1")] == ["accepted", "replayed"]
    assert h.audit(intent_id="c1")[0].idempotency_key == "thread:conv-1/scorer/c1"


def test_the_agent_comes_from_the_host_never_from_the_model(harness) -> None:
    h: Harness = harness(POLICY)
    probe = Probe()
    calls = [("add_score", {"lead_id": "c", "delta": 1}, "c1")]

    def ask(toolset: GuardedToolset, **options: Any) -> ToolReturnPart:
        script = Script([calls])
        run(h, "sync", Agent(script.model(), toolsets=[toolset]), **options)
        return script.read["c1"]

    tools = lead_tools(probe, sync=True)
    nobody = ask(GuardedToolset(tools, guard=h.guard))
    from_metadata = ask(GuardedToolset(tools, guard=h.guard),
                        metadata={"toolguard_agent": "scorer"}, conversation_id="t2")

    @dataclass
    class Deps:
        toolguard_agent: str

    in_deps = Agent(Script([calls]).model(), deps_type=Deps, toolsets=[GuardedToolset(
        tools, guard=h.guard)])
    in_deps.run_sync("go", deps=Deps("router"), conversation_id="t3")
    by_function = ask(GuardedToolset(tools, guard=h.guard, agent=lambda ctx: "scorer"),
                      conversation_id="t4")

    assert nobody.outcome == "failed"
    assert "missing_identity" in nobody.content
    assert (from_metadata.outcome, by_function.outcome) == ("success", "success")
    agents = [(row.agent, row.decision, row.reason) for row in h.audit(intent_id="c1")]
    assert agents == [(None, "rejected", "missing_identity"), ("scorer", "accepted", "applied"),
                      ("router", "accepted", "applied"), ("scorer", "accepted", "applied")]


def test_arguments_refused_after_the_retries_are_a_failed_result(harness) -> None:
    h: Harness = harness(POLICY)
    bad = [("add_score", {"lead_id": "d", "delta": 500}, "c1")]
    script = Script([bad, [("add_score", {"lead_id": "d", "delta": 600}, "c2")]])
    toolset = GuardedToolset(lead_tools(Probe(), sync=True), guard=h.guard, agent="scorer")
    agent = Agent(script.model(), toolsets=[toolset], retries=1)

    assert run(h, "sync", agent).output == "done"  # no UnexpectedModelBehavior: the run goes on

    assert (script.read["c1"].outcome, script.read["c2"].outcome) == ("retried", "failed")
    assert h.scores() == {}


@pytest.mark.parametrize("mode", MODES)
def test_two_agents_on_one_record(harness, mode: str) -> None:
    """A scorer and a router, each its own PydanticAI agent, at once on one lead, reusing ids."""
    h: Harness = harness(POLICY)
    probe = Probe()
    scorer_calls = [("add_score", {"lead_id": "L", "delta": d}, f"c{d}") for d in (1, 2, 3)]
    router_calls = [("add_score", {"lead_id": "L", "delta": d * 10}, f"c{d}") for d in (1, 2, 3)]
    router_calls.append(("reassign_lead", {"lead_id": "L", "owner": "ana"}, "c9"))
    scripts = {"scorer": Script([scorer_calls]), "router": Script([router_calls])}
    agents = {name: Agent(script.model(), toolsets=[GuardedToolset(
        lead_tools(probe, sync=mode == "sync"), guard=h.guard, agent=name)])
        for name, script in scripts.items()}
    ids = {"conversation_id": "shared-thread"}  # one conversation: the call ids collide

    if mode == "sync":
        threads = [threading.Thread(target=agent.run_sync, args=("go",), kwargs=ids)
                   for agent in agents.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        async def main() -> None:
            async with h.async_edges():
                await asyncio.gather(*(agent.run("go", **ids) for agent in agents.values()))

        asyncio.run(main())

    assert h.scores() == {"L": 66}
    assert probe.peak["L"] == 1
    assert len(h.effects("add_score")) == 6 and len(h.effects("reassign_lead")) == 1
    tokens = [e[4] for e in h.effects("add_score")]
    assert tokens == sorted(tokens)  # commit order is grant order
    keys = {row.idempotency_key for row in h.audit(intent_id="c1")}
    assert keys == {"thread:shared-thread/scorer/c1", "thread:shared-thread/router/c1"}


# --- the hostile corpus through the adapter ---------------------------------------------------

NAMES = ("add", "echo")


def calc_tools() -> FunctionToolset[Any]:
    tools: FunctionToolset[Any] = FunctionToolset()

    @tools.tool_plain
    def add(a: int, b: int) -> int:
        """a + b."""
        return a + b

    @tools.tool_plain
    def echo(text: str) -> str:
        """The text."""
        return text

    return tools


def _as_sent(args: Any) -> str:
    """Args as a provider hands them over: the JSON text the model wrote (or any text at all)."""
    try:
        return json.dumps(args)
    except (TypeError, ValueError, RecursionError):  # past JSON's limits: text that is not JSON
        return "{" + ("[" * 5_000 if isinstance(args, list | dict) else "9" * 5_000)


hostile_call = st.tuples(
    st.sampled_from(NAMES),
    st.fixed_dictionaries({"a": hostile_value, "b": hostile_value}) | hostile_value
    | st.fixed_dictionaries({"a": st.integers(), "b": st.integers()})
    | st.fixed_dictionaries({"text": ODD_TEXT}),
    st.text(max_size=16) | ODD_TEXT | st.text(min_size=250, max_size=300))


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(calls=st.lists(hostile_call, min_size=1, max_size=3, unique_by=lambda c: c[2]))
def test_hostile_calls_through_the_adapter(harness, calls: list[tuple[str, Any, str]]) -> None:
    """Any arguments, any call id (PydanticAI itself refuses duplicate ids in one response)."""
    h = _hostile_harness(harness)
    before = len(h.audit())
    script = Script([[(name, _as_sent(args), cid) for name, args, cid in calls]])
    agent = Agent(script.model(), toolsets=[GuardedToolset(calc_tools(), guard=h.guard,
                                                           agent="calc")], retries=5)

    result = agent.run_sync("go")  # no exception escapes

    assert result.output == "done"
    assert len(h.audit()) - before == len(calls)  # one row per decision, refusals included


_harnesses: dict[int, Harness] = {}


def _hostile_harness(harness: Callable[..., Harness]) -> Harness:
    """One harness per test run of the property (hypothesis calls the body many times)."""
    key = id(harness)
    if key not in _harnesses:
        _harnesses.clear()
        _harnesses[key] = harness(POLICY)
    return _harnesses[key]
