"""Plain Python functions as guarded tools: the signature is the argument schema."""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from toolguard.context import CallContext
from toolguard.guard import Decision, ToolGuard
from toolguard.intent import Intent, WorkflowIdentity

__all__ = ["GuardedFunction", "guarded"]


class GuardedFunction:
    """A function that only runs through the guard.

    Calling it directly (``f(lead_id="7", score=80)``) returns the result or
    raises the typed error. ``run(args, agent=..., call_id=..., thread_id=...)``
    returns the ``Decision`` and lets the caller give the identity that makes
    retries exactly-once. Inside, the function can read its lease and fenced
    transaction from ``toolguard.current()``.
    """

    def __init__(self, guard: ToolGuard, function: Callable[..., Any], *, name: str,
                 agent: str | None) -> None:
        self.guard = guard
        self.function = function
        self.name = name
        self.agent = agent
        self.is_async = inspect.iscoroutinefunction(function)
        self._signature = inspect.signature(function)
        guard.register(name, function)
        functools.update_wrapper(self, function)

    def intent(self, args: Mapping[str, Any], *, agent: str | None = None,
               call_id: str | None = None, thread_id: str | None = None,
               run_id: str | None = None, node_attempt: int = 1) -> Intent:
        # Untrusted: anything but a mapping goes to the guard as is, which refuses it (audited).
        raw = dict(args) if isinstance(args, Mapping) else args
        return Intent(tool=self.name, args=raw, call_id=call_id,
                      agent=agent if agent is not None else self.agent,
                      workflow=WorkflowIdentity(thread_id=thread_id, run_id=run_id),
                      node_attempt=node_attempt)

    def _execute(self, ctx: CallContext) -> Any:
        return self.function(**_arguments(ctx))

    async def _aexecute(self, ctx: CallContext) -> Any:
        return await self.function(**_arguments(ctx))

    def run(self, args: Mapping[str, Any], **identity: Any) -> Decision:
        if self.is_async:
            msg = f"{self.name} is a coroutine function: use `await arun(...)`"
            raise TypeError(msg)
        return self.guard.run(self.intent(args, **identity), self._execute)

    async def arun(self, args: Mapping[str, Any], **identity: Any) -> Decision:
        intent = self.intent(args, **identity)
        if self.is_async:
            return await self.guard.arun(intent, self._aexecute)

        async def execute(ctx: CallContext) -> Any:
            return self._execute(ctx)

        return await self.guard.arun(intent, execute)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._signature.bind(*args, **kwargs)
        if self.is_async:
            return self._acall(dict(bound.arguments))
        decision = self.run(bound.arguments, call_id=uuid.uuid4().hex)
        return decision.raise_for_rejection()

    async def _acall(self, arguments: dict[str, Any]) -> Any:
        return (await self.arun(arguments, call_id=uuid.uuid4().hex)).raise_for_rejection()


def _arguments(ctx: CallContext) -> dict[str, Any]:
    """The validated values, typed as the function declared them."""
    if ctx.model is None:
        return dict(ctx.args)
    return {name: getattr(ctx.model, name) for name in type(ctx.model).model_fields}


def guarded(guard: ToolGuard, *, name: str | None = None,
            agent: str | None = None) -> Callable[[Callable[..., Any]], GuardedFunction]:
    """Decorator: ``@guarded(guard, agent="billing")`` turns a function into a guarded tool."""

    def decorate(function: Callable[..., Any]) -> GuardedFunction:
        return GuardedFunction(guard, function, name=name or function.__name__, agent=agent)

    return decorate
