"""A tool's answer as its idempotency record keeps it, for adapters whose answers are plain values.

PydanticAI and the OpenAI Agents SDK hand a tool's return value to the model
as JSON (or its text). The record keeps that JSON form (``{"content": ...}``),
so a replay answers with what the model read the first time; a value JSON
cannot hold is kept as its text. ``PlainOutcome`` is ``ToolOutcome``'s twin
for these adapters, without LangChain's message types: the tool's own answer
(or exception) passes on unchanged after the guard recorded the call, and only
a refusal or a replay is answered by toolguard.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic_core import to_jsonable_python

from toolguard.errors import ToolGuardError
from toolguard.guard import Decision
from toolguard.runtime.safe_text import text_of

__all__ = ["PlainOutcome", "record_of", "replayed_value"]

#: Characters kept of an answer JSON cannot hold (recorded as its text).
_CONTENT_LIMIT = 10_000_000


def record_of(output: Any) -> dict[str, Any]:
    """``{"content": <output as JSON>}``, or its text when JSON cannot hold it."""
    try:
        return {"content": to_jsonable_python(output)}
    except Exception:  # any object: its text is what the model would read anyway
        return {"content": text_of(output, _CONTENT_LIMIT)}


def replayed_value(decision: Decision) -> Any:
    """What a replay answers: the recorded JSON value (the text of one JSON could not hold)."""
    recorded = decision.result
    return recorded.get("content") if isinstance(recorded, dict) else recorded


@dataclass
class PlainOutcome:
    """The tool's answer or exception for one guarded call."""

    output: Any = None
    ran: bool = False
    raised: BaseException | None = None

    def run(self, invoke: Callable[[], Any]) -> Any:
        """Run the tool; return what the idempotency record keeps (the guard's body)."""
        self._begin()
        try:
            output = invoke()
        except BaseException as error:
            self.raised = error
            raise
        self.output, self.ran = output, True
        return record_of(output)

    async def arun(self, invoke: Callable[[], Awaitable[Any]]) -> Any:
        self._begin()
        try:
            output = await invoke()
        except BaseException as error:
            self.raised = error
            raise
        self.output, self.ran = output, True
        return record_of(output)

    def _begin(self) -> None:  # the guard may run its body twice (a re-seeded lock server)
        self.output, self.ran, self.raised = None, False, None

    def passes_on(self, decision: Decision) -> bool:
        """True if the tool's own answer is the answer; raise what must propagate.

        False means toolguard answers: a refusal, or a replay of the recorded result.
        An exception the tool raised (recorded as failed) is raised again unchanged,
        as without toolguard; a configuration error is the developer's, never the model's.
        """
        if decision.ok:
            return decision.kind == "accepted" and self.ran
        raised = self.raised
        if isinstance(raised, Exception) and not isinstance(raised, ToolGuardError):
            raise raised
        if decision.reason == "configuration" and decision.error is not None:
            raise decision.error
        return False
