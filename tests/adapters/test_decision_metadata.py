"""The decision travels with the answer, under ``response_metadata["toolguard"]``, and nowhere else.

Accepted and replayed calls come back as the tool's own answer (content,
artifact, status unchanged) with the decision, the lock keys, the fencing
tokens and the idempotency key beside it, where the caller can read them and
the model never does.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.prebuilt import ToolNode

from adapters.conftest import ai, answers, one_node, read_only, run, tool_call
from toolguard.adapters import GuardedToolCalls, guard_tool
from toolguard.adapters._messages import METADATA_KEY

FENCED = {"version": 1, "defaults": {"agents": ["*"]},
          "tools": {"reserve": {"locks": ["room:{room}"]}}}


def reserving(ran: list[str]) -> Any:
    @tool(response_format="content_and_artifact")
    def reserve(room: str) -> tuple[str, dict[str, Any]]:
        """Reserve a room."""
        ran.append(room)
        return f"reserved {room}", {"booking": {"room": room, "seats": 4}}

    return reserve


def graph(guard: Any, tools: list[Any], **options: Any) -> Any:
    calls = GuardedToolCalls(guard, agent="booker", **options)
    return one_node(ToolNode(tools, wrap_tool_call=calls.wrap_tool_call,
                             awrap_tool_call=calls.awrap_tool_call), checkpointer=InMemorySaver())


def test_an_accepted_call_carries_its_decision_keys_and_tokens(guarded) -> None:
    g = guarded(FENCED)
    ran: list[str] = []
    out = run(graph(g.guard, [reserving(ran)]), "sync", ai(tool_call("reserve", {"room": "r1"})),
              {"configurable": {"thread_id": "t1"}})

    message = answers(out)["c1"]
    assert (message.content, message.status) == ("reserved r1", "success")
    assert message.artifact == {"booking": {"room": "r1", "seats": 4}}  # the tool's own, untouched
    meta = message.response_metadata[METADATA_KEY]
    (row,) = g.audit(intent_id="c1")
    assert meta == {"decision": "accepted", "reason": "applied", "keys": list(row.keys),
                    "tokens": dict(row.tokens), "idempotency_key": row.idempotency_key}
    assert meta["keys"] and all(isinstance(t, int) and t > 0 for t in meta["tokens"].values())
    assert set(meta["tokens"]) == set(meta["keys"])
    shown = json.dumps([message.content, message.artifact])
    assert not any(str(token) in shown for token in meta["tokens"].values())


def test_a_replayed_call_answers_as_the_first_time_and_says_so(guarded) -> None:
    g = guarded({**FENCED, "tools": {"reserve": {"locks": ["room:{room}"],
                                                 "idempotency_key": "reserve:{room}"}}})
    ran: list[str] = []
    app = graph(g.guard, [reserving(ran)])
    config = {"configurable": {"thread_id": "t1"}}
    first = answers(run(app, "sync", ai(tool_call("reserve", {"room": "r1"})), config))["c1"]

    again = run(app, "sync", ai(tool_call("reserve", {"room": "r1"})), config)

    replayed = [m for m in again["messages"] if isinstance(m, ToolMessage)][-1]
    assert ran == ["r1"]
    assert (replayed.content, replayed.status) == (first.content, "success")
    meta = replayed.response_metadata[METADATA_KEY]
    assert (meta["decision"], meta["reason"]) == ("replayed", "duplicate")
    assert meta["idempotency_key"] == first.response_metadata[METADATA_KEY]["idempotency_key"]
    assert g.decisions("c1") == [("accepted", "applied"), ("replayed", "duplicate")]


def test_a_refusal_carries_its_reason(guarded) -> None:
    g = guarded(FENCED)
    out = run(graph(g.guard, [reserving([])]), "sync",
              ai(tool_call("reserve", {"room": "r1", "vip": True})),
              {"configurable": {"thread_id": "t1"}})

    meta = answers(out)["c1"].response_metadata[METADATA_KEY]
    assert (meta["decision"], meta["reason"]) == ("rejected", "invalid_arguments")
    assert meta["tokens"] == {}


def test_metadata_false_leaves_the_answers_as_toolnode_made_them(guarded) -> None:
    g = guarded(read_only("reserve"))
    out = run(graph(g.guard, [reserving([])], metadata=False), "sync",
              ai(tool_call("reserve", {"room": "r1"}), tool_call("nope", {}, "c2")),
              {"configurable": {"thread_id": "t1"}})

    assert all(m.response_metadata == {} for m in answers(out).values())
    # ToolNode runs the two calls concurrently: their audit rows come in either order
    assert (g.decisions("c1"), g.decisions("c2")) == ([("accepted", "applied")],
                                                      [("rejected", "unknown_tool")])


def test_guard_tool_answers_carry_the_decision_too(guarded) -> None:
    g = guarded(read_only("reserve"))
    guarded_reserve = guard_tool(g.guard, reserving([]), agent="booker")

    message = guarded_reserve.invoke(tool_call("reserve", {"room": "r2"}))

    assert message.artifact == {"booking": {"room": "r2", "seats": 4}}
    assert message.response_metadata[METADATA_KEY]["decision"] == "accepted"
    assert guarded_reserve.invoke({"room": "r3"}) == "reserved r3"  # plain arguments: plain output


@pytest.mark.parametrize("metadata", [True, False])
def test_the_tools_own_response_metadata_is_kept(guarded, metadata: bool) -> None:
    g = guarded(read_only("tagged"))

    @tool
    def tagged() -> ToolMessage:
        """Answer with metadata of its own."""
        return ToolMessage("ok", tool_call_id="c1", response_metadata={"source": "cache"})

    out = run(graph(g.guard, [tagged], metadata=metadata), "sync", ai(tool_call("tagged", {})),
              {"configurable": {"thread_id": "t1"}})

    meta = answers(out)["c1"].response_metadata
    assert meta["source"] == "cache"
    assert (METADATA_KEY in meta) is metadata
