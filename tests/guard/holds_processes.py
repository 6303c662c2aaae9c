"""A worker process for the cross-process deadlock test: one agent, its own guard.

Spawned (not forked), so each process has its own lock manager, heartbeat and
guard; the two meet only in the lock server and the store, where the wait-for
graph of holds is.
"""

from __future__ import annotations

from typing import Any

from guard.harness import Backend, Harness
from guard.reads_world import Agent
from toolguard.guard import ToolGuard
from toolguard.policies import Policy


def _opened(backend: Backend, policy: dict[str, Any]) -> Harness:
    """A harness on tables the test made already (``Harness`` itself creates them)."""
    h = Harness.__new__(Harness)
    h.backend, h.policy = backend, Policy.from_dict(policy)
    h.store, h.locks = backend.store(), backend.locks()
    h.guard = ToolGuard(h.policy, locks=h.locks, store=h.store)
    return h


def transfers(backend: Backend, policy: dict[str, Any], name: str, first: str, second: str,
              rounds: int, barrier: Any, out: Any) -> None:
    """``rounds`` times: hold ``first``, wait for the other process to hold its own first key,
    read ``second`` (held), write both +1; told ``hold_deadlock``, start the round over."""
    h = _opened(backend, policy)
    reasons: list[str] = []
    try:
        for round_ in range(rounds):
            agent = Agent(h, name, f"{name}-{round_}")
            barrier.wait(60)
            both_hold: Any = barrier
            for _ in range(10):
                a = agent.call("get_balance", account_id=first)
                if both_hold is not None:
                    both_hold.wait(60)
                    both_hold = None
                b = agent.call("get_balance", account_id=second)
                if a.ok and b.ok:
                    for key, seen in ((first, a), (second, b)):
                        done = agent.call("set_balance", account_id=key,
                                          balance=int(seen.result) + 1)
                        reasons.append(done.reason)
                    break
                reasons.append(b.reason if a.ok else a.reason)
            else:
                reasons.append("never finished")
        out.put((name, reasons))
    except BaseException as error:
        out.put((name, [f"crashed: {error!r}"]))
        raise
    finally:
        h.close()


def hold_and_die(backend: Backend, policy: dict[str, Any], ready: Any) -> None:
    """Take a hold, say so, and die without releasing anything (a crashed agent process)."""
    import os

    h = _opened(backend, policy)
    agent = Agent(h, "doomed", "t-d")
    agent.read("acct")
    ready.set()
    os._exit(0)
