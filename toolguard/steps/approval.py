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

LangGraph hands a node's resume values out by the order in which its calls
reach ``interrupt()``; the parallel calls of one ``ToolNode`` reach it in any
order. So an answer that names another request's ``approval_id`` is not this
call's: if that request is still waiting (same workflow), the answer decides
it, and this call asks again for its own; an answer naming a request that is
already decided is skipped; one naming no request of this workflow is
refused (``InvalidResume``). An answer that names no id is this call's.

For the same reason the step keeps its place among the task's interrupts: once
the request is decided, a re-run of a task that was resumed takes back the
answers the step read when it asked (it reads them again, as it did, without
deciding anything), so an ``interrupt()`` of the tool itself gets its own
answer, not the person's approval. The interrupt says whether the task was
resumed (``resumed()``); one that cannot say is never read again, nor is a
request made in another workflow (it was asked, if at all, in another task).

In ``mode: shadow`` no request is made and nobody is asked: a call that
would need approval is recorded as the would-be refusal ``approval_required``.

The decision is this module's: whether the call waits for a person (the
policy's condition, shadow mode, a guard with no store), what the guard
answers (nothing to wait for, the binding approval, the refusal, or a pause
for a person), which answer is whose, and that a request is audited once.
The book (``toolguard.controls.approvals``) keeps the records; the step asks it, in
order, for the intent's request (``requested``), what that record means for
this intent now (``binding``) and, once a person answered, to record the
answer (``answered``; ``apply`` for a sibling's request, ``get`` to read one).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from toolguard.call.facts import CallFacts
from toolguard.controls.approvals import (
    ApprovalBook,
    ApprovalRecord,
    Approved,
    AsyncApprovalBook,
    InvalidResume,
    Resume,
    approval_reason,
    parse_resume,
    request_refusal,
)
from toolguard.controls.shadow import Enforcement
from toolguard.errors import (
    ApprovalRequired,
    GuardMisconfigured,
    IntentRejected,
    UnknownApproval,
    is_control_flow,
)
from toolguard.runtime.cancellation import finish
from toolguard.steps.prepared import Prepared

__all__ = ["Interrupt", "aapprove", "approve", "is_pending"]

#: LangGraph's ``interrupt``: pauses the graph with a payload, returns the resume value.
Interrupt = Callable[[Any], Any]

_PENDING = "_toolguard_approval_pending"
#: How many answers meant for other requests one call passes on before it gives up.
_MAX_ANSWERS = 64
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


def _resume(answer: Any) -> Resume:
    return parse_resume(answer)  # the id it names (if any) is checked by _whose


def _whose(resume: Resume, asked: ApprovalRequired, other: ApprovalRecord | None,
           facts: CallFacts) -> Literal["mine", "theirs", "spent"]:
    """Whom an answer is for: this call, a sibling's waiting request, or one decided already."""
    if resume.approval_id is None or resume.approval_id == asked.approval_id:
        return "mine"
    if other is None or facts.workflow is None or other.workflow != facts.workflow:
        # no thread and no run: two such calls are not one workflow, whatever they share
        msg = (f"the resume value answers approval {resume.approval_id!r}, which is no request of "
               f"this workflow (this call waits for {asked.approval_id!r})")
        raise InvalidResume(msg)
    return "theirs" if other.status == "pending" else "spent"


def _mine(resume: Resume, asked: ApprovalRequired) -> Resume:
    return dataclasses.replace(resume, approval_id=asked.approval_id)


def _too_many(asked: ApprovalRequired) -> InvalidResume:
    return InvalidResume(f"no answer for approval {asked.approval_id} among {_MAX_ANSWERS} resume "
                         f"values meant for other requests")


def _ask(book: ApprovalBook, interrupt: Interrupt, asked: ApprovalRequired, facts: CallFacts,
         call_id: str | None) -> Resume:
    """This call's answer; answers to sibling requests met on the way decide those (sync)."""
    for _ in range(_MAX_ANSWERS):
        resume = _resume(_interrupted(interrupt, _payload(asked, call_id)))
        other = book.get(resume.approval_id) if resume.approval_id not in (
            None, asked.approval_id) else None
        whose = _whose(resume, asked, other, facts)
        if whose == "mine":
            return _mine(resume, asked)
        if whose == "theirs" and other is not None:
            with contextlib.suppress(IntentRejected, UnknownApproval):  # its own call will say
                book.apply(other, resume)
    raise _too_many(asked)


async def _aask(book: AsyncApprovalBook, interrupt: Interrupt, asked: ApprovalRequired,
                facts: CallFacts, call_id: str | None) -> Resume:
    """The asyncio twin of ``_ask``."""
    for _ in range(_MAX_ANSWERS):
        resume = _resume(_interrupted(interrupt, _payload(asked, call_id)))
        other = await book.get(resume.approval_id) if resume.approval_id not in (
            None, asked.approval_id) else None
        whose = _whose(resume, asked, other, facts)
        if whose == "mine":
            return _mine(resume, asked)
        if whose == "theirs" and other is not None:
            with contextlib.suppress(IntentRejected, UnknownApproval):
                await book.apply(other, resume)
    raise _too_many(asked)


def _resumed(interrupt: Interrupt) -> bool:
    resumed = getattr(interrupt, "resumed", None)
    return bool(resumed()) if callable(resumed) else False


def _reread(book: ApprovalBook, interrupt: Interrupt, record: ApprovalRecord, facts: CallFacts,
            call_id: str | None) -> None:
    """Read again the answers this call's step read when it asked, up to its own (decides nothing).

    A value that is no answer to a request of this workflow ends the walk: it
    was read at the place of this step's question all the same (the step had
    asked there), and the interrupts after it keep theirs.
    """
    asked = request_refusal(record)
    for _ in range(_MAX_ANSWERS):
        try:
            resume = _resume(_interrupted(interrupt, _payload(asked, call_id)))
            other = book.get(resume.approval_id) if resume.approval_id not in (
                None, asked.approval_id) else None
            if _whose(resume, asked, other, facts) == "mine":
                return
        except InvalidResume:
            return


async def _areread(book: AsyncApprovalBook, interrupt: Interrupt, record: ApprovalRecord,
                   facts: CallFacts, call_id: str | None) -> None:
    """The asyncio twin of ``_reread``."""
    asked = request_refusal(record)
    for _ in range(_MAX_ANSWERS):
        try:
            resume = _resume(_interrupted(interrupt, _payload(asked, call_id)))
            other = await book.get(resume.approval_id) if resume.approval_id not in (
                None, asked.approval_id) else None
            if _whose(resume, asked, other, facts) == "mine":
                return
        except InvalidResume:
            return


def _why(book: ApprovalBook | AsyncApprovalBook | None, prepared: Prepared, facts: CallFacts,
         enforcement: Enforcement) -> str | None:
    """Why this call needs a person (None: it does not, or shadow mode only notes it)."""
    rule = prepared.rule
    if rule.approval is None or _shadowed(prepared, facts, enforcement):
        return None
    why = approval_reason(rule, facts.args)
    if why is not None and book is None:
        raise GuardMisconfigured(_NO_BOOK.format(tool=facts.tool))
    return why


def approve(book: ApprovalBook | None, prepared: Prepared, facts: CallFacts,
            enforcement: Enforcement, *, call_id: str | None = None,
            interrupt: Interrupt | None = None,
            on_request: Callable[[ApprovalRequired], None] | None = None) -> Approved | None:
    """The binding approval of this call, None when it needs none, or the refusal (sync)."""
    rule = prepared.rule
    why = _why(book, prepared, facts, enforcement)
    if why is None or book is None or rule.approval is None:
        return None
    record, made = book.requested(facts, why, rule.approval.expires)
    if made and interrupt is not None and on_request is not None:
        on_request(request_refusal(record))  # audited once, when made: a re-run finds it
    try:
        approved = book.binding(record, facts)
    except ApprovalRequired as asked:
        if interrupt is None:
            raise
        resume = _ask(book, interrupt, asked, facts, call_id)
        return book.binding(book.answered(facts, resume), facts)
    if interrupt is not None and record.workflow == facts.workflow and _resumed(interrupt):
        _reread(book, interrupt, record, facts, call_id)
    return approved


async def aapprove(book: AsyncApprovalBook | None, prepared: Prepared, facts: CallFacts,
                   enforcement: Enforcement, *, call_id: str | None = None,
                   interrupt: Interrupt | None = None,
                   on_request: Callable[[ApprovalRequired], Awaitable[None]] | None = None
                   ) -> Approved | None:
    """The asyncio twin of ``approve``."""
    rule = prepared.rule
    why = _why(book, prepared, facts, enforcement)
    if why is None or book is None or rule.approval is None:
        return None
    expires = rule.approval.expires

    async def requested() -> ApprovalRecord:
        """Find or make the request and, when it is made here, audit it: never one without the other."""
        record, made = await book.requested(facts, why, expires)
        if made and interrupt is not None and on_request is not None:
            await on_request(request_refusal(record))
        return record

    # a sibling's interrupt cancels this task mid-step (asyncio.gather): finish the pair anyway
    record = await finish(requested())
    try:
        approved = book.binding(record, facts)
    except ApprovalRequired as asked:
        if interrupt is None:
            raise
        resume = await _aask(book, interrupt, asked, facts, call_id)
        return book.binding(await book.answered(facts, resume), facts)
    if interrupt is not None and record.workflow == facts.workflow and _resumed(interrupt):
        await _areread(book, interrupt, record, facts, call_id)
    return approved
