"""The service side of a fenced request, shared by the ASGI and the FastMCP middleware.

``FenceGate.run`` takes the fences a request carried and the handler that
serves it, and answers with one of four outcomes; the middleware turns the
outcome into its protocol's response, and nothing here knows HTTP or MCP:

* ``Applied``: the fences were checked and advanced, the handler ran in the
  same transaction, its answer was recorded under the idempotency key and
  everything committed together.
* ``Replayed``: the key was applied before; the recorded answer comes back and
  the handler does not run. The fences it carried were checked and advanced all
  the same (the store commits a replay's fence advance), so a holder with a
  lower token is refused afterwards.
* ``Declined``: the handler answered with a failure (an HTTP status >= 400, an
  MCP error result): its writes were rolled back, and the answer goes out as is.
* ``Refused``: a ``Problem`` (stale token, key in flight, key reused for
  another request, malformed or missing fences, store down).

Every outcome leaves exactly one audit row in the service's store: the store
writes it for what happens inside ``fenced()``, ``refuse`` for what is decided
before, ``cancelled`` for a request cancelled before the store could write one.
In signed mode the gate's own rows name only what the request's claims signed, and
keep what else it said as unproven (``toolguard.fences.proof``); a row the store writes
follows verification, which matched every field to the claims.

Cancellation: ``run`` serves the request in a task of its own
(``toolguard.runtime.cancellation``), so however the server cancels (asyncio once, anyio
at every await), the marker, the transaction and the handler see one
cancellation, and the request's cleanup (rollback, audit row, connections back
to their pool idle) has ended before the cancellation reaches the server. Once the
handler has answered, the request is no longer stopped: its answer is recorded and
committed (a retry replays it), then the cancellation goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from toolguard.errors import DuplicateIntent, GuardMisconfigured, ToolGuardError
from toolguard.fences.claims import Claim, ClaimRefused, ClaimVerifier
from toolguard.fences.inflight import InFlightRegistry, default_registry
from toolguard.fences.problems import InFlight, KeyNotFenced, Problem, problem_from_error
from toolguard.fences.proof import attest
from toolguard.fences.scope import scoped_key
from toolguard.fences.wire import Fences
from toolguard.runtime.cancellation import finish, isolated
from toolguard.store import AsyncFencedTransaction, AsyncGuardedStore, AuditEntry, IntentRecord
from toolguard.store.base import latest_version, mark_audited, was_audited

__all__ = [
    "Answer",
    "Applied",
    "Declined",
    "FenceGate",
    "Outcome",
    "Refused",
    "Replayed",
    "ServiceFence",
    "audit_name",
    "current_fence",
]

log = logging.getLogger("toolguard.fences")


@dataclass(frozen=True, slots=True)
class ServiceFence:
    """What a fenced handler gets: the open transaction and what the request carried.

    Run the handler's reads and writes through ``tx`` (``await tx.execute(...)``):
    the fences were checked and advanced in this transaction, so a holder with
    an older token is refused before it reads anything.
    """

    tx: AsyncFencedTransaction
    fences: Fences
    tool: str
    #: The verified claims, one per fenced key (empty in unsigned mode).
    claims: tuple[Claim, ...] = ()

    @property
    def tokens(self) -> Mapping[str, int]:
        return self.fences.tokens

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(sorted(self.fences.tokens))

    @property
    def idempotency_key(self) -> str | None:
        return self.fences.idempotency_key

    @property
    def agent(self) -> str | None:
        return self.fences.agent

    @property
    def intent_id(self) -> str | None:
        return self.fences.intent_id

    def require(self, *keys: str) -> None:
        """Raise ``KeyNotFenced`` unless the request carries a fence for every one of ``keys``.

        Call it with the lock keys of what the handler is about to write
        (``fence.require(f"lead:{lead_id}")``): a request fenced on some other key
        proves nothing about this resource. The request is rolled back, its fence
        advances too, and answered ``428`` (MCP ``-32077``) naming the keys.
        """
        missing = tuple(sorted({key for key in keys if key not in self.fences.tokens}))
        if missing:
            held = ", ".join(sorted(self.fences.tokens)) or "none"
            msg = (f"{self.tool} writes {', '.join(missing)}, and the request carries no fencing "
                   f"token for it (it holds: {held}): lock it in the caller's policy")
            raise KeyNotFenced(msg, keys=missing)


def audit_name(text: str, *, limit: int = 200) -> str:
    """A request's name (``METHOD /path``, an MCP tool) as every store can audit it.

    Printable and bounded: control characters (NUL included) and lone surrogates
    become U+FFFD, and the text is cut at ``limit`` characters. The request's
    digest keeps the exact name, so two names alike here never replay each other.
    """
    shown = "".join("\ufffd" if c < " " or c == "\x7f" or "\ud800" <= c <= "\udfff" else c
                    for c in text[:limit])
    return shown or "\ufffd"


_current: ContextVar[ServiceFence | None] = ContextVar("toolguard_service_fence", default=None)


def current_fence() -> ServiceFence:
    """The fence of the request this handler or MCP tool serves."""
    fence = _current.get()
    if fence is None:
        msg = ("no fenced request is being served here (mount FenceMiddleware / add "
               "FenceToolMiddleware, and send the request with fences)")
        raise ToolGuardError(msg, reason="no_fence")
    return fence


@dataclass(frozen=True, slots=True)
class Answer:
    """What a handler produced: ``value`` to send now, ``record`` (JSON) for replays.

    ``commit=False`` rolls the handler's writes back (it refused the request).
    """

    value: Any
    record: Any = None
    commit: bool = True
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class Applied:
    value: Any


@dataclass(frozen=True, slots=True)
class Replayed:
    record: Any


@dataclass(frozen=True, slots=True)
class Declined:
    value: Any


@dataclass(frozen=True, slots=True)
class Refused:
    problem: Problem


Outcome = Applied | Replayed | Declined | Refused
Handler = Callable[[ServiceFence], Awaitable[Answer]]


class _Declined(ToolGuardError):
    """Raised inside ``fenced()`` to roll back a handler's failed answer (audited as failed)."""

    reason = "declined"

    def __init__(self, answer: Answer) -> None:
        super().__init__(answer.detail or "the handler answered with a failure; rolled back")
        self.answer = answer


