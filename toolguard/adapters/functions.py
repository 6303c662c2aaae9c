"""Plain Python functions as guarded tools: the signature is the argument schema."""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Generic, ParamSpec, TypeVar, cast

from toolguard.context import CallContext
from toolguard.envelope import untrusted_intent
from toolguard.errors import GuardMisconfigured
from toolguard.guard import Decision, ToolGuard
from toolguard.intent import Intent

__all__ = ["GuardedFunction", "guarded"]

P = ParamSpec("P")
R = TypeVar("R")


class GuardedFunction(Generic[P, R]):
    """A function that only runs through the guard; typed like the function it wraps.

    Calling it directly (``f(lead_id="7", score=80)``) returns the result or
    raises the typed error; each such call is its own intent (a fresh call id,
    no thread), so it runs once without replay protection.
    ``run(args, agent=..., call_id=..., thread_id=...)`` returns the
    ``Decision`` and never raises for anything in ``args`` or the identity
    (a bad one is refused as ``invalid_intent``, audited); giving a call id and
    a thread makes retries exactly-once. Inside, the function reads its lease
    and fenced transaction from ``toolguard.current()``.
    """

    __name__: str  # the function's, as functools.update_wrapper copies it (with __doc__ and more)

    def __init__(self, guard: ToolGuard, function: Callable[P, R], *, name: str,
                 agent: str | None, stacklevel: int = 2) -> None:
        if agent is not None and (not isinstance(agent, str) or not agent):
            msg = f"agent= must be a non-empty string or None, got {agent!r:.40}"
            raise GuardMisconfigured(msg)
        self.guard = guard
        self.function = function
        #: The function called with validated keyword arguments (a dict, not ``P``).
        self._target: Callable[..., Any] = function
        self.name = name
        self.agent = agent
        self.is_async = inspect.iscoroutinefunction(function)
        self._signature = inspect.signature(function)
        guard.register(name, function, stacklevel=stacklevel + 1)
        functools.update_wrapper(self, function)

    def intent(self, args: Any, *, agent: Any = None, call_id: Any = None, thread_id: Any = None,
               run_id: Any = None, node_attempt: Any = 1) -> Intent:
        """The intent of one direct call; never raises (the guard refuses a bad one)."""
        # Untrusted: anything but a mapping goes to the guard as is, which refuses it (audited).
        raw = dict(args) if isinstance(args, Mapping) else args
        return untrusted_intent(tool=self.name, args=raw, call_id=call_id,
                                agent=agent if agent is not None else self.agent,
                                thread_id=thread_id, run_id=run_id, node_attempt=node_attempt,
                                origin="python")

    def _execute(self, ctx: CallContext) -> Any:
        return self._target(**_arguments(ctx))

    async def _aexecute(self, ctx: CallContext) -> Any:
        return await self._target(**_arguments(ctx))

    def run(self, args: Mapping[str, Any], *, agent: str | None = None,
            call_id: str | None = None, thread_id: str | None = None, run_id: str | None = None,
            node_attempt: int = 1) -> Decision:
        """Guard one call of a sync function; the ``Decision``, audited once."""
        if self.is_async:
            msg = f"{self.name} is a coroutine function: use `await {self.name}.arun(...)`"
            raise GuardMisconfigured(msg)
        intent = self.intent(args, agent=agent, call_id=call_id, thread_id=thread_id,
                             run_id=run_id, node_attempt=node_attempt)
        return self.guard.run(intent, self._execute)

    async def arun(self, args: Mapping[str, Any], *, agent: str | None = None,
                   call_id: str | None = None, thread_id: str | None = None,
                   run_id: str | None = None, node_attempt: int = 1) -> Decision:
        """The asyncio twin of ``run`` (a sync function runs on the loop: keep it short)."""
        intent = self.intent(args, agent=agent, call_id=call_id, thread_id=thread_id,
                             run_id=run_id, node_attempt=node_attempt)
        if self.is_async:
            return await self.guard.arun(intent, self._aexecute)

        async def execute(ctx: CallContext) -> Any:
            return self._execute(ctx)

        return await self.guard.arun(intent, execute)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        bound = self._signature.bind(*args, **kwargs)
        if self.is_async:
            return cast(R, self._acall(dict(bound.arguments)))
        decision = self.run(bound.arguments, call_id=uuid.uuid4().hex)
        return cast(R, decision.raise_for_rejection())

    def _acall(self, arguments: dict[str, Any]) -> Coroutine[Any, Any, Any]:
        async def call() -> Any:
            return (await self.arun(arguments, call_id=uuid.uuid4().hex)).raise_for_rejection()

        return call()


def _arguments(ctx: CallContext) -> dict[str, Any]:
    """The validated values, typed as the function declared them."""
    if ctx.model is None:
        return dict(ctx.args)
    return {name: getattr(ctx.model, name) for name in type(ctx.model).model_fields}


def guarded(guard: ToolGuard, *, name: str | None = None, agent: str | None = None
            ) -> Callable[[Callable[P, R]], GuardedFunction[P, R]]:
    """Decorator: ``@guarded(guard, agent="billing")`` turns a function into a guarded tool.

    The result is typed like the function (``ParamSpec``): a wrong argument type
    is a type-checker error and the return type flows through. A name the
    policy does not know warns (``UnknownToolWarning``) here, at decoration.
    """

    def decorate(function: Callable[P, R]) -> GuardedFunction[P, R]:
        return GuardedFunction(guard, function, name=name or function.__name__, agent=agent,
                               stacklevel=3)

    return decorate
