"""What one call draws on its quotas: pure, shared by every backend and both paths.

Each quota of the tool becomes one ``Charge`` per scope value (one per lock key
for ``per: key``): a counter (``Charge.scope``), its limit, what this call adds
and how long its entry counts. The backends admit a tuple of charges all or
nothing; ``refusal`` turns a backend's "no" into the typed error.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from toolguard.call.facts import CallFacts
from toolguard.errors import BudgetExceeded, InFlightLimited, InvalidArguments, QuotaExceeded, RateLimited
from toolguard.policies.controls import QuotaKind, QuotaRule
from toolguard.policies.model import ToolPolicy
from toolguard.policies.paths import MISSING

__all__ = ["IN_FLIGHT_RETRY_S", "NO_VALUE", "Charge", "charges", "refusal", "scope_name"]

#: The scope value of a call without an agent (or workflow): a real value's "~" is encoded.
NO_VALUE = "~"
#: What an in-flight refusal suggests: a slot usually frees when a running call ends,
#: long before the lease (the bound for a crashed holder) runs out.
IN_FLIGHT_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class Charge:
    """One counter this call draws on. ``entry`` is the id it is counted under."""

    scope: str
    kind: QuotaKind
    limit: float
    cost: float
    ttl_ms: int
    entry: str
    rule: QuotaRule
    counter: str
    where: str  # "agent=payments, key=account:1": the scope, for people


def _part(text: str) -> str:
    """A scope component: ``% | = ~`` encoded, so joining stays injective."""
    return (text.replace("%", "%25").replace("|", "%7C").replace("=", "%3D")
            .replace("~", "%7E"))


def scope_name(counter: str, values: Iterable[tuple[str, str | None]]) -> str:
    """``counter|dim=value|...``: the name a backend keeps the counter under (None: ``~``)."""
    return "|".join([_part(counter), *(f"{dim}={NO_VALUE if value is None else _part(value)}"
                                       for dim, value in values)])


def charges(rule: ToolPolicy, facts: CallFacts) -> tuple[Charge, ...]:
    """Every counter ``facts`` draws on under ``rule``'s quotas, sorted by scope, distinct.

    A budget draws the sum of the values at its ``arg`` path (``items[*].price``
    sums every price); an absent or null value draws nothing. A negative or
    non-numeric amount is ``InvalidArguments``: a budget is never refilled by
    a call. An amount over its limit alone (also one past float's range) is
    ``BudgetExceeded`` here, before any backend sees it.
    """
    out: dict[str, Charge] = {}
    never: Charge | None = None
    for quota in rule.quotas:
        cost = 1.0 if quota.budget is None else _amount(quota, facts.args)
        if cost == 0:
            continue
        counter = quota.counter(rule.name or facts.tool)
        entry = f"a:{facts.attempt}" if quota.kind == "in_flight" else f"i:{facts.idempotency_key}"
        choices: list[list[tuple[str, str | None]]] = []
        for dim in quota.per:
            if dim == "key":
                choices.append([("key", key) for key in facts.keys])
            else:
                value = {"agent": facts.agent, "tool": facts.tool, "workflow": facts.workflow}[dim]
                choices.append([(dim, value)])
        for values in itertools.product(*choices):
            scope = scope_name(counter, values)
            if scope in out:
                continue  # the same named quota listed twice: one counter, counted once
            where = ", ".join(f"{dim}={'(none)' if value is None else value}"
                              for dim, value in values)
            out[scope] = Charge(scope=scope, kind=quota.kind, limit=quota.limit, cost=cost,
                                ttl_ms=max(1, math.ceil(quota.ttl_s * 1000)), entry=entry,
                                rule=quota, counter=counter, where=where)
            if cost > quota.limit and never is None:
                never = out[scope]
    if never is not None:  # over the limit alone (up to an infinite sum): no backend sees it
        raise refusal(never, None, facts)
    return tuple(out[scope] for scope in sorted(out))


def _amount(quota: QuotaRule, args: Any) -> float:
    """The sum drawn; ``inf`` for one too large for a float (an int of 400 digits, 1e308 + 1e308)."""
    assert quota.arg is not None
    total = 0.0
    for where, value in quota.arg.resolve(args):
        if value is MISSING or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or (
                isinstance(value, float) and not math.isfinite(value)):
            msg = f"{where}: the budget of quota {quota.name or str(quota.arg)!r} needs a number"
            raise InvalidArguments(msg)
        if value < 0:
            msg = f"{where}: must be >= 0 (it is drawn from a budget)"
            raise InvalidArguments(msg)
        try:
            total += float(value)
        except OverflowError:  # an int past float's range: more than any budget
            return math.inf
    return total


def _seconds(value: float) -> str:
    return f"{value:.0f}s" if value >= 100 else f"{value:.3g}s"


def refusal(charge: Charge, retry_after_s: float | None, facts: CallFacts) -> QuotaExceeded:
    """The typed error for ``charge`` refused; ``retry_after_s`` None: the cost alone is too much."""
    rule = charge.rule
    scope = f" ({charge.where})" if charge.where else ""
    if retry_after_s is not None and charge.kind == "in_flight":
        retry_after_s = min(retry_after_s, IN_FLIGHT_RETRY_S)
    retry = (f"; retry in {_seconds(retry_after_s)}" if retry_after_s is not None
             else "; this call alone is over the budget and can never fit")
    window = f"{rule.ttl_s:g}s"
    if charge.kind == "rate":
        msg = f"rate limited: {charge.counter} allows {rule.calls} calls per {window}{scope}{retry}"
        return RateLimited(msg, retry_after_s=retry_after_s, quota=charge.counter, scope=charge.where)
    if charge.kind == "in_flight":
        msg = (f"in-flight limit: {charge.counter} allows {rule.in_flight} running at once"
               f"{scope}{retry}")
        return InFlightLimited(msg, retry_after_s=retry_after_s, quota=charge.counter,
                               scope=charge.where)
    msg = (f"budget exceeded: {facts.tool} would draw {charge.cost:g} of {rule.arg}, and "
           f"{charge.counter} allows {rule.budget:g} per {window}{scope}{retry}")
    return BudgetExceeded(msg, retry_after_s=retry_after_s, quota=charge.counter, scope=charge.where)
