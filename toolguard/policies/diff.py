"""``toolguard policy diff OLD NEW``: what a policy change would do to recent intents.

The last audited intents (tool, agent, arguments as recorded) are replayed
through both policies' pure decision steps, with no side effect: unknown tool,
input limits, who may call it, ``args:`` constraints, lock keys, whether it
needs approval, its mode, and which quotas it draws on. Each intent whose
verdict differs is reported.

What a replay cannot know: arguments the policy redacts are recorded as
``"[redacted]"`` and replayed as that text (a decision that depends on them may
differ); the tool's own schema is not applied (the tools are not loaded);
quota counters and ordering depend on what else ran at the time, so only
*which* quotas a call would draw on is compared, not whether they would admit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from toolguard.call.intent import check_limits
from toolguard.controls.approvals import approval_reason
from toolguard.errors import IntentRejected
from toolguard.policies.decisions import (
    REDACTED,
    authorize,
    check_constraints,
    lock_keys,
    lookup_tool,
)
from toolguard.policies.model import Policy
from toolguard.store.base import AuditEntry

__all__ = ["ALLOWED", "Change", "DiffReport", "Verdict", "diff", "replayable", "verdict"]

#: The outcome of a call the policy's pure steps let through.
ALLOWED = "allowed"
#: Audit decisions that are not an intent of their own (a shadow row repeats its call's).
_NOT_INTENTS = frozenset({"shadow", "operator"})


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one policy's pure steps decide for one call."""

    outcome: str  # ALLOWED or the reason code of the refusal
    message: str = ""
    keys: tuple[str, ...] = ()
    approval: str | None = None
    mode: str = "enforce"
    quotas: tuple[str, ...] = ()

    def describe(self) -> str:
        return "allowed" if self.outcome == ALLOWED else f"refused {self.outcome}"


@dataclass(frozen=True, slots=True)
class Change:
    """One audited intent whose verdict differs between the two policies."""

    entry: AuditEntry
    old: Verdict
    new: Verdict
    what: tuple[str, ...]
    redacted: bool


@dataclass(slots=True)
class DiffReport:
    changes: list[Change] = field(default_factory=list)
    unchanged: int = 0
    skipped: list[tuple[AuditEntry, str]] = field(default_factory=list)
    redacted: int = 0

    @property
    def replayed(self) -> int:
        return len(self.changes) + self.unchanged


def verdict(policy: Policy, tool: str, agent: str | None, args: Mapping[str, Any]) -> Verdict:
    """``policy``'s pure decision on a call, never raising for a refusal."""
    try:
        rule = lookup_tool(policy, tool)
    except IntentRejected as refused:
        return Verdict(refused.reason, refused.message, mode=policy.defaults.mode)
    quotas = tuple(sorted({quota.counter(tool) for quota in rule.quotas}))
    try:
        check_limits(dict(args), rule.limits)
        authorize(rule, agent)
        check_constraints(rule, args)
        keys = () if rule.read_only else lock_keys(rule, args)
    except IntentRejected as refused:
        return Verdict(refused.reason, refused.message, mode=rule.mode, quotas=quotas)
    return Verdict(ALLOWED, keys=keys, approval=approval_reason(rule, args), mode=rule.mode,
                   quotas=quotas)


def replayable(entry: AuditEntry) -> tuple[dict[str, Any] | None, str]:
    """The arguments to replay ``entry`` with, or None and why it cannot be replayed."""
    if entry.decision in _NOT_INTENTS:
        return None, f"not an intent (decision {entry.decision})"
    if not entry.tool:
        return None, "no tool recorded"
    if not isinstance(entry.args, Mapping):
        return None, "no arguments recorded"
    if "_unvalidated" in entry.args:
        return None, "its arguments never passed validation (only their shape was recorded)"
    return dict(entry.args), ""


def _has_redacted(value: Any) -> bool:
    if value == REDACTED:
        return True
    if isinstance(value, Mapping):
        return any(_has_redacted(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_redacted(v) for v in value)
    return False


def _changes(old: Verdict, new: Verdict) -> tuple[str, ...]:
    what = []
    if old.outcome != new.outcome:
        tail = f": {new.message}" if new.outcome != ALLOWED and new.message else ""
        what.append(f"{old.describe()} -> {new.describe()}{tail}")
    elif old.outcome == ALLOWED:
        if old.keys != new.keys:
            what.append(f"keys {' '.join(old.keys) or '-'} -> {' '.join(new.keys) or '-'}")
        if (old.approval is None) != (new.approval is None):
            what.append(f"now needs approval ({new.approval})" if new.approval
                        else "no longer needs approval")
        if old.quotas != new.quotas:
            gained = sorted(set(new.quotas) - set(old.quotas))
            lost = sorted(set(old.quotas) - set(new.quotas))
            what.append("quotas " + ", ".join([*(f"+{q}" for q in gained), *(f"-{q}" for q in lost)]))
    if old.mode != new.mode:
        what.append(f"mode {old.mode} -> {new.mode}")
    return tuple(what)


def diff(old: Policy, new: Policy, entries: Iterable[AuditEntry]) -> DiffReport:
    """Replay ``entries`` through both policies; what would change."""
    report = DiffReport()
    for entry in entries:
        args, why = replayable(entry)
        if args is None:
            report.skipped.append((entry, why))
            continue
        assert entry.tool is not None
        redacted = _has_redacted(args)
        report.redacted += redacted
        before = verdict(old, entry.tool, entry.agent, args)
        after = verdict(new, entry.tool, entry.agent, args)
        what = _changes(before, after)
        if what:
            report.changes.append(Change(entry, before, after, what, redacted))
        else:
            report.unchanged += 1
    return report
