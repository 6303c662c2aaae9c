"""The fence checks: lock server counters vs the store's high-water marks, and fence claims.

Whether the next token the lock server grants is above the store's mark for
recent keys (``--reseed`` raises the lagging ones), and whether the
``TOOLGUARD_FENCE_*`` signing and verifying keys can be read. Separate: these
are about the tokens themselves, not about one backend's configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from toolguard.cli.checks.probes import _LockProbe
from toolguard.cli.checks.report import Check
from toolguard.errors import BackendUnavailable, ConfigurationError, ToolGuardError

_FENCE_WHY = ("the store refuses every token below its high-water mark for a key: a lock server "
              "whose counter is behind (restarted empty with a clock behind, restored from an old "
              "backup) grants tokens that can never write, until re-seeded")


def _fences(probe: _LockProbe | None, store: Any, installed: int, lock_url: str, sample: int,
            reseed: bool, redis_prefix: str) -> Check:
    title = "Fences vs lock server counters"
    if probe is None or store is None:
        return Check("fences", title, "skip", "a backend did not answer", _FENCE_WHY)
    if not probe.hybrid:
        return Check("fences", title, "pass", f"{probe.kind} tokens are revisions of its Raft log: "
                     "they only grow and survive restarts", _FENCE_WHY)
    if installed == 0:
        return Check("fences", title, "skip", "the store's schema is not installed", _FENCE_WHY)
    marks = _recent_marks(store, sample)
    if not marks:
        return Check("fences", title, "pass", "no fenced key in the store yet", _FENCE_WHY)
    now_us = probe.server_time_us() or 0
    behind: dict[str, tuple[int, int]] = {}
    counters = 0
    for key, mark in marks:
        counter = probe.current_token(key) or 0
        counters += counter > 0
        next_token = max(counter + 1, now_us)
        if next_token <= mark:
            behind[key] = (mark, next_token)
    data: dict[str, Any] = {"keys_checked": len(marks), "counters_present": counters,
                            "behind": {k: {"store": m, "next": n} for k, (m, n) in behind.items()}}
    scope = (f"{len(marks)} fenced key{'s' if len(marks) != 1 else ''}"
             f"{' (the most recently written)' if len(marks) >= sample else ''}")
    if not behind:
        return Check("fences", title, "pass",
                     f"{scope}: every next token is above the store's high-water mark "
                     f"({counters} with a live counter, the rest covered by the server clock)",
                     _FENCE_WHY, data=data)
    shown = ", ".join(f"{k} (store {m}, next {n})" for k, (m, n) in list(behind.items())[:3])
    more = f" and {len(behind) - 3} more" if len(behind) > 3 else ""
    if reseed:
        try:
            from toolguard.locks import connect
            from toolguard.store.recovery import reseed as do_reseed

            options = {"prefix": redis_prefix} if probe.kind == "redis" else {}
            locks = connect(lock_url, **options)
            try:
                floors = do_reseed(locks, store, list(behind))
            finally:
                locks.close()
        except ToolGuardError as error:
            return Check("fences", title, "fail", f"{scope}: {len(behind)} behind ({shown}{more}); "
                         f"re-seeding failed: {error}", _FENCE_WHY, data=data,
                         unreachable=isinstance(error, BackendUnavailable))
        return Check("fences", title, "pass",
                     f"{scope}: {len(behind)} were behind ({shown}{more}); re-seeded "
                     f"{len(floors)} from the store", _FENCE_WHY, data={**data, "reseeded": floors})
    return Check("fences", title, "fail",
                 f"{scope}: {len(behind)} behind the store ({shown}{more}); their next grants "
                 f"would be refused", _FENCE_WHY, data=data,
                 fix="toolguard doctor --reseed (runs toolguard.store.recovery.reseed for them)")


def _recent_marks(store: Any, sample: int) -> list[tuple[str, int]]:
    sql = "SELECT key, token FROM toolguard_high_water ORDER BY updated_at DESC LIMIT %s"
    with store.connection() as conn:
        if store.dialect == "sqlite":
            rows = conn.execute(sql.replace("%s", "?"), (sample,)).fetchall()
        else:
            rows = conn.execute(sql, (sample,)).fetchall()
    return [(str(key), int(token)) for key, token in rows]


_UNSIGNED = ("unsigned mode: a fenced service built without claims=ClaimVerifier(...) takes "
             "every Fencing-Token, agent and Idempotency-Key its network sends: one request with "
             "a huge token refuses every genuine holder of that key until `toolguard fence "
             "reset`, and any caller can write under any key or pass for any agent")


def _fence_claims(environ: Mapping[str, str]) -> Check:
    """Signed or unsigned fences: the keys configured here, or what their absence allows."""
    from toolguard.fences.keys import (
        SIGNING_KEY_ENV,
        SIGNING_KEY_FILE_ENV,
        VERIFY_KEYS_ENV,
        VERIFY_KEYS_FILE_ENV,
        load_keyring,
        load_signing_key,
    )

    title, why = ("Fence claims (signed mode)",
                  "a service trusts a fencing token only when a guard's key signed it for that "
                  "service; without keys it trusts its whole network")
    found = []
    try:
        if environ.get(SIGNING_KEY_ENV) or environ.get(SIGNING_KEY_FILE_ENV):
            key = load_signing_key(environ=environ)
            found.append(f"signs as {key.key_id!r} ({key.algorithm})")
        if environ.get(VERIFY_KEYS_ENV) or environ.get(VERIFY_KEYS_FILE_ENV):
            ring = load_keyring(environ=environ)
            found.append(f"verifies key ids {', '.join(sorted(ring))}")
    except ConfigurationError as error:
        return Check("fence_claims", title, "fail", str(error), why,
                     fix="fix the key file or variable, or make a key with `toolguard keys new`")
    if not found:
        return Check("fence_claims", title, "skip",
                     f"no TOOLGUARD_FENCE_* keys in this environment; {_UNSIGNED}", why,
                     fix="on an untrusted network: `toolguard keys new`, FenceSigner on the "
                         "clients, ClaimVerifier on the services (docs/fences.md)",
                     data={"mode": "unsigned"})
    return Check("fence_claims", title, "pass", "; ".join(found), why, data={"mode": "signed"})

