"""The quota step: admit after validation, keys and approval, before the locks; finish after.

``admit(quotas, prepared, facts, enforcement)`` counts the call against every
quota of its tool, all or none, or raises ``RateLimited`` /
``InFlightLimited`` / ``BudgetExceeded`` with ``retry_after_s``. The guard
then runs the call inside ``held(admission)``: its in-flight slots are
renewed while it runs (one shared renewal thread for the sync path, a task
on the asyncio path), and when it ends ``finish(applied=...)`` frees them and
refunds the budget of a call that did not apply. A call whose outcome is
unknown (cancelled, interrupted) keeps its budget drawn: it may have applied.

In ``mode: shadow`` a refusal is recorded as the would-be refusal and nothing
is counted; after an earlier would-be refusal the step is skipped, as
enforcement would not have reached it.

A replay (the intent's key already applied, with the same arguments) is
never refused by a quota: a refusal is looked up in the store (``store=``; a
round trip only when refused), and a replay goes on, counted nothing, to
return its recorded result. Within its window a replay finds its entry and is
not counted again; after it, it is counted like a new call (fail closed: its
entry cannot be told from one a running attempt of the same intent shares).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from toolguard.call.facts import CallFacts
from toolguard.controls._rows import arows, rows
from toolguard.controls.quotas import Admission, AsyncAdmission, AsyncQuotas, Quotas
from toolguard.controls.shadow import Enforcement
from toolguard.errors import GuardMisconfigured, QuotaExceeded, is_control_flow
from toolguard.runtime.cancellation import finish
from toolguard.steps.prepared import Prepared
from toolguard.store.base import AsyncGuardedStore, GuardedStore

__all__ = ["Held", "aadmit", "admit", "aheld", "held"]

log = logging.getLogger("toolguard.quotas")

_NO_BACKEND = ("tool {tool!r} has quotas, and this guard has no quota backend: give the "
               "ToolGuard a store (its server keeps the counters) or quotas=")
#: Renew an in-flight slot when a third of its lease is left.
_RENEW_FRACTION = 1 / 3
#: Is this intent applied already, with these arguments (then the call is a replay)?
_APPLIED = ("SELECT 1 FROM toolguard_intent WHERE idempotency_key = %s AND tool = %s "
            "AND args_hash = %s AND status = 'applied'")


@dataclass(slots=True)
class Held:
    """What the call did, for ``finish``: ``applied`` is set once the call's decision is known."""

    applied: bool = False


def _replay_params(facts: CallFacts) -> tuple[str, str, str]:
    return facts.idempotency_key, facts.tool, facts.args_hash


def _skip(prepared: Prepared, enforcement: Enforcement) -> bool:
    return not prepared.rule.quotas or enforcement.verdict is not None


def admit(quotas: Quotas | None, prepared: Prepared, facts: CallFacts,
          enforcement: Enforcement, *, store: GuardedStore | None = None) -> Admission:
    """Count the call (sync), or raise the quota's refusal; shadowed: record it, count nothing."""
    if _skip(prepared, enforcement):
        return Admission()
    if quotas is None:
        raise GuardMisconfigured(_NO_BACKEND.format(tool=facts.tool))
    admission = Admission()  # shadow and refused: nothing was counted
    with enforcement.step("quotas"):
        try:
            admission = quotas.admit(prepared.rule, facts)
        except QuotaExceeded:
            if store is None or not rows(store, _APPLIED, _replay_params(facts)):
                raise  # not a replay: refused
    return admission


async def aadmit(quotas: AsyncQuotas | None, prepared: Prepared, facts: CallFacts,
                 enforcement: Enforcement, *,
                 store: AsyncGuardedStore | None = None) -> AsyncAdmission:
    """The asyncio twin of ``admit``."""
    if _skip(prepared, enforcement):
        return AsyncAdmission()
    if quotas is None:
        raise GuardMisconfigured(_NO_BACKEND.format(tool=facts.tool))
    admission = AsyncAdmission()
    with enforcement.step("quotas"):
        try:
            admission = await quotas.admit(prepared.rule, facts)
        except QuotaExceeded:
            if store is None or not await arows(store, _APPLIED, _replay_params(facts)):
                raise
    return admission


def _period_s(admission: Admission | AsyncAdmission) -> float | None:
    lease_ms = admission.held.lease_ms()
    if not lease_ms or not admission.held.entries(("in_flight",)):
        return None
    return max(lease_ms / 1000 * _RENEW_FRACTION, 0.05)


class _Renewals:
    """One daemon thread renewing the in-flight slots of every running sync call of the process."""

    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._due: dict[int, tuple[Admission, float, float]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, admission: Admission, period_s: float) -> int:
        with self._wake:
            number = next(self._ids)
            self._due[number] = (admission, period_s, time.monotonic() + period_s)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="toolguard-quota-renewal",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()
            return number

    def remove(self, number: int) -> None:
        with self._wake:
            self._due.pop(number, None)

    def _run(self) -> None:
        while True:
            with self._wake:
                now = time.monotonic()
                ready = [(n, a, p) for n, (a, p, due) in self._due.items() if due <= now]
                for number, admission, period in ready:
                    self._due[number] = (admission, period, now + period)
                if not ready:
                    nearest = min((due for _, _, due in self._due.values()), default=now + 5.0)
                    self._wake.wait(max(nearest - now, 0.01))
                    continue
            for _, admission, _ in ready:
                _renew(admission)


def _renew(admission: Admission) -> None:
    try:
        if not admission.renew() and not admission.held.done:  # done: finished meanwhile
            log.warning("an in-flight quota slot expired while its call ran (lease too short?)")
    except Exception as error:  # the backend is away: the slot frees itself after its lease
        log.warning("could not renew an in-flight quota slot: %s", error)


_RENEWALS = _Renewals()


def _finish(admission: Admission, applied: bool) -> None:
    try:
        admission.finish(applied=applied)
    except Exception as error:  # never hide the call's outcome; the slot expires with its lease
        log.warning("could not finish a quota admission: %s", error)


@contextlib.contextmanager
def held(admission: Admission) -> Iterator[Held]:
    """Run the call with its admission: renewed while it runs, finished however it ends.

    Set ``applied`` on the yielded ``Held`` once the call applied; an exception
    that is control flow (cancellation, an interrupt) counts as applied: the
    outcome is unknown, so the budget stays drawn.
    """
    state = Held()
    period = _period_s(admission)
    number = _RENEWALS.add(admission, period) if period is not None else None
    try:
        yield state
    except BaseException as error:
        state.applied = is_control_flow(error)
        raise
    finally:
        if number is not None:
            _RENEWALS.remove(number)
        _finish(admission, state.applied)


async def _arenew(admission: AsyncAdmission, period_s: float) -> None:
    while True:
        await asyncio.sleep(period_s)
        try:
            if not await admission.renew() and not admission.held.done:
                log.warning("an in-flight quota slot expired while its call ran")
        except Exception as error:
            log.warning("could not renew an in-flight quota slot: %s", error)


@contextlib.asynccontextmanager
async def aheld(admission: AsyncAdmission) -> AsyncIterator[Held]:
    """The asyncio twin of ``held`` (finishing is shielded from a cancellation)."""
    state = Held()
    period = _period_s(admission)
    renewal = asyncio.create_task(_arenew(admission, period)) if period is not None else None
    try:
        yield state
    except BaseException as error:
        state.applied = is_control_flow(error)
        raise
    finally:
        if renewal is not None:
            renewal.cancel()
        try:
            await finish(admission.finish(applied=state.applied))
        except Exception as error:
            log.warning("could not finish a quota admission: %s", error)
