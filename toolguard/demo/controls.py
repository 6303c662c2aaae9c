"""The demo's epilogue: one call waits for a person's approval, one is refused by a budget.

The router grants a 25 % discount on L-101: the policy (``controls.yml``) asks
a sales manager first, so the call is refused ``approval_required`` with the
request's id; a scripted manager approves it (as ``toolguard approve ID``
would) and the router's same call then runs. A further 10 % on L-102 would
take the router past its 30 points a day: refused ``budget_exceeded``, with
when to retry. Running the demo again replays the approved call and refuses
the second one again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolguard.call.decision import Decision

__all__ = ["CONTROLS_POLICY_PATH", "MANAGER", "ControlsReport", "run_controls"]

CONTROLS_POLICY_PATH = Path(__file__).with_name("controls.yml")
#: Who approves in the demo (a script standing in for a person).
MANAGER = "sales-manager (scripted)"
_THREAD = "demo-controls"


@dataclass(frozen=True, slots=True)
class ControlsReport:
    """What the epilogue's three calls got: the request, the approved run, the budget refusal."""

    asked: Decision
    approved: Decision
    over_budget: Decision
    approval_id: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"approval_id": self.approval_id,
                "decisions": [[d.kind, d.reason] for d in (self.asked, self.approved,
                                                           self.over_budget)],
                "retry_after_s": self.over_budget.retry_after_s}


def run_controls(*, lock_url: str, store_url: str,
                 store_options: Mapping[str, Any] | None = None) -> ControlsReport:
    """Run the epilogue on the demo's store and locks (its rows join the demo's audit log)."""
    from toolguard.call.intent import Intent, WorkflowIdentity
    from toolguard.controls.approvals import ApprovalBook
    from toolguard.guard import ToolGuard
    from toolguard.locks import connect
    from toolguard.policies import load_policy
    from toolguard.store import open_store

    store = open_store(store_url, **dict(store_options or {}))
    locks = connect(lock_url)
    try:
        store.install()
        guard = ToolGuard(load_policy(CONTROLS_POLICY_PATH), locks=locks, store=store)

        def grant(call_id: str, lead_id: str, percent: int) -> Decision:
            intent = Intent(tool="grant_discount", args={"lead_id": lead_id, "percent": percent},
                            agent="router", call_id=call_id,
                            workflow=WorkflowIdentity(thread_id=_THREAD))
            return guard.run(intent, lambda ctx: f"{percent}% off {lead_id}")

        asked = grant("discount-1", "L-101", 25)
        approval_id = asked.approval_id
        if approval_id is not None:  # a first run: the manager reads the request and approves
            ApprovalBook(store).decide(approval_id, "approve", by=MANAGER,
                                       note="a strategic account")
            approved = grant("discount-1", "L-101", 25)
        else:  # a later run: approved before, the call is replayed
            approved = asked
        over_budget = grant("discount-2", "L-102", 10)
        return ControlsReport(asked, approved, over_budget, approval_id)
    finally:
        locks.close()
        store.close()
