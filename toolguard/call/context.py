"""What a guarded tool sees while it runs: its intent, validated args, lease and transaction.

LangGraph's ToolNode strips hidden arguments a wrapper adds (an anti-forgery
measure), so the lease cannot travel as an argument. A ``ContextVar`` reaches
the tool on both paths: the sync ToolNode copies the context into its worker
threads, and asyncio tasks inherit it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from contextvars import ContextVar, Token
from typing import Any

from pydantic import BaseModel

from toolguard.call.intent import Intent
from toolguard.errors import GuardMisconfigured, ToolGuardError
from toolguard.locks.lease import Lease
from toolguard.store.base import AsyncFencedTransaction, FencedTransaction

__all__ = ["CallContext", "current", "current_or_none"]

_SYNC_BODY_ON_ASYNC_PATH = (
    "{tool}: a sync tool body is running on the async path (ainvoke/arun), where the fenced "
    "transaction is asyncio-only; give the tool an async implementation (e.g. StructuredTool "
    "coroutine=...) that uses current().atx, or run the graph with invoke()")
_ASYNC_TX_IN_SYNC_CODE = (
    "{tool}: this call runs on the async path; an async tool reads its transaction from "
    "current().atx (await atx.execute(...))")
_SYNC_TX_IN_ASYNC_CODE = (
    "{tool}: this call runs on the sync path; use current().tx (tx.execute(...)), or run the "
    "graph with ainvoke() for an async tool")
_NO_TX = ("{tool} runs without a fenced transaction (read_only, or no lock key); it has no "
          "current().tx")


class CallContext:
    """The guard's view of the call in progress, handed to the tool.

    ``tx`` (sync tools) and ``atx`` (async tools) are the store's fenced
    transaction: run the reads that decide a write *and* the write through it
    (``tx.execute(...)``), so a holder paused past its TTL can never write on a
    stale read. Each raises ``GuardMisconfigured`` where it cannot work: ``tx``
    on the async path, a sync tool body on the async path, a read-only tool
    (no transaction). An unfenced tool must pass ``idempotency_key`` to the
    external system, which is what makes a retry safe there.
    """

    __slots__ = ("_tx", "args", "edited", "extra", "idempotency_key", "intent", "keys", "lease",
                 "model", "tool")

    def __init__(self, *, intent: Intent, tool: str, args: Mapping[str, Any],
                 idempotency_key: str, keys: tuple[str, ...], model: BaseModel | None = None,
                 lease: Lease | None = None,
                 tx: FencedTransaction | AsyncFencedTransaction | None = None,
                 extra: dict[str, Any] | None = None,
                 edited: Mapping[str, Any] | None = None) -> None:
        self.intent = intent
        self.tool = tool
        #: Validated, as JSON values; ``model`` holds the typed instance.
        self.args = args
        self.idempotency_key = idempotency_key
        self.keys = keys
        self.model = model
        self.lease = lease
        self.extra: dict[str, Any] = {} if extra is None else extra
        self._tx = tx
        #: The arguments a person replaced when approving an edit (validated, also in ``args``);
        #: an adapter that runs the tool from the model's own call passes them on.
        self.edited = edited

    @property
    def tx(self) -> FencedTransaction:
        """The fenced transaction of a sync tool."""
        tx = self._tx
        if isinstance(tx, FencedTransaction):
            return tx
        if isinstance(tx, AsyncFencedTransaction):
            template = _ASYNC_TX_IN_SYNC_CODE if _in_event_loop() else _SYNC_BODY_ON_ASYNC_PATH
            raise GuardMisconfigured(template.format(tool=self.tool))
        raise GuardMisconfigured(_NO_TX.format(tool=self.tool))

    @property
    def atx(self) -> AsyncFencedTransaction:
        """The fenced transaction of an async tool (``await ctx.atx.execute(...)``)."""
        tx = self._tx
        if isinstance(tx, AsyncFencedTransaction):
            if not _in_event_loop():
                raise GuardMisconfigured(_SYNC_BODY_ON_ASYNC_PATH.format(tool=self.tool))
            return tx
        if isinstance(tx, FencedTransaction):
            raise GuardMisconfigured(_SYNC_TX_IN_ASYNC_CODE.format(tool=self.tool))
        raise GuardMisconfigured(_NO_TX.format(tool=self.tool))

    @property
    def fenced(self) -> bool:
        """True when the call runs inside a fenced transaction (``tx`` or ``atx``)."""
        return self._tx is not None

    @property
    def tokens(self) -> Mapping[str, int]:
        return self.lease.tokens if self.lease is not None else {}

    def check(self) -> None:
        """Raise ``LockLost`` if the lease is gone: call it before an unfenced side effect."""
        if self.lease is not None:
            self.lease.check()

    def __repr__(self) -> str:
        return f"CallContext(tool={self.tool!r}, keys={self.keys!r}, fenced={self.fenced})"


def _in_event_loop() -> bool:
    """True when this thread runs an event loop (an async tool), false in a worker thread."""
    return asyncio._get_running_loop() is not None


_current: ContextVar[CallContext | None] = ContextVar("toolguard_call", default=None)


def current() -> CallContext:
    """The context of the guarded call this code runs in."""
    ctx = _current.get()
    if ctx is None:
        msg = "no guarded tool call is running here (call the tool through toolguard)"
        raise ToolGuardError(msg, reason="no_context")
    return ctx


def current_or_none() -> CallContext | None:
    return _current.get()


class bind:  # used as a function: ``with bind(ctx) as ctx:``
    """``with bind(ctx):`` makes ``ctx`` the current call context for the block.

    A class rather than a generator-based context manager: it runs twice on every
    guarded call, and this form costs a fraction of ``contextlib``'s.
    """

    __slots__ = ("_ctx", "_token")

    def __init__(self, ctx: CallContext) -> None:
        self._ctx = ctx
        self._token: Token[CallContext | None] | None = None

    def __enter__(self) -> CallContext:
        self._token = _current.set(self._ctx)
        return self._ctx

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
