"""Two LangGraph agents deposit into one account in parallel: exact with toolguard, short without.

    >>> from examples.parallel_agents import run
    >>> run(guarded=True).balance, run(guarded=False).balance < 550
    (550, True)

Each agent is a ``create_agent`` worker whose (scripted, offline) model makes ten
``deposit`` calls, one after the other; both agents run at the same time on the
same account. ``deposit`` reads the balance, takes a moment (an API call, a slow
model: ``THINK_S``), then writes the new balance. Without toolguard both agents
read the same balance and one overwrites the other's deposit: the balance ends
below 550. With ``ToolGuardMiddleware`` every call locks ``account:A-1`` and
runs in the fenced transaction (``current().tx``): the balance is exactly 550,
every time. ``python -m examples.parallel_agents`` runs both and prints them.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from toolguard import ToolGuard, connect, current_or_none, load_policy, open_store
from toolguard.adapters import ToolGuardMiddleware

__all__ = ["AGENTS", "POLICY_PATH", "THINK_S", "Outcome", "run"]

POLICY_PATH = Path(__file__).resolve().parent / "policy.yml"
ACCOUNT = "A-1"
#: agent -> the amounts its model deposits, in order: 10 x 25 + 10 x 30 = 550.
AGENTS: dict[str, list[int]] = {"teller_a": [25] * 10, "teller_b": [30] * 10}
#: How long a deposit takes between reading the balance and writing it.
THINK_S = 0.02


@dataclass(frozen=True)
class Outcome:
    guarded: bool
    balance: int
    expected: int
    accepted: int  # audit rows "accepted" (guarded runs only)


class ScriptedModel(GenericFakeChatModel):
    """Stands in for a chat model (offline, deterministic): replies from a list."""

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedModel:
        return self


def _script(agent: str) -> Iterator[AIMessage]:
    for index, amount in enumerate(AGENTS[agent]):
        call = {"name": "deposit", "args": {"account_id": ACCOUNT, "amount": amount},
                "id": f"{agent}-{index}", "type": "tool_call"}
        yield AIMessage(content="", tool_calls=[call])
    yield AIMessage(content="done")


def run(guarded: bool, *, home: Path | None = None) -> Outcome:
    """Both agents at once on a fresh account; the final balance, and what was expected."""
    store_url = f"sqlite:///{(home or Path.cwd() / '.toolguard').absolute() / 'store.db'}"
    lock_url = store_url.replace("store.db", "locks.db")
    Path(store_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    store = open_store(store_url, install=True)
    locks = connect(lock_url)
    try:
        with store.connection() as conn:  # your own tables live in the store's database
            conn.execute("CREATE TABLE IF NOT EXISTS accounts (id TEXT PRIMARY KEY, balance INTEGER)")
            conn.execute("INSERT INTO accounts (id, balance) VALUES (?, 0) "
                         "ON CONFLICT (id) DO UPDATE SET balance = 0", (ACCOUNT,))
        guard = ToolGuard(load_policy(POLICY_PATH), locks=locks, store=store) if guarded else None
        deposit = _deposit_tool(store)
        before = _audit_high(store)
        run_id = uuid.uuid4().hex[:8]  # a new conversation each run: new thread ids
        workers = [threading.Thread(target=_agent, args=(agent, deposit, guard, run_id))
                   for agent in AGENTS]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        with store.connection() as conn:
            (balance,) = conn.execute("SELECT balance FROM accounts WHERE id = ?", (ACCOUNT,)).fetchone()
        accepted = sum(1 for e in store.query_audit(after_id=before, limit=None)
                       if e.decision == "accepted") if guarded else 0
        return Outcome(guarded, int(balance), sum(sum(a) for a in AGENTS.values()), accepted)
    finally:
        locks.close()
        store.close()


def _agent(agent: str, deposit: Any, guard: ToolGuard | None, run_id: str) -> None:
    middleware = [ToolGuardMiddleware(guard, agent=agent)] if guard is not None else []
    worker = create_agent(ScriptedModel(messages=_script(agent)), [deposit], middleware=middleware,
                          checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"{run_id}-{agent}"}, "recursion_limit": 100}
    worker.invoke({"messages": [("user", f"deposit your amounts into {ACCOUNT}")]}, config)


def _deposit_tool(store: Any) -> Any:
    @tool
    def deposit(account_id: str, amount: int) -> str:
        """Add ``amount`` to the account's balance."""
        with _transaction(store) as execute:
            (balance,) = execute("SELECT balance FROM accounts WHERE id = %s", (account_id,)).fetchone()
            time.sleep(THINK_S)  # the other agent works meanwhile
            execute("UPDATE accounts SET balance = %s WHERE id = %s", (balance + amount, account_id))
        return f"{account_id}: {balance} + {amount} = {balance + amount}"

    return deposit


@contextmanager
def _transaction(store: Any) -> Iterator[Any]:
    """Guarded: the fenced transaction the guard opened (``current().tx``), committed by the
    guard with the fence, the intent record and the audit row. Unguarded: what tool code
    usually does, each statement on its own on the raw connection."""
    ctx = current_or_none()
    if ctx is not None and ctx.fenced:
        yield ctx.tx.execute  # %s placeholders on every store
        return
    with store.connection() as conn:  # the raw SQLite connection: ? placeholders, autocommit
        yield lambda sql, params=(): conn.execute(sql.replace("%s", "?"), params)


def _audit_high(store: Any) -> int:
    newest = store.query_audit(limit=1)
    return int(newest[0].id) if newest and newest[0].id is not None else 0
