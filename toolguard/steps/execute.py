"""The execute step: what runs inside the fenced transaction, on either path.

``Body`` binds the call's context, runs the tool, refuses to commit under a
lease lost meanwhile, and records the result: with the policy's redacted
values masked for the store (what a replay returns), in clear for the caller.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from toolguard.call.context import CallContext, bind
from toolguard.call.decision import Decision, ToolFailed
from toolguard.call.intent import Intent
from toolguard.errors import ToolGuardError, is_control_flow
from toolguard.policies.redaction import scrub, scrub_text
from toolguard.runtime import telemetry
from toolguard.steps.prepared import Prepared, accepted
from toolguard.store.base import AsyncFencedTransaction, FencedTransaction
from toolguard.store.recovery import Outcome

__all__ = ["Body", "context_of"]


def context_of(intent: Intent, prepared: Prepared,
               tx: FencedTransaction | AsyncFencedTransaction | None) -> CallContext:
    """The ``CallContext`` a tool sees: validated args, keys, lease and transaction."""
    return CallContext(intent=intent, tool=intent.tool, args=prepared.args, model=prepared.model,
                       idempotency_key=prepared.record.idempotency_key or "",
                       keys=prepared.keys, lease=tx.lease if tx is not None else None, tx=tx,
                       edited=prepared.edited)


class Body:
    """The fenced body of one call: ``sync(execute)`` or ``asynchronous(execute)`` for run_fenced."""

    __slots__ = ("call", "clear", "intent", "prepared", "would_refuse")

    def __init__(self, intent: Intent, prepared: Prepared, call: telemetry.Call) -> None:
        self.intent = intent
        self.prepared = prepared
        self.call = call
        self.clear: Any = None
        #: The refusal a shadowed read check would have made (``stale_reads: shadow``).
        self.would_refuse: ToolGuardError | None = None

    def sync(self, execute: Callable[[CallContext], Any]) -> Callable[[FencedTransaction], Any]:
        def body(tx: FencedTransaction) -> Any:
            with bind(context_of(self.intent, self.prepared, tx)) as ctx, \
                    self.call.step(telemetry.SPAN_TOOL):
                try:
                    value = execute(ctx)
                except Exception as error:
                    raise self._masked(error)  # noqa: B904 - the cause is kept on the error itself
            return self._record(tx, value)

        return body

    def asynchronous(self, execute: Callable[[CallContext], Awaitable[Any]]
                     ) -> Callable[[AsyncFencedTransaction], Awaitable[Any]]:
        async def body(tx: AsyncFencedTransaction) -> Any:
            with bind(context_of(self.intent, self.prepared, tx)) as ctx, \
                    self.call.step(telemetry.SPAN_TOOL):
                try:
                    value = await execute(ctx)
                except Exception as error:
                    raise self._masked(error)  # noqa: B904 - the cause is kept on the error itself
            return self._record(tx, value)

        return body

    def _record(self, tx: FencedTransaction | AsyncFencedTransaction, value: Any) -> Any:
        self.would_refuse = tx.would_refuse
        if tx.lease is not None:
            tx.lease.check()
        if not tx.recorded:
            tx.record(value)
        self.clear = tx.result
        secrets = self.prepared.secrets
        if secrets:
            tx.record(scrub(self.clear, secrets))
        return tx.result

    def _masked(self, error: Exception) -> Exception:
        """``error`` with the redacted values out of its text: the store audits ``str(error)``."""
        secrets = self.prepared.secrets
        if not secrets or is_control_flow(error):
            return error
        text = str(error)
        masked = scrub_text(text, secrets)
        if masked == text:
            return error
        if isinstance(error, ToolGuardError):  # keep the type: the flow depends on it
            error.args = (masked, *error.args[1:])
            return error
        wrapped = ToolFailed(f"{type(error).__name__}: {masked}", reason="error")
        wrapped.__cause__ = error
        return wrapped

    def decision(self, outcome: Outcome[Any]) -> Decision:
        result = outcome.value if outcome.replayed else self.clear
        return accepted(self.intent, self.prepared, result, outcome.replayed, outcome.tokens)
