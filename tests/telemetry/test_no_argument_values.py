"""No argument value reaches a span or a metric, hostile or redacted, whatever the call's fate.

Argument values go into lock keys (``lead:{lead_id}``), templated idempotency
keys, validation messages (pydantic quotes the input), the tool's own
exceptions and results. The telemetry records none of them: key counts, tokens,
reason codes and exception class names only, and the idempotency key only
when it is made from the envelope.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from guard.harness import Harness, HarnessFactory
from guard.tools import EFFECT

from telemetry.recorder import Recorder
from toolguard.adapters import guarded
from toolguard.call.context import current
from toolguard.call.intent import Intent

SECRET = "ana.secret@example.org"
LEAD = "LEAD-7f3c9e"
NOTE = "wire-1234567890"
HOSTILE = "x\x00\ud800'; DROP TABLE lead; --"

POLICY: dict[str, Any] = {"version": 1, "tools": {
    "verify_email": {"locks": ["lead:{lead_id}"], "redact": ["email"],
                     "args": {"score": {"ge": 0, "le": 100}}},
    "pay_invoice": {"locks": ["invoice:{invoice}"], "idempotency_key": "{invoice}/{note}"},
}}
VALUES = (SECRET, LEAD, NOTE)


def assert_no_argument_value(otel: Recorder) -> None:
    recorded = [str(v) for v in otel.every_attribute_value()]
    assert recorded, "nothing was recorded: the test would prove nothing"
    for value in VALUES:
        leaked = [text for text in recorded if value in text]
        assert not leaked, f"{value!r} reached the telemetry: {leaked}"


def functions(h: Harness, fail: bool = False) -> tuple[Any, Any]:
    @guarded(h.guard, agent="verifier")
    def verify_email(lead_id: str, email: str, score: int = 0) -> dict[str, Any]:
        ctx = current()
        ctx.tx.execute(EFFECT, ("verify_email", lead_id, score, ctx.intent.call_id, 1))
        if fail:
            raise ValueError(f"{email} of {lead_id} bounced")
        return {"lead": lead_id, "email": email}

    @guarded(h.guard, agent="verifier")
    def pay_invoice(invoice: str, note: str) -> str:
        return f"paid {invoice} ({note})"

    return verify_email, pay_invoice


def test_accepted_replayed_and_refused_calls_record_no_argument_value(
        harness: HarnessFactory, otel: Recorder) -> None:
    h = harness(POLICY)
    verify_email, pay_invoice = functions(h)
    args = {"lead_id": LEAD, "email": SECRET, "score": 10}

    assert verify_email.run(args, call_id="v1", thread_id="t").kind == "accepted"
    assert verify_email.run(args, call_id="v1", thread_id="t").kind == "replayed"
    assert verify_email.run({**args, "score": 1_000}, call_id="v2",
                            thread_id="t").reason == "invalid_arguments"
    assert verify_email.run({**args, "score": SECRET}, call_id="v3",
                            thread_id="t").reason == "invalid_arguments"
    assert verify_email.run({**args, "unexpected": NOTE}, call_id="v4",
                            thread_id="t").reason == "invalid_arguments"
    assert pay_invoice.run({"invoice": LEAD, "note": NOTE}, call_id="p1", thread_id="t").ok

    assert len(otel.calls()) == 6
    assert_no_argument_value(otel)
    # the templated key holds arguments: left out; the envelope's default key is shown
    by_id = {c.attributes["gen_ai.tool.call.id"]: c for c in otel.calls()}
    assert "toolguard.idempotency_key" not in by_id["p1"].attributes
    assert by_id["v1"].attributes["toolguard.idempotency_key"] == "thread:t//v1"


def test_a_tool_failing_with_the_values_in_its_message_records_only_the_class(
        harness: HarnessFactory, otel: Recorder) -> None:
    h = harness(POLICY)
    verify_email, _ = functions(h, fail=True)

    decision = verify_email.run({"lead_id": LEAD, "email": SECRET}, call_id="v1", thread_id="t")

    assert decision.kind == "failed"
    (tool,) = otel.spans("toolguard.tool")
    assert tool.attributes["error.type"] in ("ValueError", "tool_error", "error")
    assert_no_argument_value(otel)


def test_a_hostile_envelope_is_bounded_and_escaped_like_the_audit_log(
        harness: HarnessFactory, otel: Recorder) -> None:
    h = harness(POLICY)
    intent = Intent(tool="verify_email", args={"lead_id": LEAD, "email": SECRET},
                    call_id=HOSTILE * 40, agent="verifier", workflow={"thread_id": "t"})

    decision = h.guard.run(intent, lambda ctx: None)

    assert decision.reason == "invalid_intent"
    (call,) = otel.calls()
    call_id = call.attributes["gen_ai.tool.call.id"]
    assert len(call_id) <= 200 * 6 and "\x00" not in call_id
    call_id.encode("utf-8")  # no lone surrogate left: every exporter can encode it
    (row,) = h.audit()
    assert row.intent_id == call_id
    assert call.attributes["gen_ai.agent.name"] == "verifier"
    assert_no_argument_value(otel)


def test_the_async_path_records_no_argument_value(harness: HarnessFactory,
                                                  otel: Recorder) -> None:
    h = harness(POLICY)

    @guarded(h.guard, agent="verifier")
    async def verify_email(lead_id: str, email: str, score: int = 0) -> dict[str, Any]:
        ctx = current()
        await ctx.atx.execute(EFFECT, ("verify_email", lead_id, score, ctx.intent.call_id, 1))
        return {"lead": lead_id, "email": email}

    async def main() -> list[str]:
        async with h.async_edges():
            args = {"lead_id": LEAD, "email": SECRET}
            return [(await verify_email.arun(a, call_id=c, thread_id="t")).kind
                    for a, c in ((args, "a1"), (args, "a1"), ({**args, "score": -5}, "a2"))]

    assert asyncio.run(main()) == ["accepted", "replayed", "rejected"]
    assert_no_argument_value(otel)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_metric_attributes_are_a_bounded_set(harness: HarnessFactory, otel: Recorder) -> None:
    """Model-chosen tool names do not become metric attribute values (one series each)."""
    h = harness(POLICY)
    for n in range(5):
        h.guard.run(Intent(tool=f"invented_{n}_{SECRET}", call_id=f"u{n}", agent="verifier"),
                    lambda ctx: None)

    assert otel.counts("toolguard.decisions", "gen_ai.tool.name", "toolguard.reason") == {
        ("_OTHER", "unknown_tool"): 5}
    assert not any(SECRET in str(v) for _, attrs, _ in otel.points() for v in attrs.values())
