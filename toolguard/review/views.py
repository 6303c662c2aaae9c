"""How one audit row reads on the page: times, the one-line why, what the model was told.

The wording is the CLI's (``toolguard audit``): the same reason meanings, the
same UTC times, the same one-line summary, so the page and the terminal never
disagree about what a row says.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from toolguard.cli.audit import REASONS, _when, _why
from toolguard.guard import REJECTION_TEMPLATE
from toolguard.store import AuditEntry

__all__ = ["TAB_ORDER", "ModelMessage", "decision_counts", "meaning", "model_message", "pretty",
           "when", "why"]

#: The decision tabs, refusals first (the page is mostly read for those).
TAB_ORDER = ("rejected", "failed", "unknown", "replayed", "accepted")


@dataclass(frozen=True, slots=True)
class ModelMessage:
    """What the model read back for this call, or why the log cannot say."""

    text: str | None
    note: str


def model_message(entry: AuditEntry) -> ModelMessage:
    """The tool result the adapters built for this decision (rejected/failed: its exact text)."""
    if entry.decision in ("rejected", "failed"):
        text = REJECTION_TEMPLATE.format(reason=entry.reason, message=entry.detail or "")
        return ModelMessage(text, "The error ToolMessage the LangGraph and LangChain adapters "
                                  "returned; plain Python callers got the typed exception with "
                                  "the same message.")
    if entry.decision == "replayed":
        return ModelMessage(None, "The result recorded by the attempt that applied (see the "
                                  "attempts below); the tool did not run again.")
    if entry.decision == "unknown":
        return ModelMessage(None, "Nothing: the call was interrupted or cancelled before it "
                                  "finished; it runs again, under the same idempotency key, "
                                  "when the graph resumes.")
    if entry.decision == "accepted":
        return ModelMessage(None, "The tool's own result (the audit log does not keep results).")
    return ModelMessage(None, f"The log does not say for decision {entry.decision!r}.")


def when(moment: Any, short: bool = False) -> str:
    """UTC, like the CLI: ``2025-01-31 14:00:00`` (short) or ISO 8601 with milliseconds."""
    return _when(moment, short=short)


def why(entry: AuditEntry, width: int = 200) -> str:
    """The one-line reason the CLI prints under a row ("" for a plain accepted write)."""
    return _why(entry, width=width)


def meaning(reason: str) -> str:
    return REASONS.get(reason, "")


def pretty(value: Any) -> str:
    """Arguments as indented JSON (they are JSON already: the store only writes JSON)."""
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


def decision_counts(entries: Iterable[AuditEntry]) -> list[tuple[str, int]]:
    """Counts per decision, in tab order (the "all" tab counts the rest too)."""
    counts = Counter(entry.decision for entry in entries)
    return [(decision, counts.get(decision, 0)) for decision in TAB_ORDER]
