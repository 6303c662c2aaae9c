"""The approval step: after validation and keys, before quotas and locks.

``approve(book, prepared, facts, ...)`` returns None (no approval needed),
the ``Approved`` record that binds this very intent, or raises the refusal:
``ApprovalRequired`` (a request is pending: its id is on the error),
``ApprovalDenied``, ``ApprovalExpired``, ``ApprovalMismatch``,
``InvalidResume``.

Two ways to wait for the person:

- a plain caller gets ``ApprovalRequired`` and calls again with the same
  intent (same idempotency key) once someone ran ``toolguard approve ID`` or
  ``toolguard deny ID``;
- in LangGraph the adapter passes ``interrupt`` (LangGraph's): the step calls
  it with the request's payload, and the value the graph is resumed with
  decides (``parse_resume``). LangGraph re-runs the node from its top on
  resume, so the step runs twice for one decision: the request is audited
  once, when it is made (``on_request``), and the ``GraphInterrupt`` that
  pauses the graph is marked (``is_pending``) so that the guard neither
  audits it again nor records the call's outcome as unknown: nothing ran.

In ``mode: shadow`` no request is made and nobody is asked: a call that
would need approval is recorded as the would-be refusal ``approval_required``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from toolguard.approvals import (
    ApprovalBook,
    Approved,
    AsyncApprovalBook,
    approval_reason,
    bind,
    parse_resume,
)
from toolguard.errors import ApprovalRequired, GuardMisconfigured, is_control_flow
from toolguard.facts import CallFacts
from toolguard.shadow import Enforcement
from toolguard.steps.prepared import Prepared

__all__ = ["Interrupt", "aapprove", "approve", "is_pending"]

#: LangGraph's ``interrupt``: pauses the graph with a payload, returns the resume value.
Interrupt = Callable[[Any], Any]

_PENDING = "_toolguard_approval_pending"
_NO_BOOK = ("tool {tool!r} needs approval, and this guard has no store to keep approval "
            "requests in: give the ToolGuard a store (store= / async_store=)")


def is_pending(error: BaseException) -> bool:
    """True for the interrupt that pauses a call until a person decides (nothing ran)."""
    return bool(getattr(error, _PENDING, False))


def _mark_pending(error: BaseException) -> None:
    with contextlib.suppress(AttributeError, TypeError):
        setattr(error, _PENDING, True)


def _shadowed(prepared: Prepared, facts: CallFacts, enforcement: Enforcement) -> bool:
    """In shadow mode: record a would-be ``approval_required``; True when the mode is shadow."""
    if not enforcement.shadow:
        return False
    why = approval_reason(prepared.rule, facts.args)
    if why is not None:
        with enforcement.step("approval"):
            raise ApprovalRequired(f"{facts.tool} would need approval ({why})", approval_id="")
    return True


def _payload(asked: ApprovalRequired, call_id: str | None) -> Any:
    request = asked.request
    if isinstance(request, dict):
        return {**request, "tool_call_id": call_id}
    return request


def _interrupted(interrupt: Interrupt, payload: Any) -> Any:
    try:
        return interrupt(payload)
    except BaseException as error:
        if is_control_flow(error):
            _mark_pending(error)  # the graph pauses here: nothing ran, nothing is unknown
        raise


def approve(book: ApprovalBook | None, prepared: Prepared, facts: CallFacts,
            enforcement: Enforcement, *, call_id: str | None = None,
            interrupt: Interrupt | None = None,
            on_request: Callable[[ApprovalRequired], None] | None = None) -> Approved | None:
    """The binding approval of this call, None when it needs none, or the refusal (sync)."""
    rule = prepared.rule
    if rule.approval is None or _shadowed(prepared, facts, enforcement):
        return None
    why = approval_reason(rule, facts.args)
    if why is None:
        return None
    if book is None:
        raise GuardMisconfigured(_NO_BOOK.format(tool=facts.tool))
    record = book.find(facts.tool, facts.idempotency_key)
    fresh = record is None
    if record is None:
        record = book.request(facts, why, rule.approval.expires)
    try:
        return bind(record, facts, book.clock())
    except ApprovalRequired as asked:
        if interrupt is None:
            raise
        if fresh and on_request is not None:
            on_request(asked)
        answer = _interrupted(interrupt, _payload(asked, call_id))
        resume = parse_resume(answer, approval_id=asked.approval_id)
        return book.check(rule, facts, resume=resume)


async def aapprove(book: AsyncApprovalBook | None, prepared: Prepared, facts: CallFacts,
                   enforcement: Enforcement, *, call_id: str | None = None,
                   interrupt: Interrupt | None = None,
                   on_request: Callable[[ApprovalRequired], Awaitable[None]] | None = None
                   ) -> Approved | None:
    """The asyncio twin of ``approve``."""
    rule = prepared.rule
    if rule.approval is None or _shadowed(prepared, facts, enforcement):
        return None
    why = approval_reason(rule, facts.args)
    if why is None:
        return None
    if book is None:
        raise GuardMisconfigured(_NO_BOOK.format(tool=facts.tool))
    record = await book.find(facts.tool, facts.idempotency_key)
    fresh = record is None
    if record is None:
        record = await book.request(facts, why, rule.approval.expires)
    try:
        return bind(record, facts, book.clock())
    except ApprovalRequired as asked:
        if interrupt is None:
            raise
        if fresh and on_request is not None:
            await on_request(asked)
        answer = _interrupted(interrupt, _payload(asked, call_id))
        resume = parse_resume(answer, approval_id=asked.approval_id)
        return await book.check(rule, facts, resume=resume)
