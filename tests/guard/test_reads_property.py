"""Generated histories of agents that read, decide and write, on both setups.

N agents x M read-decide-write rounds on K accounts, interleaved in a generated
order: each step moves one agent on by one call. A depositor reads an account
and writes the balance it computed (read + delta); a withdrawer reads two
accounts and takes from one only while their sum stays at or above a floor
(the rule: accounts 0 and 1 together hold at least ``FLOOR``). With reads declared, a refused write makes its
agent read again and decide again. The properties: no update is lost, the
rule is never broken, every call leaves exactly one audit row. The controls:
the same histories with the per-call guard alone lose updates and break the
rule, and hypothesis finds such a history.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from guard.harness import Harness
from guard.reads_world import CHECKED, UNCHECKED, Agent, Bank

FLOOR = 100
_examples = itertools.count(1)


@dataclass(frozen=True)
class Round:
    kind: str  # "deposit" | "withdraw"
    account: int
    other: int
    amount: int


@dataclass(frozen=True)
class History:
    accounts: int
    rounds: tuple[tuple[Round, ...], ...]  # per agent
    schedule: tuple[int, ...]  # which agent moves next


@st.composite
def histories(draw: st.DrawFn) -> History:
    accounts = draw(st.integers(1, 3))
    agents = draw(st.integers(2, 3))
    kinds = ["deposit", "withdraw"] if accounts > 1 else ["deposit"]

    @st.composite
    def one(draw_round: st.DrawFn) -> Round:
        kind = draw_round(st.sampled_from(kinds))
        if kind == "withdraw":  # the rule is on accounts 0 and 1: take from one, decide on both
            mine = draw_round(st.integers(0, 1))
            return Round(kind, mine, 1 - mine, draw_round(st.integers(1, 40)))
        return Round(kind, draw_round(st.integers(0, accounts - 1)), 0,
                     draw_round(st.integers(1, 40)))

    rounds = tuple(tuple(draw(st.lists(one(), min_size=1, max_size=3))) for _ in range(agents))
    schedule = tuple(draw(st.lists(st.integers(0, agents - 1), min_size=2, max_size=40)))
    return History(accounts, rounds, schedule)


@dataclass
class Worker:
    """One agent's state machine: read (once or twice), then decide and write."""

    agent: Agent
    rounds: tuple[Round, ...]
    names: list[str]
    at: int = 0
    reads_left: list[int] = field(default_factory=list)
    applied: list[Round] = field(default_factory=list)
    gave_up: int = 0

    @property
    def done(self) -> bool:
        return self.at >= len(self.rounds)

    def step(self) -> None:
        """One call: the next read this round needs, else its write."""
        if self.done:
            return
        now = self.rounds[self.at]
        mine, other = self.names[now.account], self.names[now.other]
        needed = [mine] if now.kind == "deposit" else [mine, other]
        if not self.reads_left and not all(n in self.agent.seen for n in needed):
            self.reads_left = list(range(len(needed)))
        if self.reads_left:
            self.agent.read(needed[self.reads_left.pop(0)])
            return
        if now.kind == "deposit":
            decision = self.agent.call("set_balance", account_id=mine,
                                       balance=self.agent.seen[mine] + now.amount)
        else:
            if sum(self.agent.seen[n] for n in needed) - now.amount < FLOOR:
                self.gave_up += 1  # the model's own check says no: the round ends
                self._next()
                return
            args: dict[str, Any] = {"account_id": mine, "other_id": other, "amount": now.amount}
            decision = self.agent.call("withdraw", **args)
        if decision.reason in ("stale_read", "unread"):
            for name in needed:  # read again, decide again
                self.agent.seen.pop(name, None)
            return
        assert decision.ok, decision
        self.applied.append(now)
        self._next()

    def _next(self) -> None:
        self.at += 1
        self.agent.seen.clear()
        self.reads_left = []


def play(h: Harness, history: History) -> tuple[dict[str, int], dict[str, int], list[Worker]]:
    """Run ``history`` on fresh accounts; (expected balances, final balances, workers)."""
    n = next(_examples)
    names = [f"h{n}-acct{i}" for i in range(history.accounts)]
    initial = dict.fromkeys(names, 60)
    Bank(h).open(initial)
    workers = [Worker(Agent(h, f"agent{i}", f"h{n}-thread{i}"), rounds, names)
               for i, rounds in enumerate(history.rounds)]
    for index in history.schedule:
        workers[index].step()
    for worker in workers:  # the rest of each agent's work, one after the other
        for _ in range(50):
            if worker.done:
                break
            worker.step()
        assert worker.done
    expected = dict(initial)
    for worker in workers:
        for done in worker.applied:
            name = names[done.account]
            expected[name] += done.amount if done.kind == "deposit" else -done.amount
    return expected, Bank(h).balances(*names), workers


def _broken(history: History, expected: dict[str, int], final: dict[str, int]) -> bool:
    """A lost update (the balances are not the applied deltas' sum) or a broken rule."""
    names = sorted(final)  # h<n>-acct0, h<n>-acct1, ...
    rule = history.accounts >= 2 and final[names[0]] + final[names[1]] < FLOOR
    return expected != final or rule


@pytest.fixture
def checked(harness: Any) -> Harness:
    return harness(CHECKED)


@pytest.fixture
def unchecked(harness: Any) -> Harness:
    return harness(UNCHECKED)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(history=histories())
def test_with_reads_declared_no_update_is_lost_and_no_rule_broken(checked: Harness,
                                                                  history: History) -> None:
    expected, final, workers = play(checked, history)
    assert final == expected, "an update was lost"
    assert not _broken(history, expected, final), "a rule over two accounts was broken"
    for worker in workers:
        for decision in worker.agent.decisions:
            assert len(checked.decisions(decision.intent.call_id or "")) == 1


def test_control_the_per_call_guard_loses_updates_or_breaks_the_rule(unchecked: Harness) -> None:
    def anomaly(history: History) -> bool:
        expected, final, _ = play(unchecked, history)
        return _broken(history, expected, final)

    found = find(histories(), anomaly, settings=settings(max_examples=200, deadline=None,
                                                          database=None))
    assert found.schedule  # a concrete interleaving that loses an update or breaks the rule
