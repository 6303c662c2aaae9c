"""What belongs in each backend slot of a ``ToolGuard``, checked when the guard is built.

A sync lock manager or store in an asyncio slot (or the reverse) used to be
accepted: every call then failed inside the flow (``'<' not supported between
instances of 'coroutine' and 'int'``, never-awaited coroutines, calls audited
as ``invalid_fencing_token``), and the model was told its tool failed. It is a
wiring mistake, so it raises ``GuardMisconfigured`` at construction (and when a
slot is assigned later), naming the slot and what belongs there. Pure: no I/O.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal

from toolguard.errors import GuardMisconfigured
from toolguard.locks import AsyncLockManager, LockManager

__all__ = ["SLOTS", "check_slot"]


@dataclass(frozen=True, slots=True)
class Slot:
    """One backend slot: which face it takes, what to pass, the method that tells the faces."""

    name: str
    face: Literal["sync", "asyncio"]
    belongs: str
    method: str
    twin: str
    urls: bool = False  # a URL string is accepted (quotas)


SLOTS: dict[str, Slot] = {slot.name: slot for slot in (
    Slot("locks", "sync", "a LockManager (toolguard.locks.connect(...))", "acquire",
         "async_locks"),
    Slot("async_locks", "asyncio", "an AsyncLockManager (toolguard.locks.connect_async(...))",
         "acquire", "locks"),
    Slot("store", "sync", "a sync GuardedStore (toolguard.store.open_store(...))", "audit",
         "async_store"),
    Slot("async_store", "asyncio",
         "an AsyncGuardedStore (toolguard.store.open_async_store(...))", "audit", "store"),
    Slot("quotas", "sync", "a sync quota backend (toolguard.controls.quotas.quota_backend(...)) or a "
         "Redis URL", "admit", "async_quotas", urls=True),
    Slot("async_quotas", "asyncio", "an asyncio quota backend "
         "(toolguard.controls.quotas.async_quota_backend(...)) or a Redis URL", "admit", "quotas",
         urls=True),
    Slot("approvals", "sync", "an ApprovalBook on a sync store", "check", "async_approvals"),
    Slot("async_approvals", "asyncio", "an AsyncApprovalBook on an asyncio store", "check",
         "approvals"),
)}


def _face(value: object, slot: Slot) -> Literal["sync", "asyncio"] | None:
    """Which face ``value`` has: by class for lock managers (whose asyncio ``acquire`` is a
    plain method returning an awaitable), else by whether ``slot.method`` is a coroutine
    function. None: it has no such method at all."""
    if isinstance(value, AsyncLockManager):
        return "asyncio"
    if isinstance(value, LockManager):
        return "sync"
    method = getattr(value, slot.method, None)
    if not callable(method):
        return None
    return "asyncio" if inspect.iscoroutinefunction(method) else "sync"


def check_slot(name: str, value: object) -> None:
    """Raise ``GuardMisconfigured`` unless ``value`` (not None) belongs in slot ``name``."""
    if value is None:
        return
    slot = SLOTS[name]
    if slot.urls and isinstance(value, str):
        return
    face = _face(value, slot)
    kind = type(value).__name__
    if face == slot.face:  # a wrapper of a manager (with its ``acquire``) is taken as given
        return
    if face is not None and face != slot.face:
        article = "an asyncio" if face == "asyncio" else "a sync"
        msg = (f"ToolGuard {name}= got {kind}, which is {article} object: it belongs in "
               f"{slot.twin}=; {name}= takes {slot.belongs}")
    else:
        msg = f"ToolGuard {name}= got {kind}; it takes {slot.belongs}"
    raise GuardMisconfigured(msg)
