"""Which policy rule a decision came from, and where it is written (file:line and the lines).

The loader keeps the location of every policy value (``Policy.location``); this
module picks the value a reason code points at (``not_authorized`` -> the
tool's ``agents:``, ``invalid_arguments`` -> the argument's constraint,
``budget_exceeded`` -> its ``quotas:``, ...) and cuts the rule's block out of
the YAML text. The policy is the version that decided, as the store keeps it
(``toolguard.store.policy_versions``); a policy loaded from files (``--policy``)
is what the page compares it with.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from toolguard.errors import ToolGuardError
from toolguard.policies import Policy, load_policy, policy_files
from toolguard.policies.loader import build_policy
from toolguard.policies.model import Location, dotted
from toolguard.store import AuditEntry
from toolguard.store.policy_versions import PolicyText, policy_from_texts

__all__ = ["PolicySource", "RuleView", "SourceLine"]

#: The field of a tool's rule that each reason code is about.
REASON_FIELDS: Mapping[str, str] = {
    "not_authorized": "agents",
    "invalid_arguments": "args",
    "out_of_order": "after",
    "lock_timeout": "wait_timeout_s",
    "lease_lost": "ttl_ms",
    "not_owned": "ttl_ms",
    "stale_fencing_token": "locks",
    "stale_read": "locks",
    "unread": "requires_read",
    "missing_idempotency_key": "idempotency_key",
    "idempotency_conflict": "idempotency_key",
    "duplicate": "idempotency_key",
    "rate_limited": "quotas",
    "in_flight_limited": "quotas",
    "budget_exceeded": "quotas",
    "approval_required": "approval",
    "approval_denied": "approval",
    "approval_expired": "approval",
    "approval_mismatch": "approval",
}
#: Rule fields a tool inherits from ``defaults:`` when it does not set them.
INHERITED = frozenset({"ttl_ms", "wait_timeout_s", "after_wait_s", "agents", "fenced", "quotas"})
#: The reasons whose rule is the default for tools the policy does not name.
UNKNOWN_TOOL_REASONS = frozenset({"unknown_tool"})
_ARG_PATH = re.compile(r"^args\.([^\s:]+):")
_AFTER = re.compile(r" must run after (\S+) on ")
_MAX_LINES = 40


@dataclass(frozen=True, slots=True)
class SourceLine:
    number: int
    text: str
    marked: bool


@dataclass(frozen=True, slots=True)
class RuleView:
    """The rule behind one decision: its location, the field in question, the YAML lines."""

    tool: str
    known: bool  # False: the tool is not in the policy (denied or allowed by defaults)
    location: Location | None  # where the field in question is written (None: not known)
    field: str  # dotted path of that field, e.g. tools.set_tier.after[0]
    lines: tuple[SourceLine, ...]
    settings: Mapping[str, str]


class PolicySource:
    """A policy plus the text of its files, to show rules as they are written: loaded from
    files (``PolicySource(paths)``) or as the store keeps a version (``stored``)."""

    def __init__(self, paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> None:
        self.policy: Policy = load_policy(paths)
        self.files = tuple(str(path) for path in policy_files(paths))
        self._texts: dict[str, list[str]] = {}
        for file in self.files:
            try:
                self._texts[file] = Path(file).read_text(encoding="utf-8").splitlines()
            except OSError:  # loaded a moment ago; if it is gone now, show locations only
                self._texts[file] = []

    @classmethod
    def _of(cls, policy: Policy, texts: Mapping[str, list[str]]) -> PolicySource:
        source = cls.__new__(cls)
        source.policy = policy
        source.files = tuple(texts)
        source._texts = dict(texts)
        return source

    @classmethod
    def stored(cls, text: PolicyText) -> PolicySource | None:
        """The version the store keeps: from its YAML files (with lines) when they load to
        that very version, else from its canonical content (no lines); None when the stored
        content is not that version (changed in the store) or does not load."""
        if not text.intact:
            return None
        if text.sources:
            try:
                policy = policy_from_texts(text.sources)
            except ToolGuardError:
                policy = None
            if policy is not None and policy.digest == text.digest:
                return cls._of(policy, {f: t.splitlines() for f, t in text.sources})
        try:
            policy = build_policy(json.loads(text.content))
        except (ToolGuardError, ValueError):
            return None
        return cls._of(policy, {}) if policy.digest == text.digest else None

    @property
    def digest(self) -> str:
        return self.policy.digest

    @property
    def label(self) -> str:
        return ", ".join(self.files)

    def rule_for(self, entry: AuditEntry) -> RuleView | None:
        """The rule ``entry``'s tool falls under (None for an entry without a tool)."""
        if not entry.tool:
            return None
        rule = self.policy.tools.get(entry.tool)
        if rule is None and entry.reason not in UNKNOWN_TOOL_REASONS:
            # Not the default's doing: this policy is not the one that knew the tool.
            return RuleView(entry.tool, False, None, "", (), {})
        if rule is None:
            path: tuple[str | int, ...] = ("defaults", "on_unknown_tool")
            where = self.policy.location(*path)
            block = self.policy.location("defaults")
            mode = self.policy.defaults.on_unknown_tool
            return RuleView(entry.tool, False, where, dotted(path), self._block(block, where),
                            {"on_unknown_tool": mode})
        base: tuple[str | int, ...] = ("tools", entry.tool)
        path = (*base, *self._field(entry, rule.after, rule.quotas))
        where = self.policy.location(*path)
        tool_line = self.policy.location(*base)
        block = tool_line
        if where == tool_line and len(path) > len(base) and path[len(base)] in INHERITED:
            inherited = self.policy.location("defaults", path[len(base)])
            if inherited != self.policy.location("defaults"):  # set in defaults:, not by the tool
                path, where, block = ("defaults", path[len(base)]), inherited, \
                    self.policy.location("defaults")
        lines = self._block(block, where)
        settings = {
            "locks": ", ".join(t.text for t in rule.locks) or "none",
            "agents": ", ".join(rule.agents),
            "ttl_ms": str(rule.ttl_ms),
            "wait_timeout_s": f"{rule.wait_timeout_s:g}",
            "fenced": "yes" if rule.fenced else "no (an external side effect)",
            "idempotency_key": rule.idempotency_key.text if rule.idempotency_key else
            "default (thread / agent path / tool-call id)",
        }
        if rule.after:
            settings["after"] = f"{', '.join(rule.after)} (waits {rule.after_wait_s:g}s)"
        if rule.read_only:
            settings["read_only"] = "yes"
        if rule.redact:
            settings["redact"] = ", ".join(str(p) for p in rule.redact)
        quotas = rule.quotas or self.policy.defaults.quotas
        if quotas:
            settings["quotas"] = "; ".join(
                json.dumps(q.model_dump(mode="json", exclude_defaults=True), sort_keys=True)
                for q in quotas)
        if rule.approval is not None:
            settings["approval"] = json.dumps(
                rule.approval.model_dump(mode="json", exclude_defaults=True), sort_keys=True)
        return RuleView(entry.tool, True, where, dotted(path), lines, settings)

    def _field(self, entry: AuditEntry, after: tuple[str, ...],
               quotas: tuple[object, ...] = ()) -> tuple[str | int, ...]:
        name = REASON_FIELDS.get(entry.reason)
        if name is None:
            return ()
        detail = entry.detail or ""
        if name == "args":
            match = _ARG_PATH.match(detail)
            return ("args", match.group(1)) if match else ("args",)
        if name == "quotas" and len(quotas) == 1:  # the one quota there is: its line
            return ("quotas", 0)
        if name == "after":
            match = _AFTER.search(detail)
            if match and match.group(1) in after:
                return ("after", after.index(match.group(1)))
        return (name,)

    def _block(self, start: Location, marked: Location) -> tuple[SourceLine, ...]:
        """The lines of the mapping that begins at ``start`` (deeper-indented lines after it)."""
        text = self._texts.get(start.file or "", [])
        if not start.line or start.line > len(text):
            return ()
        first = start.line - 1
        indent = _indent(text[first])
        last = first
        for index in range(first + 1, min(len(text), first + _MAX_LINES)):
            line = text[index]
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if _indent(line) <= indent:
                break
            last = index
        return tuple(SourceLine(i + 1, text[i], i + 1 == marked.line and marked.file == start.file)
                     for i in range(first, last + 1))


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))
