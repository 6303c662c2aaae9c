"""What a guarded tool sees while it runs: its intent, validated args, lease and transaction.

LangGraph's ToolNode strips hidden arguments a wrapper adds (an anti-forgery
measure), so the lease cannot travel as an argument. A ``ContextVar`` reaches
the tool on both paths: the sync ToolNode copies the context into its worker
threads, and asyncio tasks inherit it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from toolguard.errors import ToolGuardError
from toolguard.intent import Intent
from toolguard.locks.lease import Lease

__all__ = ["CallContext", "current", "current_or_none"]


@dataclass(slots=True)
class CallContext:
    """The guard's view of the call in progress, handed to the tool.

    ``tx`` is the store's fenced transaction for fenced tools: run the reads
    that decide a write *and* the write through it (``tx.execute(...)``), so a
    holder paused past its TTL can never write on a stale read. For unfenced
    tools ``tx`` is None and ``idempotency_key`` must be passed to the external
    system, which is what makes a retry safe there.
    """

    intent: Intent
    tool: str
    args: Mapping[str, Any]  # validated, as JSON values; ``model`` holds the typed instance
    idempotency_key: str
    keys: tuple[str, ...]
    model: BaseModel | None = None
    lease: Lease | None = None
    tx: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> Mapping[str, int]:
        return self.lease.tokens if self.lease is not None else {}

    def check(self) -> None:
        """Raise ``LockLost`` if the lease is gone: call it before an unfenced side effect."""
        if self.lease is not None:
            self.lease.check()


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


@contextlib.contextmanager
def bind(ctx: CallContext) -> Iterator[CallContext]:
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