def require_service_store(store: object, *, where: str) -> AsyncGuardedStore:
    """``store`` if it is an ``AsyncGuardedStore``, else ``GuardMisconfigured`` naming the fix."""
    if (not isinstance(store, AsyncGuardedStore)
            or not inspect.iscoroutinefunction(getattr(store, "audit", None))):
        msg = (f"{where} needs the service's own asyncio store, open_async_store(url) "
               f"(installed), got {store!r}")
        raise GuardMisconfigured(msg)
    return store


def _signed_by(detail: str | None, claims: tuple[Claim, ...]) -> str | None:
    """The audit detail, naming the key ids that signed (how a rotation sees the old id unused)."""
    if not claims:
        return detail
    ids = ", ".join(sorted({claim.key_id for claim in claims}))
    return f"{detail}; signed by {ids}" if detail else f"signed by {ids}"


def _trust(claims: object, audience: object,
           where: str) -> tuple[ClaimVerifier | None, str | None]:
    """Signed mode (a ``ClaimVerifier``, whose audience scopes the answers) or unsigned."""
    if claims is not None and not isinstance(claims, ClaimVerifier):
        msg = f"{where}: claims must be a ClaimVerifier (or None: unsigned mode), got {claims!r}"
        raise GuardMisconfigured(msg)
    if audience is not None and (not isinstance(audience, str) or not audience):
        msg = f"{where}: audience must be the service's name, got {audience!r}"
        raise GuardMisconfigured(msg)
    if claims is not None:
        if audience is not None and audience != claims.audience:
            msg = (f"{where}: audience {audience!r} is not the ClaimVerifier's "
                   f"{claims.audience!r}: give it once, to the ClaimVerifier")
            raise GuardMisconfigured(msg)
        return claims, claims.audience
    return None, audience


