"""Plain Python functions as guarded tools: the signature is the argument schema."""

from __future__ import annotations

import copy
import functools
import inspect
import uuid
import warnings
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Generic, Literal, ParamSpec, Self, TypeVar, cast, overload

from toolguard.adapters._worker import has_sync_edges, in_worker
from toolguard.adapters.durable import durable_identity, in_durable_step
from toolguard.adapters.identity import check_identity_source
from toolguard.call.context import CallContext
from toolguard.call.envelope import untrusted_intent
from toolguard.call.intent import Intent
from toolguard.errors import GuardMisconfigured, UnknownToolWarning
from toolguard.guard import Decision, ToolGuard

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

    Defined in a class body it is a method, as a function there is: read off
    an instance it is bound to it (``repo.rescore(lead_id="7")``), and its
    first parameter is the instance, never one of the tool's arguments.
    """

    __name__: str  # the function's, as functools.update_wrapper copies it (with __doc__ and more)

    def __init__(self, guard: ToolGuard, function: Callable[P, R], *, name: str,
                 agent: str | None, agent_from: Literal["call"] | None = None,
                 stacklevel: int = 2) -> None:
        if agent is not None and (not isinstance(agent, str) or not agent):
            msg = f"agent= must be a non-empty string or None, got {agent!r:.40}"
            raise GuardMisconfigured(msg)
        check_identity_source(agent, agent_from, f"@guarded {name}", source="call", resolver=False)
        self.guard = guard
        self.function = function
        #: The function called with validated keyword arguments (a dict, not ``P``).
        self._target: Callable[..., Any] = function
        self.name = name
        self.agent = agent
        self.is_async = inspect.iscoroutinefunction(function)
        if not self.is_async and not has_sync_edges(guard):
            msg = (f"{name} is a sync function, and this guard has only asyncio locks and store "
                   f"(async_locks=, async_store=): it would run without a sync fenced "
                   f"transaction. Give the guard locks= and store= as well (arun() then runs "
                   f"it in a worker thread), or make {name} an async def using current().atx")
            raise GuardMisconfigured(msg)
        self._signature = inspect.signature(function)
        #: True once it is a class attribute: its first parameter is then the instance.
        self._method = False
        guard.register(name, function, stacklevel=stacklevel + 1)
        functools.update_wrapper(self, function)
        if self.is_async:
            _mark_coroutine_function(self, function)

    def __set_name__(self, owner: type, attribute: str) -> None:
        """A method: the tool's arguments are its parameters after the instance."""
        parameters = list(self._signature.parameters.values())
        if not parameters or parameters[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                        inspect.Parameter.POSITIONAL_OR_KEYWORD):
            return
        self._method = True
        source = _with_signature(self.function, self._signature.replace(parameters=parameters[1:]))
        with warnings.catch_warnings():  # a name the policy does not know warned at decoration
            warnings.simplefilter("ignore", UnknownToolWarning)
            self.guard.register(self.name, source)

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> Self: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> GuardedFunction[..., R]: ...

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        """Read off an instance, a method is bound to it (a copy whose target has the instance)."""
        if instance is None or not self._method:
            return self
        bound = copy.copy(self)
        bound._method = False
        bound._target = functools.partial(cast(Callable[..., Any], self.function), instance)
        parameters = list(self._signature.parameters.values())[1:]
        bound._signature = self._signature.replace(parameters=parameters)
        bound.__signature__ = bound._signature  # type: ignore[attr-defined]
        bound.__self__ = instance  # type: ignore[attr-defined]
        return bound

    def intent(self, args: Any, *, agent: Any = None, call_id: Any = None, thread_id: Any = None,
               run_id: Any = None, node_attempt: Any = 1) -> Intent:
        """The intent of one direct call; never raises (the guard refuses a bad one).

        Without a call id, thread and run, a call inside a durable engine's step
        (a DBOS step) takes the step's identity (``toolguard.adapters.durable``):
        a re-run of the step replays it.
        """
        if call_id is None and thread_id is None and run_id is None:
            durable = durable_identity()
            if durable is not None:
                call_id, run_id, node_attempt = durable.call_id, durable.run_id, durable.attempt
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
        self._check_bound()
        if self.is_async:
            msg = f"{self.name} is a coroutine function: use `await {self.name}.arun(...)`"
            raise GuardMisconfigured(msg)
        intent = self.intent(args, agent=agent, call_id=call_id, thread_id=thread_id,
                             run_id=run_id, node_attempt=node_attempt)
        return self.guard.run(intent, self._execute)

    async def arun(self, args: Mapping[str, Any], *, agent: str | None = None,
                   call_id: str | None = None, thread_id: str | None = None,
                   run_id: str | None = None, node_attempt: int = 1) -> Decision:
        """The asyncio twin of ``run``.

        A sync function runs its sync guarded call (``current().tx``) in a
        worker thread, so it never blocks the event loop.
        """
        self._check_bound()
        if not self.is_async:
            return await in_worker(lambda: self.run(args, agent=agent, call_id=call_id,
                                                    thread_id=thread_id, run_id=run_id,
                                                    node_attempt=node_attempt))
        intent = self.intent(args, agent=agent, call_id=call_id, thread_id=thread_id,
                             run_id=run_id, node_attempt=node_attempt)
        return await self.guard.arun(intent, self._aexecute)

    def _check_bound(self) -> None:
        if self._method:
            msg = f"{self.name} is a method: run it on an instance (`obj.{self.name}.run(...)`)"
            raise GuardMisconfigured(msg)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._method:  # read off the class: the first argument is the instance
            if not args:
                msg = f"{self.name}() is a method: call it on an instance"
                raise TypeError(msg)
            method: GuardedFunction[..., R] = self.__get__(args[0], type(args[0]))
            return method(*args[1:], **kwargs)
        bound = self._signature.bind(*args, **kwargs)
        if self.is_async:
            return cast(R, self._acall(dict(bound.arguments)))
        decision = self.run(bound.arguments, call_id=_direct_call_id())
        return cast(R, decision.raise_for_rejection())

    def _acall(self, arguments: dict[str, Any]) -> Coroutine[Any, Any, Any]:
        async def call() -> Any:
            return (await self.arun(arguments, call_id=_direct_call_id())).raise_for_rejection()

        return call()


