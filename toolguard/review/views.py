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

from toolguard.call.decision import recorded_model_text
from toolguard.store import AuditEntry
from toolguard.store.audit_view import REASONS, _when, _why

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
    """What the model read for this decision: toolguard's exact text, or whose answer it was."""
    text = recorded_model_text(entry.decision, entry.reason, entry.detail)
    if entry.decision == "rejected":
        note = ("The error ToolMessage toolguard answered the call with; a plain Python caller "
                "got the typed exception.")
        if entry.reason in ("unknown_tool", "invalid_arguments"):
            note += (" Where ToolNode refuses the call too (a tool it does not have, arguments "
                     "the tool's own schema refuses), the model read ToolNode's own answer.")
        return ModelMessage(text, note)
    if entry.decision == "failed":
        if text is not None:
            return ModelMessage(text, "The error ToolMessage toolguard answered with: a short "
                                      "text; the detail stayed in the audit log.")
        if entry.reason == "configuration":
            return ModelMessage(None, "Nothing: a configuration mistake, raised to the developer "
                                      "(GuardMisconfigured), never shown to the model.")
        return ModelMessage(None, "The tool's own failure, passed on unchanged by the LangGraph "
                                  "and LangChain adapters: the model read what the tool (or "
                                  "ToolNode's handle_tool_errors) made of it. A @guarded function "
                                  "raised ToolFailed.")
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
