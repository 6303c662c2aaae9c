"""The doctor's report: one ``Check`` per item of the checklist, and the exit code they give.

Every check module returns these; ``toolguard doctor`` prints them (or their
JSON). Separate so the checks share one model and the command one verdict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["Check", "Status", "exit_code"]

Status = Literal["pass", "warn", "fail", "skip"]


@dataclass(frozen=True, slots=True)
class Check:
    """One item of the checklist: what was found, and why it matters."""

    name: str
    title: str
    status: Status
    summary: str
    why: str
    fix: str | None = None
    unreachable: bool = False  # a failure because a backend did not answer (exit 3)
    refused: bool = False  # a failure because a backend answered no (role, database, auth: exit 4)
    data: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def exit_code(checks: Sequence[Check], *, strict: bool = False) -> int:
    """3 if a backend is unreachable, 4 if one refused us, 1 if a check failed (or warned, with
    ``strict``), else 0."""
    if any(c.unreachable for c in checks):
        return 3
    if any(c.refused for c in checks):
        return 4
    if any(c.status == "fail" for c in checks) or (strict and any(c.status == "warn" for c in checks)):
        return 1
    return 0


def _reason(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
