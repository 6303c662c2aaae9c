"""The holds a ``create_agent`` run took, ended when the run ends (``after_agent``).

A ``hold: true`` read keeps its key's lock for its caller until the caller
writes it (``toolguard.steps.holds``). An agent whose turn ends without
writing must not keep others waiting: ``ToolGuardMiddleware`` notes the
callers of the hold reads it guards, by run (the thread, else the run id),
and ends their holds in its ``after_agent`` hook.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from toolguard.adapters.identity import _execution_info
from toolguard.call.intent import Intent
from toolguard.policies import Policy
from toolguard.steps.holds import caller_of_intent

__all__ = ["Turns"]

#: A run without a thread or run id is known per superstep only (``step:<checkpoint>``).
_STEP = "step:"


class Turns:
    """Callers that took holds, by run; taken back at the run's end."""

    def __init__(self) -> None:
        self._callers: dict[str | None, set[str]] = {}
        self._mutex = threading.Lock()

    def note(self, intent: Intent, policy: Policy) -> None:
        """A call is about to run: remember its caller if it may take a hold."""
        rule = policy.tools.get(intent.tool) if isinstance(intent.tool, str) else None
        caller = caller_of_intent(intent) if rule is not None and rule.hold else None
        if caller is None:
            return
        flow = intent.workflow
        with self._mutex:
            self._callers.setdefault(flow.thread_id or flow.run_id, set()).add(caller)

    def ended(self, runtime: Any) -> set[str]:
        """The callers of the run that ends now (and forget them).

        Without a thread or run id, LangGraph names a run per superstep only: the
        end of such a run takes back the holds of every such run.
        """
        run = _run_of(runtime)
        with self._mutex:
            if run is not None:
                return self._callers.pop(run, set())
            found: set[str] = set()
            for key in [k for k in self._callers if k is None or k.startswith(_STEP)]:
                found |= self._callers.pop(key)
            return found


def _run_of(runtime: Any) -> str | None:
    try:
        from langgraph.config import get_config

        config: Mapping[str, Any] = get_config()
    except Exception:  # outside a run: nothing to match
        config = {}
    configurable = config.get("configurable")
    configurable = configurable if isinstance(configurable, Mapping) else {}
    info = _execution_info(runtime, configurable)
    for value in (getattr(info, "thread_id", None), configurable.get("thread_id"),
                  getattr(info, "run_id", None), config.get("run_id")):
        if isinstance(value, str) and value:
            return value
    return None
