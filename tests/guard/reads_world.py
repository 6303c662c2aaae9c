"""Accounts, the tools that read and write them, and agents that decide from what they read.

Shared by the stale-read tests: ``get_balance`` reads an account inside the
guard's read transaction, ``set_balance`` writes the value a model computed
from its earlier read (a blind write unless the policy checks reads),
``withdraw`` takes an amount from one account under a rule on two. Balances
live in the harness's ``lead`` table (``id``, ``score``).

``Agent`` is one caller (agent + conversation) whose "model" decides from what
its tools returned: read, compute, write; told ``stale_read``/``unread``, it
reads again and decides again.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from guard.harness import Harness
from toolguard.call.context import CallContext
from toolguard.call.decision import Decision
from toolguard.call.intent import Intent, WorkflowIdentity

__all__ = ["CHECKED", "UNCHECKED", "Agent", "Bank", "decide_to_deposit"]

#: Reads declared: a write is checked against its caller's reads.
CHECKED: dict[str, Any] = {
    "version": 1,
    "tools": {
        "get_balance": {"reads": ["account:{account_id}"]},
        "set_balance": {"locks": ["account:{account_id}"], "requires_read": True},
        "withdraw": {"locks": ["account:{account_id}"], "decides_on": ["account:{other_id}"]},
    },
}
#: The per-call guard alone: every write serialized and fenced, no reads remembered.
UNCHECKED: dict[str, Any] = {
    "version": 1,
    "tools": {
        "get_balance": {"read_only": True},
        "set_balance": {"locks": ["account:{account_id}"]},
        "withdraw": {"locks": ["account:{account_id}"]},
    },
}

READ = "SELECT score FROM lead WHERE id = %s"
UPSERT = ("INSERT INTO lead (id, score) VALUES (%s, %s) "
          "ON CONFLICT (id) DO UPDATE SET score = excluded.score")

_ids = itertools.count(1)


class Bank:
    """The account tools over one harness, as ``execute(ctx)`` bodies (sync and async)."""

    def __init__(self, harness: Harness) -> None:
        self.h = harness

    def open(self, balances: Mapping[str, int]) -> None:
        for account, balance in balances.items():
            self.h.sql(UPSERT, (account, balance))

    def balances(self, *accounts: str) -> dict[str, int]:
        found = self.h.scores()
        return {a: found.get(a, 0) for a in accounts}

    @staticmethod
    def read_in(account: str) -> int:
        """Read ``account`` in the current call's transaction (a tool body's own code)."""
        from toolguard.call.context import current

        row = current().tx.execute(READ, (account,)).fetchone()
        return int(row[0]) if row else 0

    @staticmethod
    def write_in(account: str, balance: int) -> None:
        from toolguard.call.context import current

        current().tx.execute(UPSERT, (account, balance))

    def body(self, tool: str) -> Any:
        def run(ctx: CallContext) -> Any:
            account = ctx.args["account_id"]
            if tool == "get_balance" and ctx.keys == () and not self.h.policy.tracks_reads:
                return self.balances(account)[account]  # read_only: no transaction of its own
            tx = ctx.tx
            if tool == "get_balance":
                row = tx.execute(READ, (account,)).fetchone()
                return int(row[0]) if row else 0
            if tool == "set_balance":
                tx.execute(UPSERT, (account, ctx.args["balance"]))
                return ctx.args["balance"]
            row = tx.execute(READ, (account,)).fetchone()  # withdraw
            left = (int(row[0]) if row else 0) - int(ctx.args["amount"])
            tx.execute(UPSERT, (account, left))
            return left

        return run

    def abody(self, tool: str) -> Any:
        async def run(ctx: CallContext) -> Any:
            account = ctx.args["account_id"]
            if tool == "get_balance" and ctx.keys == () and not self.h.policy.tracks_reads:
                return self.balances(account)[account]
            tx = ctx.atx
            if tool == "get_balance":
                row = await (await tx.execute(READ, (account,))).fetchone()
                return int(row[0]) if row else 0
            if tool == "set_balance":
                await tx.execute(UPSERT, (account, ctx.args["balance"]))
                return ctx.args["balance"]
            row = await (await tx.execute(READ, (account,))).fetchone()
            left = (int(row[0]) if row else 0) - int(ctx.args["amount"])
            await tx.execute(UPSERT, (account, left))
            return left

        return run


@dataclass
class Agent:
    """One caller: an agent in one conversation, calling the guard as a model would."""

    h: Harness
    name: str
    thread: str
    seen: dict[str, int] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)

    def intent(self, tool: str, call_id: str | None = None, **args: Any) -> Intent:
        return Intent(tool=tool, args=args, call_id=call_id or f"call-{next(_ids)}",
                      agent=self.name, workflow=WorkflowIdentity(thread_id=self.thread))

    def call(self, tool: str, call_id: str | None = None, **args: Any) -> Decision:
        decision = self.h.guard.run(self.intent(tool, call_id, **args), Bank(self.h).body(tool))
        self.decisions.append(decision)
        if tool == "get_balance" and decision.ok:
            self.seen[args["account_id"]] = int(decision.result)
        return decision

    async def acall(self, tool: str, call_id: str | None = None, **args: Any) -> Decision:
        decision = await self.h.guard.arun(self.intent(tool, call_id, **args),
                                             Bank(self.h).abody(tool))
        self.decisions.append(decision)
        if tool == "get_balance" and decision.ok:
            self.seen[args["account_id"]] = int(decision.result)
        return decision

    def read(self, account: str) -> int:
        decision = self.call("get_balance", account_id=account)
        assert decision.ok, decision
        return self.seen[account]


def decide_to_deposit(agent: Agent, account: str, amount: int, *, tries: int = 5) -> Decision:
    """Read, compute, write; on a stale or missing read, read again and decide again."""
    decision = None
    for _ in range(tries):
        balance = agent.read(account)
        decision = agent.call("set_balance", account_id=account, balance=balance + amount)
        if decision.reason not in ("stale_read", "unread"):
            return decision
    assert decision is not None
    return decision