class FenceGate:
    """Checks a request's fences against the service's store and runs its handler inside them.

    A store that is not an ``AsyncGuardedStore`` raises ``GuardMisconfigured`` here; one
    whose schema is behind this toolguard (or not installed) raises it from ``check_store``
    (the ASGI middleware calls it at startup) or at the first request, to the developer:
    no request could be fenced or audited on it.
    """

    def __init__(self, store: AsyncGuardedStore, *,
                 inflight: InFlightRegistry | None = None, where: str = "FenceGate",
                 claims: ClaimVerifier | None = None, audience: str | None = None) -> None:
        self.store = require_service_store(store, where=where)
        self.claims, self.audience = _trust(claims, audience, where)
        if inflight is not None and not callable(getattr(inflight, "hold", None)):
            msg = f"{where}: inflight must have hold(key) (an InFlightRegistry), got {inflight!r}"
            raise GuardMisconfigured(msg)
        self.inflight = inflight if inflight is not None else default_registry(store)
        self._schema_current = False

    async def check_store(self) -> None:
        """Raise ``GuardMisconfigured`` if the store's schema is behind this toolguard.

        A store that cannot be reached now is no verdict: checked again next time.
        """
        if self._schema_current:
            return
        try:
            version = await self.store.schema_version()
        except Exception:
            return
        wanted = latest_version("sqlite" if self.store.dialect == "sqlite" else "postgresql")
        if version < wanted:
            found = "not installed" if version == 0 else f"at version {version}"
            msg = (f"the service's fence store ({self.store!r}) has the toolguard schema {found}, "
                   f"and this toolguard needs version {wanted}: run `toolguard db init` (or "
                   f"open the store with install=True) before serving fenced requests")
            raise GuardMisconfigured(msg)
        self._schema_current = True

    async def run(self, fences: Fences, *, tool: str, digest: str, handler: Handler) -> Outcome:
        """Fence, dedupe and run ``handler`` in one transaction (see the module docstring)."""
        audited: list[bool] = []
        answered: list[bool] = []  # the handler has answered: its answer is committed now
        try:
            return await isolated(self._run(fences, tool, digest, handler, audited, answered),
                                  stoppable=lambda: not answered)
        except asyncio.CancelledError as cancelled:
            if not audited:  # cancelled before the request's own task ever ran
                await self.cancelled(cancelled, tool=tool, fences=fences)
            raise

    async def _run(self, fences: Fences, tool: str, digest: str, handler: Handler,
                   audited: list[bool], answered: list[bool]) -> Outcome:
        """The request's own task; ``audited`` says its row is written (by the store or here),
        ``answered`` that the handler has answered (from then on it is not cancelled)."""
        async def serve(fence: ServiceFence) -> Answer:
            answer = await handler(fence)
            answered.append(True)
            return answer

        try:
            outcome = await self._marked(fences, tool, digest, serve)
        except asyncio.CancelledError as cancelled:
            await self.cancelled(cancelled, tool=tool, fences=fences)
            audited.append(True)
            raise
        except BaseException as error:
            if was_audited(error):
                audited.append(True)
            raise
        audited.append(True)
        return outcome

    async def _marked(self, fences: Fences, tool: str, digest: str,
                      handler: Handler) -> Outcome:
        await self.check_store()
        claims: tuple[Claim, ...] = ()
        if self.claims is not None:  # signed mode: nothing is touched for an unproven fence
            try:
                claims = self.claims.verify(fences)
            except ClaimRefused as error:
                return await self.refuse(error, tool=tool, fences=fences)
        key = fences.idempotency_key
        if key is None:
            return await self._fenced(fences, tool, digest, handler, None, claims)
        stored = scoped_key(key, audience=self.audience, agent=fences.agent)
        async with contextlib.AsyncExitStack() as stack:
            try:
                held = await stack.enter_async_context(self.inflight.hold(stored))
            except ToolGuardError as error:  # the marker's store is down: 503, audited if it can
                return await self.refuse(error, tool=tool, fences=fences, claims=claims)
            if not held:
                msg = f"a request with idempotency key {key!r} is still in flight; retry later"
                return await self.refuse(InFlight(msg, idempotency_key=key), tool=tool,
                                         fences=fences, claims=claims)
            return await self._fenced(fences, tool, digest, handler, stored, claims)

    async def _fenced(self, fences: Fences, tool: str, digest: str, handler: Handler,
                      stored: str | None, claims: tuple[Claim, ...]) -> Outcome:
        key = fences.idempotency_key
        record = IntentRecord(tool=tool, idempotency_key=stored,
                              args_hash=digest if stored else None,
                              agent=fences.agent, intent_id=fences.intent_id,
                              keys=tuple(sorted(fences.tokens)))
        answer: Answer | None = None
        try:
            async with self.store.fenced(fences.tokens, record) as tx:
                fence = ServiceFence(tx, fences, tool, claims)
                bound = _current.set(fence)
                try:
                    answer = await handler(fence)
                finally:
                    _current.reset(bound)
                if not answer.commit:
                    raise _Declined(answer)
                tx.detail = _signed_by(answer.detail, claims)
                tx.record(answer.record)
        except _Declined as declined:
            return Declined(declined.answer.value)
        except DuplicateIntent as duplicate:
            return Replayed(duplicate.result)
        except ToolGuardError as error:  # stale, conflict, store down: audited by the store
            problem = problem_from_error(error)
            if key is not None and problem.reason == "idempotency_conflict":
                problem = Problem(problem.reason, problem.detail, {"idempotency_key": key})
            return Refused(problem)
        assert answer is not None
        return Applied(answer.value)

    async def refuse(self, error: ToolGuardError, *, tool: str | None,
                     fences: Fences | None = None,
                     claims: tuple[Claim, ...] | None = None) -> Refused:
        """Audit a refusal decided before the fenced transaction, and return its problem.

        ``claims`` are the request's verified claims, when verification passed.
        """
        problem = problem_from_error(error)
        if claims is None and isinstance(error, ClaimRefused):
            claims = error.proven
        entry = self._entry("rejected", problem.reason, tool, fences or Fences(), claims,
                            problem.detail[:2000])
        try:
            await self.check_store()
        except asyncio.CancelledError as cancelled:  # the refusal is decided: it is audited
            mark_audited(cancelled)
            await self._audit(entry)
            raise
        await self._audit(entry)
        return Refused(problem)

    async def cancelled(self, error: BaseException, *, tool: str | None,
                        fences: Fences | None = None) -> None:
        """One ``unknown``/``cancelled`` row for a request cancelled before the store wrote one
        (in the body, the marker, the schema check); nothing of it was applied."""
        if was_audited(error):
            return
        mark_audited(error)
        entry = self._entry("unknown", "cancelled", tool, fences or Fences(), None,
                            "cancelled before its fenced transaction: nothing was run")
        await self._audit(entry)

    def _entry(self, decision: str, reason: str, tool: str | None, fences: Fences,
               claims: tuple[Claim, ...] | None, detail: str) -> AuditEntry:
        """The row of a decision the store did not write. In signed mode its columns hold
        what the claims signed, and what the request brought beside it is marked unproven
        (``toolguard.fences.proof``); unsigned, the request's fields as they came."""
        args = None
        if self.claims is not None:
            attested = attest(fences, self.claims.proven(fences) if claims is None else claims)
            fences, args = attested.fences, attested.args()
        key = fences.idempotency_key
        return AuditEntry(decision=decision, reason=reason, tool=tool,
                          agent=fences.agent, intent_id=fences.intent_id,
                          idempotency_key=None if key is None else scoped_key(
                              key, audience=self.audience, agent=fences.agent),
                          keys=tuple(sorted(fences.tokens)), tokens=fences.tokens, args=args,
                          detail=detail, duration_ms=0.0)

    async def _audit(self, entry: AuditEntry) -> None:
        """Write ``entry`` to its end, even if the request is cancelled meanwhile."""
        try:
            await finish(self.store.audit(entry))
        except asyncio.CancelledError as cancelled:  # written all the same: no second row
            mark_audited(cancelled)
            raise
        except Exception as audit_error:  # the store may be what is down; the decision stands
            log.warning("could not audit a refused request (%s): %s", entry.reason, audit_error)
