"""Shadow mode: decide and audit as if enforcing, refuse nothing (``mode: shadow``).

A team rolls a policy out on a running system by shadowing it first: every
policy decision of a call is computed as it would be, and the first one that
would refuse is audited as a row of its own, ``decision = "shadow"`` and
``reason`` the code it would have been refused with; the call then runs and
gets its usual row. ``toolguard audit --shadow`` lists what enforcement would
have refused.

What can be shadowed is the policy's own judgement: who may call a tool
(``not_authorized``), ``args:`` constraints (``invalid_arguments``), unknown
tools (``unknown_tool``; the call runs as an allowed unknown tool would),
approvals (``approval_required``: no request is made, nobody is paged) and
quotas (``rate_limited``, ``in_flight_limited``, ``budget_exceeded``; a call a
quota would refuse is not counted). After the first would-be refusal the guard
skips the steps that count (quotas): enforcement would not have reached them,
so the counters stay what enforcing would have made them. What keeps data safe is never shadowed:
input limits, the tool's schema, lock keys, idempotency, ordering, locks,
fences, and an operator's pause.

The guard's use, per call::

    enforcement = Enforcement(mode_of(policy, intent.tool))
    with enforcement.step("authorize"):
        authorize(rule, intent.agent)             # raises in enforce mode only
    ...
    verdict = enforcement.verdict                 # None, or what would have refused
    if verdict: audit(enforcement.entry(row_of_this_call))
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import TracebackType

from toolguard.errors import IntentRejected
from toolguard.policies.controls import Mode
from toolguard.policies.decisions import lookup_tool
from toolguard.policies.model import Policy, ToolPolicy
from toolguard.store.base import AuditEntry

__all__ = ["SHADOWABLE", "SHADOW_DECISION", "Enforcement", "ShadowVerdict", "lookup_in_mode",
           "mode_of"]

#: The audit decision of a row recording what enforcement would have done.
SHADOW_DECISION = "shadow"
#: Reason codes a shadowed step may record instead of raising.
SHADOWABLE = frozenset({"not_authorized", "invalid_arguments", "unknown_tool", "approval_required",
                        "rate_limited", "in_flight_limited", "budget_exceeded"})


@dataclass(frozen=True, slots=True)
class ShadowVerdict:
    """What would have refused the call: which step, with which reason and message."""

    step: str
    reason: str
    message: str
    error: IntentRejected

    @property
    def detail(self) -> str:
        return f"shadow ({self.step}): would be refused {self.reason}: {self.message}"


def mode_of(policy: Policy, tool: str) -> Mode:
    """The tool's mode, else the policy's default (for a tool the policy does not name)."""
    rule = policy.tools.get(tool)
    return rule.mode if rule is not None else policy.defaults.mode


class Enforcement:
    """One call's policy decisions under its mode: raised (enforce) or recorded (shadow)."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.verdict: ShadowVerdict | None = None

    @property
    def shadow(self) -> bool:
        return self.mode == "shadow"

    def step(self, name: str) -> _Step:
        """Run one deciding step; in shadow mode a shadowable refusal is recorded, not raised.

        Only the first would-be refusal is kept: enforcement would have stopped there.
        """
        return _Step(self, name)

    def entry(self, call_row: AuditEntry) -> AuditEntry | None:
        """The shadow audit row for this call (built from the call's own row), or None."""
        if self.verdict is None:
            return None
        return replace(call_row, decision=SHADOW_DECISION, reason=self.verdict.reason,
                       detail=self.verdict.detail[:2000], tokens={}, duration_ms=None)


class _Step:
    """``Enforcement.step``: a context manager whose ``__exit__`` may swallow the refusal.

    A class rather than ``@contextmanager``, so that type checkers know code after a
    ``with enforcement.step(...)`` block that returns is still reachable.
    """

    __slots__ = ("_enforcement", "_name")

    def __init__(self, enforcement: Enforcement, name: str) -> None:
        self._enforcement = enforcement
        self._name = name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, refused: BaseException | None,
                 traceback: TracebackType | None) -> bool:
        enforcement = self._enforcement
        if not isinstance(refused, IntentRejected) or not enforcement.shadow \
                or refused.reason not in SHADOWABLE:
            return False
        if enforcement.verdict is None:
            enforcement.verdict = ShadowVerdict(self._name, refused.reason, refused.message, refused)
        return True


def lookup_in_mode(policy: Policy, name: str, enforcement: Enforcement) -> ToolPolicy:
    """``lookup_tool``; in shadow mode an unknown tool is recorded and runs as allowed-unknown."""
    with enforcement.step("lookup"):
        return lookup_tool(policy, name)
    allowing = policy.model_copy(update={"defaults": policy.defaults.model_copy(
        update={"on_unknown_tool": "allow"})})
    return lookup_tool(allowing, name)
