"""What a signed request proved, as its audit row records it.

In signed mode a request's agent, idempotency key, intent id and fences count
only as far as a claim the service trusts signed them. So the audit row's
columns hold the claims' word, and whatever the request brought beside it (a
header naming another agent, a fence no claim signed) is kept in the row's
``args`` under ``"unproven"``, never in a column as if it were proven::

    {"unproven": {"agent": "other_writer", "tokens": {"lead:L-7": 42}}}

A claim counts here when it holds in itself (signed by a trusted key, for this
service, in time: ``ClaimVerifier.proven``), whether or not the request matched
it: a genuine claim resent with another ``Toolguard-Agent`` is refused
``claim_mismatch``, and its row names the claim's agent. A value the claims
disagree on (two claims naming two agents) is proven by none of them. When
nothing holds (a bad signature, an expired claim, no claim), the columns are
empty and everything the request brought is unproven.

Pure (no I/O); the gate builds its refusal rows with it, and the review page
and ``toolguard audit show`` read the marker back (``toolguard.store.audit_view``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from toolguard.fences.claims import Claim
from toolguard.fences.wire import Fences
from toolguard.store.audit_view import UNPROVEN

__all__ = ["UNPROVEN", "Attested", "attest"]


@dataclass(frozen=True, slots=True)
class Attested:
    """A request as its audit row keeps it: ``fences`` proven, ``unproven`` the rest."""

    fences: Fences
    unproven: dict[str, Any] = field(default_factory=dict)

    def args(self) -> dict[str, Any] | None:
        """The row's ``args``: the unproven values under ``"unproven"``, or None."""
        return {UNPROVEN: self.unproven} if self.unproven else None


_NONE = object()  # no claim names one value (none at all, or several disagree)


def _one(values: set[Any]) -> Any:
    return next(iter(values)) if len(values) == 1 else _NONE


def attest(fences: Fences, claims: Sequence[Claim]) -> Attested:
    """``fences`` split into what ``claims`` (each holding in itself) signed, and the rest."""
    proven: dict[str, Any] = {
        "agent": _one({c.agent for c in claims}),
        "idempotency_key": _one({c.idempotency_key for c in claims}),
        "intent_id": _one({c.intent_id for c in claims}),
    }
    unproven: dict[str, Any] = {}
    for name, value in proven.items():
        sent = getattr(fences, name)
        if value is _NONE:
            proven[name] = None
        if sent is not None and sent != proven[name]:
            unproven[name] = sent
    signed: dict[str, set[int]] = {}
    for claim in claims:
        signed.setdefault(claim.key, set()).add(claim.token)
    tokens = {key: next(iter(found)) for key, found in signed.items() if len(found) == 1}
    stray = {key: token for key, token in fences.tokens.items() if tokens.get(key) != token}
    if stray:
        unproven["tokens"] = stray
    shown = Fences(tokens=tokens, idempotency_key=proven["idempotency_key"],
                   agent=proven["agent"], intent_id=proven["intent_id"], claims=fences.claims)
    return Attested(shown, unproven)
