"""An agent the test drives step by step, journaled like the workload's agents.

The workload's agents act at random; some scenarios need one particular order
of events (take a lock on the primary that is about to fail, write after the
new holder did). ``ScriptedAgent`` takes a lock and writes when the test says
so, and journals each deposit exactly as ``run_agent`` does, so the fault
suite's invariants (ledger exact, every rejection audited) cover it too.
"""

from __future__ import annotations

import contextlib
import random
import time
import uuid
from typing import Any

from fault.workload import AgentPlan, Journal, Setup, attempt, deposit_body, intent_for
from toolguard.errors import StaleFencingToken, ToolGuardError
from toolguard.locks import Lease, LockManager
from toolguard.store import GuardedStore

__all__ = ["ScriptedAgent"]


class ScriptedAgent:
    """One named agent with its own lock manager and store."""

    def __init__(self, name: str, setup: Setup, journal: Journal, *,
                 ttl_ms: int | None = None) -> None:
        self.name = name
        self.setup = setup
        self.journal = journal
        self.ttl_ms = ttl_ms or setup.ttl_ms
        self.locks: LockManager = setup.separate_locks()  # an agent process of its own
        self.store: GuardedStore = setup.open_store()
        self._count = 0

    def _op(self, account: str) -> dict[str, Any]:
        self._count += 1
        op = {"intent": f"{self.name}-{self._count}-{uuid.uuid4().hex[:8]}", "agent": self.name,
              "account": account, "delta": 1 + self._count % 9}
        return op

    def lock(self, account: str, *, timeout_s: float = 5.0) -> Lease:
        """Take the lock of ``account`` (renewed by the heartbeat like any lease)."""
        lease = self.locks.acquire([self.setup.key(account)], ttl_ms=self.ttl_ms,
                                   timeout_s=timeout_s)
        self.journal.add(event="locked", agent=self.name, account=account,
                         token=lease.tokens[self.setup.key(account)])
        return lease

    def write(self, lease: Lease, account: str) -> dict[str, Any]:
        """A new deposit on ``account`` through ``store.fenced`` with ``lease``'s tokens,
        whatever the lease's state: the store alone decides. Returns the outcome event."""
        op = self._op(account)
        began = time.monotonic()
        self.journal.add(event="try", **op)
        intent = intent_for(self.name, op, self.setup)
        body = deposit_body(self.setup, op, AgentPlan(), self.journal)
        key = self.setup.key(account)
        try:
            with self.store.fenced(lease.tokens, intent) as tx:
                tx.record(body(tx))
            result: dict[str, Any] = {"event": "accepted", "token": lease.tokens[key]}
        except StaleFencingToken as error:
            result = {"event": "rejected", "token": error.token, "current": error.current}
        except ToolGuardError as error:
            result = {"event": "unknown", "error": f"{type(error).__name__}: {error}"[:300]}
        self.journal.add(intent=op["intent"], agent=self.name, account=account, began=began,
                         **result)
        return result

    def deposit(self, account: str, *, wait_s: float = 10.0) -> dict[str, Any]:
        """A new deposit through ``run_fenced`` (lock, fenced write, re-seed if needed)."""
        op = self._op(account)
        began = time.monotonic()
        self.journal.add(event="try", **op)
        result = attempt(self.setup, AgentPlan(), self.store, self.locks, op, self.journal,
                         random.Random(0), wait_s=wait_s)
        self.journal.add(intent=op["intent"], agent=self.name, account=account, began=began,
                         **result)
        return result

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.locks.close()
        with contextlib.suppress(Exception):
            self.store.close()
