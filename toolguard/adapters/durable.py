"""The durable identity of a guarded call made inside a durable engine's step.

A durable engine records each step's result once the step returns. A process
that dies after a step's effect committed, but before the engine recorded the
step, runs the step again when the engine recovers the workflow: the same
workflow, the same step, a second effect. Inside such a step a guarded call
without an identity of its own takes the engine's: the workflow id is its run,
the step its call id, so the re-run step finds the call's idempotency record
and gets the recorded result.

DBOS (``@DBOS.step()`` inside a ``@DBOS.workflow()``): the run is
``dbos:<workflow id>``, the call ``step-<step id>`` (``step-<id>.<n>`` for the
n-th guarded call of one step, n > 1, counted in the order the calls start),
and the step's attempt (DBOS's ``retries_allowed``) is the audited attempt.
Nothing here imports an engine: one that is not loaded is not running.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["DurableIdentity", "durable_identity", "in_durable_step"]

#: The attribute of DBOS's per-step status object that counts the guarded calls of one attempt.
_CALLS = "_toolguard_calls"
_counting = threading.Lock()


@dataclass(frozen=True)
class DurableIdentity:
    """Where a call runs in a durable engine: its run, its call id and the step's attempt."""

    run_id: str
    call_id: str
    attempt: int


def durable_identity() -> DurableIdentity | None:
    """The identity of the durable step this code runs in (DBOS), or None outside one.

    Each call counts as one guarded call of the step: call it once per intent.
    """
    dbos = sys.modules.get("dbos")
    if dbos is None:
        return None
    try:
        workflow_id = dbos.DBOS.workflow_id
        status = dbos.DBOS.step_status
    except Exception:  # no DBOS instance, or a version without these: no durable identity
        return None
    if not isinstance(workflow_id, str) or not workflow_id or status is None:
        return None
    step, attempt = getattr(status, "step_id", None), getattr(status, "current_attempt", None)
    if type(step) is not int:
        return None
    number = _next_call(status, attempt)
    suffix = f".{number}" if number > 1 else ""
    return DurableIdentity(run_id=f"dbos:{workflow_id}", call_id=f"step-{step}{suffix}",
                           attempt=attempt + 1 if type(attempt) is int and attempt >= 0 else 1)


def in_durable_step() -> bool:
    """True inside a durable engine's step (without counting a call)."""
    dbos = sys.modules.get("dbos")
    if dbos is None:
        return False
    try:
        return dbos.DBOS.step_status is not None and bool(dbos.DBOS.workflow_id)
    except Exception:  # no DBOS instance: not in a step
        return False


def _next_call(status: Any, attempt: Any) -> int:
    """1 for the step attempt's first guarded call, 2 for its second...; a retry counts anew."""
    with _counting:
        seen = getattr(status, _CALLS, None)
        counts: dict[Any, int] = seen if isinstance(seen, dict) else {}
        counts[attempt] = counts.get(attempt, 0) + 1
        try:
            setattr(status, _CALLS, counts)
        except (AttributeError, TypeError):  # a status that takes no attribute: one call per step
            return 1
        return counts[attempt]
