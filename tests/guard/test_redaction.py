"""What a policy redacts is stored in clear nowhere toolguard writes.

``redact: [email]`` used to hide the argument in the audit log while
``toolguard_intent.result`` kept the tool's output, e-mail address included.
Now every occurrence of a redacted value is masked in the recorded result, the
audit rows, the failed intent's error and the log; the caller still gets the
result in clear, and a replay returns the recorded (masked) result.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver

from guard.harness import Harness, HarnessFactory
from guard.tools import EFFECT, calls_message, scripted, tool_graph
from toolguard.adapters import GuardedToolCalls, guarded
from toolguard.call.context import current
from toolguard.policies import REDACTED

EMAIL = "ana.verified@example.org"
POLICY: dict[str, Any] = {"version": 1, "tools": {
    "verify_email": {"locks": ["lead:{lead_id}"], "redact": ["email"]},
}}


def everything_written(h: Harness) -> str:
    """Every row of every table toolguard writes, as text."""
    rows = [*h.sql("SELECT * FROM toolguard_intent"), *h.sql("SELECT * FROM toolguard_audit")]
    return repr(rows)


def test_the_recorded_result_is_masked_and_the_caller_gets_it_in_clear(
        harness: HarnessFactory, caplog: pytest.LogCaptureFixture) -> None:
    h: Harness = harness(POLICY)

    @guarded(h.guard, agent="verifier")
    def verify_email(lead_id: str, email: str) -> dict[str, Any]:
        ctx = current()
        ctx.tx.execute(EFFECT, ("verify_email", lead_id, 0, ctx.intent.call_id, 1))
        return {"lead": lead_id, "email": email, "note": f"{email} is deliverable",
                "by_address": {email: True}}

    args = {"lead_id": "L-7", "email": EMAIL}
    with caplog.at_level(logging.DEBUG, logger="toolguard"):
        first = verify_email.run(args, call_id="c1", thread_id="t1")
        again = verify_email.run(args, call_id="c1", thread_id="t1")

    assert first.kind == "accepted"
    assert first.result == {"lead": "L-7", "email": EMAIL, "note": f"{EMAIL} is deliverable",
                            "by_address": {EMAIL: True}}
    assert again.kind == "replayed"
    assert again.result == {"lead": "L-7", "email": REDACTED,
                            "note": f"{REDACTED} is deliverable", "by_address": {REDACTED: True}}
    assert EMAIL not in everything_written(h)
    assert EMAIL not in caplog.text
    assert len(h.effects()) == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_replayed_tool_message_is_masked(harness: HarnessFactory, mode: str) -> None:
    h: Harness = harness(POLICY)

    def verify_email(lead_id: str, email: str) -> str:
        """Verify a lead's e-mail address."""
        return f"verified {email} for {lead_id}"

    async def averify_email(lead_id: str, email: str) -> str:
        return f"verified {email} for {lead_id}"

    tool = StructuredTool.from_function(func=verify_email, coroutine=averify_email)
    calls = GuardedToolCalls(h.guard, agent="verifier")
    call = ("verify_email", {"lead_id": "L-7", "email": EMAIL}, "c1")
    model = scripted(calls_message(call), calls_message(call), AIMessage(content="done"))
    app = tool_graph(model, [tool], wrap=calls.wrap_tool_call, awrap=calls.awrap_tool_call,
                     checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"t-{uuid.uuid4().hex}"}}
    inputs = {"messages": [HumanMessage("verify")]}

    if mode == "sync":
        out = app.invoke(inputs, config)
    else:
        async def main() -> Any:
            async with h.async_edges():
                return await app.ainvoke(inputs, config)

        out = asyncio.run(main())

    contents = [m.content for m in out["messages"] if getattr(m, "tool_call_id", None) == "c1"]
    assert contents == [f"verified {EMAIL} for L-7", f"verified {REDACTED} for L-7"]
    assert h.decisions("c1") == [("accepted", "applied"), ("replayed", "duplicate")]
    assert EMAIL not in everything_written(h)


def test_a_failure_naming_a_redacted_value_is_masked_everywhere(
        harness: HarnessFactory, caplog: pytest.LogCaptureFixture) -> None:
    h: Harness = harness(POLICY)

    @guarded(h.guard, agent="verifier")
    def verify_email(lead_id: str, email: str) -> str:
        current().tx.execute(EFFECT, ("verify_email", lead_id, 0, "c1", 1))
        raise ValueError(f"mailbox {email} does not exist")

    with caplog.at_level(logging.DEBUG, logger="toolguard"):
        decision = verify_email.run({"lead_id": "L-7", "email": EMAIL}, call_id="c1",
                                    thread_id="t1")

    assert (decision.kind, decision.reason) == ("failed", "error")
    assert EMAIL not in decision.message and REDACTED in decision.message
    assert EMAIL not in decision.model_text() and "ValueError" in decision.model_text()
    assert EMAIL not in everything_written(h)
    assert EMAIL not in caplog.text
    assert h.effects() == []  # rolled back
    (entry,) = h.audit(intent_id="c1")
    assert entry.detail and REDACTED in entry.detail


def test_a_redacted_number_is_masked_where_a_value_equals_it(harness: HarnessFactory) -> None:
    h: Harness = harness({"version": 1, "tools": {
        "set_pin": {"locks": ["lead:{lead_id}"], "redact": ["pin"]}}})

    @guarded(h.guard, agent="verifier")
    def set_pin(lead_id: str, pin: int) -> dict[str, Any]:
        return {"pin": pin, "lead": lead_id, "text": f"pin {pin} set", "count": 7}

    first = set_pin.run({"lead_id": "L-7", "pin": 7}, call_id="c1", thread_id="t1")
    again = set_pin.run({"lead_id": "L-7", "pin": 7}, call_id="c1", thread_id="t1")
    long_pin = set_pin.run({"lead_id": "L-8", "pin": 48213}, call_id="c2", thread_id="t1")
    long_again = set_pin.run({"lead_id": "L-8", "pin": 48213}, call_id="c2", thread_id="t1")

    assert first.result["pin"] == 7 and again.result["pin"] == REDACTED
    # A one-digit secret is masked where a whole value equals it, not inside every text.
    assert again.result["text"] == "pin 7 set" and again.result["lead"] == "L-7"
    assert long_pin.result["text"] == "pin 48213 set"
    assert long_again.result == {"pin": REDACTED, "lead": "L-8", "text": f"pin {REDACTED} set",
                                 "count": 7}
    assert again.result["count"] == REDACTED  # any value equal to the secret: over-masking is safe
    assert "48213" not in everything_written(h)
