"""What the tool did during one guarded call, and whether its own answer passes on.

The adapters hand the guard a body that runs the real tool (ToolNode's
``execute``, a LangChain tool's ``invoke``). ``ToolOutcome`` keeps what that
returned or raised, so that after the guard decided (and recorded the call as
accepted, failed or unknown) the caller gets exactly what the tool produced:

- an accepted call: the tool's answer, unchanged;
- a tool that answered with an error (``status="error"``, e.g. a message built
  by ToolNode's ``handle_tool_errors``): recorded as ``failed/tool_error``, its
  transaction rolled back, the answer unchanged;
- a tool that raised: recorded as ``failed/error``, the same exception raised
  again, for ``handle_tool_errors`` or the caller to deal with as without toolguard.

Only a refusal (toolguard said no, before or after the tool ran) and a replay
(the recorded result of an intent that already ran) are answered by toolguard.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from toolguard.adapters._messages import recordable
from toolguard.errors import ToolGuardError
from toolguard.guard import Decision

__all__ = ["ToolOutcome"]


@dataclass
class ToolOutcome:
    """The tool's answer or exception for one call (``call_id`` picks the answering message)."""

    call_id: str | None
    output: Any = None
    ran: bool = False
    reported_error: bool = False
    raised: Exception | None = None

    def run(self, invoke: Callable[[], Any]) -> Any:
        """Run the tool; return what the idempotency record keeps (the guard's body)."""
        self._begin()
        try:
            output = invoke()
        except Exception as error:
            self.raised = error
            raise
        return self._finish(output)

    async def arun(self, invoke: Callable[[], Awaitable[Any]]) -> Any:
        self._begin()
        try:
            output = await invoke()
        except Exception as error:
            self.raised = error
            raise
        return self._finish(output)

    def _begin(self) -> None:  # the guard may run its body twice (a re-seeded lock server)
        self.output, self.ran, self.reported_error, self.raised = None, False, False, None

    def _finish(self, output: Any) -> Any:
        self.output, self.ran = output, True
        try:
            return recordable(output, self.call_id)
        except ToolGuardError:
            self.reported_error = True
            raise

    def passes_on(self, decision: Decision) -> bool:
        """True if the tool's own answer (``output``) is the answer; raise what must propagate.

        False means toolguard answers: a refusal, or a replay of the recorded result.
        """
        if decision.ok:
            return decision.kind == "accepted" and self.ran
        if self.reported_error and decision.reason == "tool_error":
            return True
        if self.raised is not None and not isinstance(self.raised, ToolGuardError):
            raise self.raised  # already recorded as failed; it goes on as without toolguard
        if decision.reason == "configuration" and decision.error is not None:
            raise decision.error  # a developer's mistake, never the model's to read
        return False
