"""The demo's decisions across calls: two tellers read one balance and write what they computed.

Each teller's scripted model reads the balance, waits until the other has
read it too (so both decisions rest on the same value), then writes the
balance it computed: teller_a + 25, teller_b + 30 on 100, so 155 is right.
Three runs on accounts of their own:

- guard off: plain code, no toolguard: one deposit is lost.
- per-call guard: every write serialized and fenced (the policy without
  ``reads:``): one deposit is still lost, because the decision rested on a read
  that changed before the write.
- reads declared (``decisions.yml``): the later write is refused
  ``stale_read``; its model reads again, decides again, and both land.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DECISIONS_POLICY_PATH", "DecisionsReport", "RunResult", "run_decisions"]

DECISIONS_POLICY_PATH = Path(__file__).with_name("decisions.yml")
START = 100
DEPOSITS = {"teller_a": 25, "teller_b": 30}
EXPECTED = START + sum(DEPOSITS.values())
#: ``decisions.yml`` without its reads: every write serialized and fenced, no read remembered.
PER_CALL: dict[str, Any] = {"version": 1, "agents": list(DEPOSITS), "tools": {
    "get_balance": {"read_only": True},
    "set_balance": {"locks": ["account:{account_id}"]},
}}
_TABLE = "CREATE TABLE IF NOT EXISTS demo_accounts (id TEXT PRIMARY KEY, balance BIGINT NOT NULL)"
_OPEN = "INSERT INTO demo_accounts (id, balance) VALUES (%s, %s) ON CONFLICT (id) DO NOTHING"
_READ = "SELECT balance FROM demo_accounts WHERE id = %s"
_WRITE = "UPDATE demo_accounts SET balance = %s WHERE id = %s"


@dataclass
class RunResult:
    """One run: the final balance, and the reasons each teller's calls got."""

    name: str
    balance: int
    reasons: dict[str, list[str]] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return self.balance == EXPECTED


@dataclass(frozen=True, slots=True)
class DecisionsReport:
    off: RunResult
    per_call: RunResult
    checked: RunResult

    def as_dict(self) -> dict[str, Any]:
        return {run.name: {"balance": run.balance, "expected": EXPECTED, "reasons": run.reasons}
                for run in (self.off, self.per_call, self.checked)}


def run_decisions(*, lock_url: str, store_url: str,
                  store_options: Mapping[str, Any] | None = None) -> DecisionsReport:
    """The three runs on the demo's store and locks (their rows join the demo's audit log)."""
    from toolguard.guard import ToolGuard
    from toolguard.locks import connect
    from toolguard.policies import Policy, load_policy
    from toolguard.store import open_store
    from toolguard.store.base import qmark

    store = open_store(store_url, **dict(store_options or {}))
    locks = connect(lock_url)
    sqlite = store_url.startswith("sqlite")

    def sql(query: str, params: tuple[Any, ...] = ()) -> Any:
        with store.connection() as conn:
            cursor = conn.execute(qmark(query) if sqlite else query, params)
            return cursor.fetchone() if cursor.description else None

    try:
        store.install()
        sql(_TABLE)
        per_call = ToolGuard(Policy.from_dict(PER_CALL), locks=locks, store=store)
        checked = ToolGuard(load_policy(DECISIONS_POLICY_PATH), locks=locks, store=store)
        run = uuid.uuid4().hex[:8]
        return DecisionsReport(
            off=_two_tellers("guard off", f"off-{run}", sql, None),
            per_call=_two_tellers("per-call guard", f"per-call-{run}", sql, per_call),
            checked=_two_tellers("reads declared", f"reads-{run}", sql, checked))
    finally:
        store.close()
        locks.close()


def _two_tellers(name: str, account: str, sql: Callable[..., Any], guard: Any) -> RunResult:
    sql(_OPEN, (account, START))
    both_read = threading.Barrier(2)
    result = RunResult(name, 0, {teller: [] for teller in DEPOSITS})

    def teller(agent: str) -> None:
        waited = False
        for _ in range(5):  # read, decide, write; told the read is stale: again
            balance = _call(guard, sql, agent, account, "get_balance", result)
            if not waited:
                waited = True
                both_read.wait(30)
            reason = _call(guard, sql, agent, account, "set_balance", result,
                           balance=int(balance) + DEPOSITS[agent])
            if reason not in ("stale_read", "unread"):
                return

    threads = [threading.Thread(target=teller, args=(agent,)) for agent in DEPOSITS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    result.balance = int(sql(_READ, (account,))[0])
    return result


def _call(guard: Any, sql: Callable[..., Any], agent: str, account: str, tool: str,
          result: RunResult, **extra: Any) -> Any:
    """One tool call as the teller's model makes it: through the guard, or plain."""
    from toolguard.call.context import CallContext
    from toolguard.call.intent import Intent, WorkflowIdentity

    def body(ctx: CallContext) -> Any:
        if tool == "get_balance":
            if not guard.policy.tracks_reads:  # read_only: on a connection of its own
                return int(sql(_READ, (account,))[0])
            return int(ctx.tx.execute(_READ, (account,)).fetchone()[0])
        ctx.tx.execute(_WRITE, (extra["balance"], account))
        return extra["balance"]

    if guard is None:  # no toolguard: the same reads and writes, unguarded
        if tool == "get_balance":
            value = int(sql(_READ, (account,))[0])
        else:
            sql(_WRITE, (extra["balance"], account))
            value = extra["balance"]
        result.reasons[agent].append("unguarded")
        return value
    intent = Intent(tool=tool, args={"account_id": account, **extra},
                    call_id=f"{account}-{agent}-{tool}-{len(result.reasons[agent])}",
                    agent=agent, workflow=WorkflowIdentity(thread_id=f"{account}-{agent}"))
    decision = guard.run(intent, body)
    result.reasons[agent].append(decision.reason)
    return decision.result if decision.ok else decision.reason