def _direct_call_id() -> str | None:
    """A fresh id for a direct call; none inside a durable step, whose identity ``intent`` takes."""
    return None if in_durable_step() else uuid.uuid4().hex


def _with_signature(function: Callable[..., Any], signature: inspect.Signature) -> Callable[..., Any]:
    """A stand-in for ``function`` whose signature is ``signature`` (the schema source of a method)."""

    @functools.wraps(function)
    def source(*args: Any, **kwargs: Any) -> Any:  # pragma: no cover - only read, never called
        raise NotImplementedError

    source.__signature__ = signature  # type: ignore[attr-defined]
    return source


def _mark_coroutine_function(wrapper: Any, function: Callable[..., Any]) -> None:
    """Make ``inspect.iscoroutinefunction(wrapper)`` true, as it is for ``function``.

    Hosts tell async tools from sync ones by it (LangChain's ``@tool`` and
    ``StructuredTool``, LangGraph's nodes): a guarded coroutine function seen
    as sync would be called without being awaited. Python 3.12 has a marker
    for that; on 3.11 ``inspect`` reads the code flags of anything function-like,
    so the wrapper carries the function's code object, defaults and keyword
    defaults (its signature still comes from the function, through ``__wrapped__``).
    """
    mark = getattr(inspect, "markcoroutinefunction", None)
    if mark is not None:
        mark(wrapper)
        return
    for attribute in ("__code__", "__defaults__", "__kwdefaults__"):
        if hasattr(function, attribute):
            setattr(wrapper, attribute, getattr(function, attribute))


def _arguments(ctx: CallContext) -> dict[str, Any]:
    """The validated values, typed as the function declared them."""
    if ctx.model is None:
        return dict(ctx.args)
    return {name: getattr(ctx.model, name) for name in type(ctx.model).model_fields}


def guarded(guard: ToolGuard, *, name: str | None = None, agent: str | None = None,
            agent_from: Literal["call"] | None = None
            ) -> Callable[[Callable[P, R]], GuardedFunction[P, R]]:
    """Decorator: ``@guarded(guard, agent="billing")`` turns a function into a guarded tool.

    The result is typed like the function (``ParamSpec``): a wrong argument type
    is a type-checker error and the return type flows through. A name the
    policy does not know warns (``UnknownToolWarning``) here, at decoration,
    and the policy is checked against the signature (``PolicyProblems``).
    Without ``agent=``, say ``agent_from="call"``: each ``run``/``arun``
    then gives ``agent=`` (a direct call has none and is refused); with
    neither, decorating raises ``GuardMisconfigured``.
    """

    def decorate(function: Callable[P, R]) -> GuardedFunction[P, R]:
        return GuardedFunction(guard, function, name=name or function.__name__, agent=agent,
                               agent_from=agent_from, stacklevel=3)

    return decorate
