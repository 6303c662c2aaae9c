"""What a guarded tool sends along when it calls a fenced service: built from ``current()``.

Pure apart from reading the call's context: the HTTP client and the MCP session
share it. A call made after the lease was lost raises ``LockLost`` here, before
any byte leaves the process.

Idempotency keys. One guarded call may send several state-changing requests;
each needs a key of its own, and a retry of the call must send the same keys
again. The n-th one (in the order the tool sends them) carries
``<the call's idempotency key>#<n>``: split at the last ``#``, that names the
call and the request, so two different (call, n) pairs never share a key. Safe
methods (GET, HEAD, OPTIONS) carry the fences but no key: the service fences
them (a fenced read advances the fence, so an older holder's later write is
refused) and records nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolguard.call.context import current
from toolguard.errors import ToolGuardError
from toolguard.fences.wire import Fences

if TYPE_CHECKING:
    from toolguard.fences.claims import FenceSigner

__all__ = ["outgoing_fences"]

_SEQUENCE = "toolguard.fences.sequence"
_MAX_AUDIT_TEXT = 256


def outgoing_fences(*, idempotent: bool, signer: FenceSigner | None = None) -> Fences:
    """The fences of the guarded call running here; ``idempotent=True`` numbers a new key.

    With ``signer`` they carry claims signed from the call's lease (signed mode).
    Raises ``ToolGuardError`` (``no_context``) outside a guarded call, ``LockLost``
    if the lease is gone, and ``ToolGuardError`` (``no_fences``) for a call that
    holds no lock (a read-only tool has nothing to fence with).
    """
    ctx = current()
    ctx.check()
    if not ctx.tokens:
        msg = (f"{ctx.tool} holds no lock, so it has no fencing tokens to send: give it lock "
               f"keys in the policy (read-only tools cannot call fenced services)")
        raise ToolGuardError(msg, reason="no_fences")
    key = None
    if idempotent:
        number = int(ctx.extra.get(_SEQUENCE, 0)) + 1
        ctx.extra[_SEQUENCE] = number
        key = f"{ctx.idempotency_key}#{number}"
    fences = Fences(tokens=dict(ctx.tokens), idempotency_key=key,
                    agent=_audit_text(ctx.intent.agent),
                    intent_id=_audit_text(ctx.intent.call_id or ctx.intent.id))
    if signer is None or ctx.lease is None:
        return fences
    return signer.sign(fences, ctx.lease)


def _audit_text(value: str | None) -> str | None:
    """Audit-only text as every store can keep it: no control characters or lone surrogates."""
    if not value:
        return None
    text = "".join("\ufffd" if c < " " or c == "\x7f" or "\ud800" <= c <= "\udfff" else c
                   for c in value[:_MAX_AUDIT_TEXT])
    return text
