"""OpenAI Agents SDK agents with guarded function tools, driven by an offline ``Model``.

``Script`` is a ``Model`` that answers as the Responses API does: a response
of parallel ``function_call`` items (the SDK runs them concurrently), then a
message once it has read the tool outputs. Each test runs on the embedded
default and on Redis + PostgreSQL (the ``harness`` fixture).
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
from agents import Agent, FunctionTool, RunConfig, Runner, function_tool
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.usage import Usage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from guard.harness import Harness
from guard.test_pydantic_ai import EFFECT, POLICY, READ, UPSERT, Probe
from toolguard.adapters.openai_agents import guard_tools
from toolguard.call.context import current

Call = tuple[str, Any, str]  # (tool name, args as the model sends them, call id)


class Script(Model):
    """Sends ``turns`` of parallel function calls, then a message; keeps the outputs it read."""

    def __init__(self, turns: Sequence[Sequence[Call]]) -> None:
        self.turns = list(turns)
        self.read: dict[str, Any] = {}

    async def get_response(self, system_instructions: Any, input: Any, model_settings: Any,
                           tools: Any, output_schema: Any, handoffs: Any, tracing: Any,
                           **_: Any) -> ModelResponse:
        for item in input if isinstance(input, list) else []:
            if isinstance(item, dict) and item.get("type") == "function_call_output":
                self.read[item["call_id"]] = item["output"]
        if not self.turns:
            text = ResponseOutputText(type="output_text", text="done", annotations=[])
            return ModelResponse(output=[ResponseOutputMessage(
                id="msg", type="message", role="assistant", status="completed", content=[text])],
                usage=Usage(), response_id=None)
        calls = self.turns.pop(0)
        return ModelResponse(output=[ResponseFunctionToolCall(
            type="function_call", name=name, call_id=cid, id=f"fc_{n}",
            arguments=args if isinstance(args, str) else json.dumps(args))
            for n, (name, args, cid) in enumerate(calls)], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def lead_tools(probe: Probe, *, sync: bool) -> list[FunctionTool]:
    """``add_score`` (a read-modify-write with a pause inside) and ``reassign_lead``."""
    if sync:
        @function_tool
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

        @function_tool
        def reassign_lead(lead_id: str, owner: str) -> str:
            """Give the lead to ``owner``."""
            current().tx.execute(EFFECT, ("reassign_lead", lead_id, 0, owner, 0))
            return f"{lead_id} -> {owner}"

        return [add_score, reassign_lead]

    @function_tool(name_override="add_score")
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

    @function_tool(name_override="reassign_lead")
    async def reassign_lead_async(lead_id: str, owner: str) -> str:
        """Give the lead to ``owner``."""
        await current().atx.execute(EFFECT, ("reassign_lead", lead_id, 0, owner, 0))
        return f"{lead_id} -> {owner}"

    return [add_score_async, reassign_lead_async]


def config(thread: str | None = "thread-1") -> RunConfig:
    return RunConfig(group_id=thread, tracing_disabled=True)


def run(h: Harness, mode: str, agent: Agent[Any], **options: Any) -> Any:
    options.setdefault("run_config", config())
    if mode == "sync":
        return Runner.run_sync(agent, "go", **options)

    async def main() -> Any:
        async with h.async_edges():
            return await Runner.run(agent, "go", **options)

    return asyncio.run(main())


MODES = ["sync", "async"]


@pytest.mark.parametrize("mode", MODES)
def test_parallel_calls_are_serialized_and_refusals_are_the_tools_answer(harness, mode: str) -> None:
    h: Harness = harness(POLICY)
    probe = Probe()
    on_a = [("add_score", {"lead_id": "a", "delta": d}, f"a{d}") for d in range(1, 6)]
    refused = [("add_score", {"lead_id": "a", "delta": "9"}, "c-type"),
               ("add_score", {"lead_id": "a", "delta": 1, "agent": "router"}, "c-extra"),
               ("add_score", '{"lead_id": "a", "delta": 1', "c-json"),
               ("reassign_lead", {"lead_id": "a", "owner": "x"}, "c-denied")]
    model = Script([[*on_a, *refused]])
    agent = Agent(name="scorer", model=model,
                  tools=guard_tools(h.guard, lead_tools(probe, sync=mode == "sync"), agent="scorer"))

    result = run(h, mode, agent)

    assert result.final_output == "done"
    assert probe.peak["a"] == 1
    assert h.scores() == {"a": 15}
    assert sorted(e[2] for e in h.effects()) == [1, 2, 3, 4, 5]
    assert max(int(model.read[cid]) for _, _, cid in on_a) == 15  # each call read its own sum
    assert model.read["c-type"].startswith("rejected by toolguard (invalid_arguments)")
    assert model.read["c-denied"].startswith("rejected by toolguard (not_authorized)")
    for _, _, cid in [*on_a, *refused]:
        assert len(h.decisions(cid)) == 1, cid
    assert {cid: h.decisions(cid)[0] for _, _, cid in refused} == {
        "c-type": ("rejected", "invalid_arguments"), "c-extra": ("rejected", "invalid_arguments"),
        "c-json": ("rejected", "invalid_arguments"), "c-denied": ("rejected", "not_authorized")}


@pytest.mark.parametrize("mode", MODES)
def test_a_rerun_in_the_same_conversation_replays(harness, mode: str) -> None:
    h: Harness = harness(POLICY)
    probe = Probe()
    calls = [("add_score", {"lead_id": "b", "delta": 10}, "c1"),
             ("add_score", {"lead_id": "b", "delta": 20}, "c2")]
    first, second = Script([calls]), Script([calls])
    for model in (first, second):
        tools = guard_tools(h.guard, lead_tools(probe, sync=mode == "sync"), agent="scorer")
        assert run(h, mode, Agent(name="scorer", model=model, tools=tools),
                   run_config=config("conv-1")).final_output == "done"

    assert h.scores() == {"b": 30}
    assert len(h.effects()) == 2
    assert first.read == second.read
    assert [d for d, _ in h.decisions("c1")] == ["accepted", "replayed"]
    assert h.audit(intent_id="c1")[0].idempotency_key == "thread:conv-1/scorer/c1"


def test_a_tool_that_raises_is_rolled_back_and_answered_as_the_sdk_does(harness) -> None:
    h: Harness = harness(POLICY)

    @function_tool
    def add_score(lead_id: str, delta: int) -> int:
        """Writes, then fails."""
        current().tx.execute(UPSERT, (lead_id, 999))
        raise RuntimeError("the CRM timed out")

    model = Script([[("add_score", {"lead_id": "e", "delta": 1}, "c1")]])
    agent = Agent(name="scorer", model=model, tools=guard_tools(h.guard, [add_score],
                                                                 agent="scorer"))
    assert run(h, "sync", agent).final_output == "done"

    assert h.scores() == {}
    assert h.decisions("c1") == [("failed", "error")]
    assert "error occurred while running the tool" in model.read["c1"]


def test_the_agent_comes_from_the_host_never_from_the_model(harness) -> None:
    h: Harness = harness(POLICY)
    probe = Probe()

    def ask(thread: str, context: Any = None, **guarding: Any) -> str:
        model = Script([[("add_score", {"lead_id": "c", "delta": 1}, "c1")]])
        tools = guard_tools(h.guard, lead_tools(probe, sync=True), **guarding)
        run(h, "sync", Agent(name="scorer", model=model, tools=tools), context=context,
            run_config=config(thread))
        return str(model.read["c1"])

    @dataclass
    class Deps:
        toolguard_agent: str

    nobody = ask("t1")  # the SDK agent is named "scorer": a name is not an identity
    assert nobody.startswith("rejected by toolguard (missing_identity)")
    ask("t2", Deps("router"))
    ask("t3", {"toolguard_agent": "scorer"})
    ask("t4", agent=lambda ctx: "scorer")
    agents = [(row.agent, row.decision, row.reason) for row in h.audit(intent_id="c1")]
    assert agents == [(None, "rejected", "missing_identity"), ("router", "accepted", "applied"),
                      ("scorer", "accepted", "applied"), ("scorer", "accepted", "applied")]


@pytest.mark.parametrize("mode", MODES)
def test_two_agents_on_one_record(harness, mode: str) -> None:
    """A scorer and a router, each its own SDK agent, at once on one lead, reusing call ids."""
    h: Harness = harness(POLICY)
    probe = Probe()
    scorer_calls = [("add_score", {"lead_id": "L", "delta": d}, f"c{d}") for d in (1, 2, 3)]
    router_calls = [("add_score", {"lead_id": "L", "delta": d * 10}, f"c{d}") for d in (1, 2, 3)]
    router_calls.append(("reassign_lead", {"lead_id": "L", "owner": "ana"}, "c9"))
    agents = {name: Agent(name=name, model=Script([calls]), tools=guard_tools(
        h.guard, lead_tools(probe, sync=mode == "sync"), agent=name))
        for name, calls in (("scorer", scorer_calls), ("router", router_calls))}
    shared = config("shared-thread")  # one conversation: the call ids collide

    if mode == "sync":
        threads = [threading.Thread(target=Runner.run_sync, args=(agent, "go"),
                                    kwargs={"run_config": shared}) for agent in agents.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        async def main() -> None:
            async with h.async_edges():
                await asyncio.gather(*(Runner.run(agent, "go", run_config=shared)
                                       for agent in agents.values()))

        asyncio.run(main())

    assert h.scores() == {"L": 66}
    assert probe.peak["L"] == 1
    assert len(h.effects("add_score")) == 6 and len(h.effects("reassign_lead")) == 1
    tokens = [e[4] for e in h.effects("add_score")]
    assert tokens == sorted(tokens)
    keys = {row.idempotency_key for row in h.audit(intent_id="c1")}
    assert keys == {"thread:shared-thread/scorer/c1", "thread:shared-thread/router/c1"}


# --- the hostile corpus through the adapter ---------------------------------------------------


def calc_tools() -> list[FunctionTool]:
    @function_tool
    def add(a: int, b: int) -> int:
        """a + b."""
        return a + b

    @function_tool
    def echo(text: str) -> str:
        """The text."""
        return text

    return [add, echo]


def _as_sent(args: Any) -> str:
    """The JSON text the model wrote (or any text at all)."""
    try:
        return json.dumps(args)
    except (TypeError, ValueError, RecursionError):  # past JSON's limits: text that is not JSON
        return "{" + ("[" * 5_000 if isinstance(args, list | dict) else "9" * 5_000)


def _sdk_takes(call_id: str) -> bool:
    """Call ids the SDK itself refuses before any tool runs: empty, or not valid Unicode."""
    try:
        return bool(call_id) and bool(call_id.encode("utf-8"))
    except UnicodeEncodeError:
        return False


def _sdk_reads(args: Any) -> bool:
    """Arguments the SDK itself can fingerprint: it dedupes a response's calls before any tool
    runs, and raises on a lone surrogate, or JSON nested more than about 600 levels."""
    try:
        value = json.loads(_as_sent(args))
    except (ValueError, RecursionError):
        return True  # not JSON: the SDK keeps the text
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except (ValueError, RecursionError, UnicodeEncodeError):
        return False
    return _depth(value) <= 500


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest


hostile_call = st.tuples(
    st.sampled_from(("add", "echo")),
    st.fixed_dictionaries({"a": hostile_value, "b": hostile_value}) | hostile_value
    | st.fixed_dictionaries({"a": st.integers(), "b": st.integers()})
    | st.fixed_dictionaries({"text": ODD_TEXT}),
    (st.text(min_size=1, max_size=16) | ODD_TEXT | st.text(min_size=250, max_size=300))
    .filter(_sdk_takes)).filter(lambda call: _sdk_reads(call[1]))

_harnesses: dict[int, Harness] = {}


def _hostile_harness(harness: Callable[..., Harness]) -> Harness:
    """One harness per test run of the property (hypothesis calls the body many times)."""
    key = id(harness)
    if key not in _harnesses:
        _harnesses.clear()
        _harnesses[key] = harness(POLICY)
    return _harnesses[key]


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(calls=st.lists(hostile_call, min_size=1, max_size=3, unique_by=lambda c: c[2]))
def test_hostile_calls_through_the_adapter(harness, calls: list[tuple[str, Any, str]]) -> None:
    """Any arguments, any call id the SDK takes (it refuses empty, duplicate and surrogate ids
    itself): every call answered, each decision audited once."""
    h = _hostile_harness(harness)
    before = len(h.audit())
    model = Script([[(name, _as_sent(args), cid) for name, args, cid in calls]])
    agent = Agent(name="calc", model=model, tools=guard_tools(h.guard, calc_tools(),
                                                              agent="calc"))

    result = Runner.run_sync(agent, "go", run_config=config())  # no exception escapes

    assert result.final_output == "done"
    assert len(h.audit()) - before == len(calls)
