"""Recovering a poisoned key: an operator sets a service's fence for one key back to a value.

In unsigned mode (or before a service moved to signed mode) one request with a
huge ``Fencing-Token`` leaves a key's fence above every token the lock server
will grant for years: every genuine holder is refused ``stale_fencing_token``.
``reset_fence`` undoes it, in the service's own store, safely:

1. it takes the key's lock on the agents' lock server itself, without waiting:
   if someone holds it, a lease on the key is live and the reset is refused
   (``fence_reset_refused``), since moving the fence under a holder could let
   an older holder's write through;
2. holding the lock, it sets the fence to the value given and writes one audit
   row naming who did it, from what to what (``operator`` / ``fence_reset``);
3. it releases the lock.

The value to give is one the lock server has already passed: the token of
the reset's own lease (printed by ``toolguard fence reset``) is such a value;
a greater one keeps refusing holders until the lock's tokens pass it.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolguard.errors import ConfigurationError, LockTimeout, ToolGuardError
from toolguard.locks.manager import LockManager
from toolguard.store.base import AuditEntry, GuardedStore, qmark

__all__ = ["FenceReset", "reset_fence"]

_MAX_TOKEN = 2**63 - 1
_SELECT = "SELECT token FROM toolguard_high_water WHERE key = %s"
_UPSERT = ("INSERT INTO toolguard_high_water (key, token) VALUES (%s, %s) ON CONFLICT (key) "
           "DO UPDATE SET token = excluded.token, updated_at = {now}")


@dataclass(frozen=True, slots=True)
class FenceReset:
    """What a reset did: the key, its fence before (0: none) and after, who, and the token of
    the lease the reset held (the lock server grants only greater ones from now on)."""

    key: str
    before: int
    after: int
    by: str
    lease_token: int


def reset_fence(store: GuardedStore, locks: LockManager, key: str, to: int, *,
                by: str) -> FenceReset:
    """Set ``store``'s fence on ``key`` to ``to`` while holding ``key``'s lock; audited.

    Raises ``ToolGuardError`` (``fence_reset_refused``) if a lease on ``key`` is live,
    ``ConfigurationError`` for a value outside 1..2^63-1.
    """
    if not isinstance(key, str) or not key:
        msg = f"name the lock key whose fence to reset, got {key!r}"
        raise ConfigurationError(msg)
    if not isinstance(to, int) or isinstance(to, bool) or not 0 < to <= _MAX_TOKEN:
        msg = f"--to is a token in 1..2^63-1, got {to!r}"
        raise ConfigurationError(msg)
    try:
        lease = locks.acquire(key, ttl_ms=30_000, timeout_s=0)
    except LockTimeout:
        detail = (f"fence reset of {key} to {to} by {by} refused: a lease on the key is live; "
                  f"wait for it to end (its TTL) or stop its holder, then reset again")
        store.audit(AuditEntry(decision="operator", reason="fence_reset_refused", keys=(key,),
                               args={"key": key, "to": to, "by": by}, detail=detail))
        raise ToolGuardError(detail, reason="fence_reset_refused") from None
    try:
        lease.check()
        now = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')" if store.dialect == "sqlite" else "now()"
        select, upsert = _SELECT, _UPSERT.format(now=now)
        if store.dialect == "sqlite":
            select, upsert = qmark(select), qmark(upsert)
        with store.connection() as conn, _transaction(conn, store.dialect):
            row = conn.execute(select + (" FOR UPDATE" if store.dialect != "sqlite" else ""),
                               (key,)).fetchone()
            before = int(row[0]) if row else 0
            conn.execute(upsert, (key, to))
        lease.check()
        detail = (f"fence of {key} set from {before or 'none'} to {to} by {by} (the lock's "
                  f"tokens are above {lease.token} from now on)")
        store.audit(AuditEntry(decision="operator", reason="fence_reset", keys=(key,),
                               tokens={key: to},
                               args={"key": key, "from": before, "to": to, "by": by,
                                     "lease_token": lease.token}, detail=detail))
        return FenceReset(key=key, before=before, after=to, by=by, lease_token=lease.token)
    finally:
        lease.release()


class _transaction:
    """``BEGIN`` ... ``COMMIT`` on a store connection (rolled back on an error)."""

    def __init__(self, conn: object, dialect: str) -> None:
        self.conn = conn
        self.begin = "BEGIN IMMEDIATE" if dialect == "sqlite" else "BEGIN"

    def __enter__(self) -> None:
        self.conn.execute(self.begin)  # type: ignore[attr-defined]

    def __exit__(self, kind: object, *_: object) -> None:
        self.conn.execute("ROLLBACK" if kind is not None else "COMMIT")  # type: ignore[attr-defined]
