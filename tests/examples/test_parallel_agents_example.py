"""The parallel-agents example: two create_agent workers on one account.

Unguarded, both read the same balance and one overwrites the other's deposit;
guarded, every deposit runs under the account's lock in the fenced transaction
and the balance is exact. No timing assertion: the example's deposits overlap
because each takes ``THINK_S`` between its read and its write, and with both
agents running that makes at least one overwrite (the assertion is ``<``).
"""

from __future__ import annotations

from pathlib import Path

from examples.parallel_agents import AGENTS, POLICY_PATH, run
from toolguard.policies import load_policy


def test_guarded_balance_is_exact(tmp_path: Path) -> None:
    outcome = run(guarded=True, home=tmp_path)
    assert outcome.expected == 550
    assert outcome.balance == 550
    assert outcome.accepted == sum(len(amounts) for amounts in AGENTS.values())  # one row each


def test_unguarded_balance_loses_deposits(tmp_path: Path) -> None:
    outcome = run(guarded=False, home=tmp_path)
    assert outcome.balance < outcome.expected


def test_running_it_again_starts_over(tmp_path: Path) -> None:
    """A new run is a new conversation (new thread ids): deposits apply again, not replay."""
    assert run(guarded=True, home=tmp_path).balance == 550
    assert run(guarded=True, home=tmp_path).balance == 550


def test_policy_matches_the_tool() -> None:
    from examples.parallel_agents import _deposit_tool

    load_policy(POLICY_PATH).check_against({"deposit": _deposit_tool(None)}, missing_ok=False)
