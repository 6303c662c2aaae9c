"""Policy rules enforced at call time: ordering (``after:``), unfenced tools, stale holders.

Through the plain-function adapter (``@guarded``) and, for ordering, a ToolNode
running both tools of the rule as parallel calls.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import StructuredTool

from guard.harness import Harness, wait_until
from guard.tools import EFFECT, READ, UPSERT, calls_message, scripted, tool_graph, tool_messages
from toolguard.adapters import GuardedToolCalls, guarded
from toolguard.call.context import current
from toolguard.errors import IntentRejected, OutOfOrder
from toolguard.locks import heartbeat


def ordering_policy(after_wait_s: float) -> dict[str, Any]:
    return {"version": 1, "tools": {
        "attach_log": {"locks": ["ticket:{ticket_id}"]},
        "close_ticket": {"locks": ["ticket:{ticket_id}"], "after": ["attach_log"],
                         "after_wait_s": after_wait_s},
    }}


def effect(tool: str, resource: str, delta: int = 0) -> None:
    ctx = current()
    ctx.tx.execute(EFFECT, (tool, resource, delta, ctx.intent.call_id, max(ctx.tokens.values())))


def ticket_functions(h: Harness) -> tuple[Any, Any]:
    @guarded(h.guard, agent="support")
    def attach_log(ticket_id: str) -> str:
        effect("attach_log", ticket_id)
        return "attached"

    @guarded(h.guard, agent="support")
    def close_ticket(ticket_id: str) -> str:
        effect("close_ticket", ticket_id)
        return "closed"

    return attach_log, close_ticket


# --- ordering ------------------------------------------------------------------------------


def test_a_later_tool_without_the_earlier_record_is_rejected_out_of_order(harness) -> None:
    h: Harness = harness(ordering_policy(after_wait_s=0.2))
    attach_log, close_ticket = ticket_functions(h)
    assert attach_log.run({"ticket_id": "t2"}, call_id="attach-t2", thread_id="w").ok

    decision = close_ticket.run({"ticket_id": "t1"}, call_id="close-t1", thread_id="w")

    assert (decision.kind, decision.reason) == ("rejected", "out_of_order")
    assert "attach_log" in decision.message and "ticket:t1" in decision.message
    assert h.decisions("close-t1") == [("rejected", "out_of_order")]
    with pytest.raises(OutOfOrder):  # plain Python callers get the typed error
        close_ticket("t1")
    assert [row[0] for row in h.effects()] == ["attach_log"]


def test_a_later_tool_waits_for_the_earlier_one(harness) -> None:
    h: Harness = harness(ordering_policy(after_wait_s=10))
    attach_log, close_ticket = ticket_functions(h)
    polled = threading.Event()
    has_applied = h.store.has_applied

    def spy(tool: str, key: str, workflow: str | None = None) -> bool:
        found = has_applied(tool, key, workflow)
        polled.set()
        return found

    h.store.has_applied = spy  # type: ignore[method-assign]
    decisions: dict[str, Any] = {}
    closer = threading.Thread(target=lambda: decisions.setdefault(
        "close", close_ticket.run({"ticket_id": "t1"}, call_id="close", thread_id="w")))
    closer.start()
    assert polled.wait(10)  # close_ticket looked, found nothing, and is waiting
    assert attach_log.run({"ticket_id": "t1"}, call_id="attach", thread_id="w").ok
    closer.join(15)

    assert decisions["close"].kind == "accepted"
    assert [(row[0], row[3]) for row in h.effects()] == [("attach_log", "attach"),
                                                         ("close_ticket", "close")]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_parallel_calls_in_one_tool_node_keep_their_order(harness, mode: str) -> None:
    h: Harness = harness(ordering_policy(after_wait_s=10))

    def attach_log(ticket_id: str) -> str:
        """Attach the log."""
        effect("attach_log", ticket_id)
        return "attached"

    async def aattach_log(ticket_id: str) -> str:
        ctx = current()
        await ctx.atx.execute(EFFECT, ("attach_log", ticket_id, 0, ctx.intent.call_id, 1))
        return "attached"

    def close_ticket(ticket_id: str) -> str:
        """Close the ticket."""
        effect("close_ticket", ticket_id)
        return "closed"

    async def aclose_ticket(ticket_id: str) -> str:
        ctx = current()
        await ctx.atx.execute(EFFECT, ("close_ticket", ticket_id, 0, ctx.intent.call_id, 2))
        return "closed"

    tools = [StructuredTool.from_function(func=attach_log, coroutine=aattach_log),
             StructuredTool.from_function(func=close_ticket, coroutine=aclose_ticket)]
    calls = GuardedToolCalls(h.guard, agent="support")
    model = scripted(calls_message(("close_ticket", {"ticket_id": "t1"}, "c-close"),
                                   ("attach_log", {"ticket_id": "t1"}, "c-attach")),
                     AIMessage(content="done"))
    app = tool_graph(model, tools, wrap=calls.wrap_tool_call, awrap=calls.awrap_tool_call)
    inputs = {"messages": [HumanMessage("close t1")]}

    if mode == "sync":
        out = app.invoke(inputs)
    else:
        async def main() -> Any:
            async with h.async_edges():
                return await app.ainvoke(inputs)

        out = asyncio.run(main())

    answers = tool_messages(out["messages"])
    assert (answers["c-close"].content, answers["c-attach"].content) == ("closed", "attached")
    assert [row[0] for row in h.effects()] == ["attach_log", "close_ticket"]


# --- unfenced tools --------------------------------------------------------------------------


UNFENCED_POLICY: dict[str, Any] = {"version": 1, "tools": {
    "notify_crm": {"locks": ["lead:{lead_id}"], "fenced": False},
    "notify_keyed": {"locks": ["lead:{lead_id}"], "fenced": False,
                     "idempotency_key": "{lead_id}:{event}"},
}}


def test_unfenced_tool_without_a_stable_idempotency_key_is_refused(harness) -> None:
    h: Harness = harness(UNFENCED_POLICY)
    sent: list[tuple[str, str]] = []  # what the "external API" received, with its key

    @guarded(h.guard, agent="crm")
    def notify_crm(lead_id: str, event: str) -> str:
        sent.append((event, current().idempotency_key))
        return "sent"

    @guarded(h.guard, agent="crm")
    def notify_keyed(lead_id: str, event: str) -> str:
        sent.append((event, current().idempotency_key))
        return "sent"

    args = {"lead_id": "a", "event": "won"}
    no_identity = notify_crm.run(args)
    call_id_only = notify_crm.run(args, call_id="c0")  # a call id alone is not stable
    assert (no_identity.reason, call_id_only.reason) == ("missing_idempotency_key",) * 2
    assert no_identity.kind == "rejected"
    assert h.decisions("c0") == [("rejected", "missing_idempotency_key")]
    with pytest.raises(IntentRejected) as raised:
        notify_crm("a", "won")
    assert raised.value.reason == "missing_idempotency_key"
    assert sent == []

    first = notify_crm.run(args, call_id="c1", thread_id="t1")
    again = notify_crm.run(args, call_id="c1", thread_id="t1")
    assert (first.kind, again.kind) == ("accepted", "replayed")
    keyed = [notify_keyed.run({"lead_id": "a", "event": "lost"}) for _ in range(2)]
    assert [d.kind for d in keyed] == ["accepted", "replayed"]
    assert [event for event, _ in sent] == ["won", "lost"]  # each external call went out once
    assert sent[0][1] == first.idempotency_key and sent[1][1] == "notify_keyed:a:lost"


# --- stale holders ---------------------------------------------------------------------------


STALE_POLICY: dict[str, Any] = {"version": 1, "tools": {
    "add_score": {"locks": ["lead:{lead_id}"], "ttl_ms": 300, "wait_timeout_s": 10},
}}


def score_function(h: Harness, hooks: dict[str, Callable[[Any], None]]) -> Any:
    @guarded(h.guard, agent="scorer")
    def add_score(lead_id: str, delta: int) -> int:
        ctx = current()
        row = ctx.tx.execute(READ, (lead_id,)).fetchone()
        score = (int(row[0]) if row else 0) + delta
        if ctx.intent.call_id in hooks:
            hooks[ctx.intent.call_id](ctx)
        ctx.tx.execute(UPSERT, (lead_id, score))
        effect("add_score", lead_id, delta)
        return score

    return add_score


def in_thread(name: str, target: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.setdefault("value", target()), name=name)
    thread.start()
    return thread, box


def test_holder_that_lost_its_lease_mid_tool_is_refused(harness) -> None:
    """The holder stops renewing (a paused process) inside the tool, another agent takes the
    lock; when the first one wakes up its write is refused (``lease_lost``) and rolled back."""
    h: Harness = harness(STALE_POLICY)
    inside, taken, finished = threading.Event(), threading.Event(), threading.Event()

    def pause(ctx: Any) -> None:
        heartbeat().remove(ctx.lease)  # the process stops: no more renewals
        inside.set()
        assert taken.wait(10)  # ...while the lock expired and went to someone else

    add_score = score_function(h, {"slow": pause})

    def other_agent() -> None:
        assert inside.wait(10)
        with h.backend.locks().acquire(["lead:a"], ttl_ms=5_000, timeout_s=10):
            taken.set()
            assert finished.wait(10)

    other, _ = in_thread("other", other_agent)
    decision = add_score.run({"lead_id": "a", "delta": 1}, call_id="slow", thread_id="w")
    finished.set()
    other.join(10)

    assert (decision.kind, decision.reason) in {("rejected", "lease_lost"),
                                                ("rejected", "stale_fencing_token")}
    assert h.decisions("slow") == [(decision.kind, decision.reason)]
    assert h.scores() == {} and h.effects() == []
    assert add_score.run({"lead_id": "a", "delta": 5}, call_id="next", thread_id="w").ok
    assert h.scores() == {"a": 5}


def test_holder_paused_before_its_write_is_fenced_out(harness) -> None:
    """Paused between the grant and the fenced write, past the TTL, while another agent took
    the lock and wrote: the store refuses the old token (``stale_fencing_token``)."""
    h: Harness = harness(STALE_POLICY)
    add_score = score_function(h, {})
    paused, resume = threading.Event(), threading.Event()
    acquire = h.guard.locks.acquire

    def pausing_acquire(keys: Any, **options: Any) -> Any:
        lease = acquire(keys, **options)
        if threading.current_thread().name == "slow":
            heartbeat().remove(lease)  # e.g. a long GC pause right after the grant
            paused.set()
            assert resume.wait(10)
        return lease

    h.guard.locks.acquire = pausing_acquire  # type: ignore[method-assign]
    slow, box = in_thread("slow", lambda: add_score.run({"lead_id": "a", "delta": 1},
                                                        call_id="slow", thread_id="w"))
    assert paused.wait(10)
    fast = add_score.run({"lead_id": "a", "delta": 100}, call_id="fast", thread_id="w")
    resume.set()
    slow.join(10)

    assert fast.kind == "accepted"
    decision = box["value"]
    assert (decision.kind, decision.reason) == ("rejected", "stale_fencing_token")
    assert h.decisions("slow") == [("rejected", "stale_fencing_token")]
    assert h.scores() == {"a": 100}
    assert [row[3] for row in h.effects()] == ["fast"]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_new_holder_waits_for_the_stale_one_to_roll_back(harness) -> None:
    """PostgreSQL, where two fenced transactions can be open at once: the new holder's
    guarded write blocks on the fence row until the stale holder is refused, then
    reads the untouched score."""
    h: Harness = harness(STALE_POLICY)
    inside = threading.Event()
    grants: list[Any] = []
    acquire = h.guard.locks.acquire

    def counting_acquire(keys: Any, **options: Any) -> Any:
        lease = acquire(keys, **options)
        grants.append(lease)
        return lease

    def pause(ctx: Any) -> None:
        heartbeat().remove(ctx.lease)
        inside.set()
        wait_until(lambda: len(grants) >= 2, what="the other agent's grant")

    h.guard.locks.acquire = counting_acquire  # type: ignore[method-assign]
    add_score = score_function(h, {"slow": pause})
    slow, box = in_thread("slow", lambda: add_score.run({"lead_id": "a", "delta": 1},
                                                        call_id="slow", thread_id="w"))
    assert inside.wait(10)
    fast = add_score.run({"lead_id": "a", "delta": 100}, call_id="fast", thread_id="w")
    slow.join(10)

    assert fast.kind == "accepted" and fast.result == 100
    assert (box["value"].kind, box["value"].reason) == ("rejected", "lease_lost")
    assert h.scores() == {"a": 100}
    assert [row[3] for row in h.effects()] == ["fast"]
    assert [d for d, _ in h.decisions("slow")] == ["rejected"]
    assert len({lease.tokens["lead:a"] for lease in grants}) == 2
