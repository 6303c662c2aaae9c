"""Spawned processes for the controls tests: each opens its own store."""

from __future__ import annotations

from typing import Any

from store.envs import StoreEnv

from toolguard.controls.pause import PauseBoard


def pause_from_elsewhere(env: StoreEnv, kind: str, name: str, out: Any) -> None:
    store = env.open()
    try:
        PauseBoard(store).pause(kind, name, by="other-process", reason="from another process")
        out.put("paused")
    finally:
        store.close()


def guarded_calls(backend: Any, policy: dict[str, Any], quota_url: str | None, prefix: str,
                  calls: int, worker: int, start: Any, out: Any) -> None:
    """``calls`` guarded calls through a real ToolGuard in this process; their reasons."""
    from controls.guarded import intent, write
    from toolguard.controls.quotas import quota_backend
    from toolguard.guard import ToolGuard
    from toolguard.policies import Policy

    store = backend.store()
    locks = backend.locks()
    quotas = quota_backend(quota_url, prefix=prefix) if quota_url else None
    try:
        guard = ToolGuard(Policy.from_dict(policy), locks=locks, store=store, quotas=quotas)
        start.wait(30)
        reasons = [guard.run(intent("transfer", {"lead_id": f"w{worker}-{n % 3}", "amount": 1},
                                    call_id=f"p{worker}-{n}"), write).reason
                   for n in range(calls)]
        out.put(("ok", reasons))
    except BaseException as error:  # the test reads it
        out.put(("error", repr(error)))
    finally:
        if quotas is not None:
            quotas.close()
        locks.close()
        store.close()
