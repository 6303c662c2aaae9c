"""What the guard knows about a call once it is validated: the input of the later steps.

The production controls (kill switch, approvals, quotas, shadow mode) decide on
these facts only, never on the raw intent: arguments are the validated JSON
form, keys are rendered from them, the agent comes from the host.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CallFacts"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CallFacts:
    """One validated call.

    ``idempotency_key`` identifies the intent across retries (a retried call
    is not counted twice by a quota, and finds its approval again);
    ``attempt`` identifies this try (an in-flight slot is this attempt's).
    ``redacted_args`` is what a person or the audit log may see.
    """

    tool: str
    agent: str | None
    args: Mapping[str, Any]
    idempotency_key: str
    args_hash: str
    attempt: str
    policy_digest: str
    keys: tuple[str, ...] = ()
    workflow: str | None = None
    redacted_args: Any = None

    def shown_args(self) -> Any:
        """The arguments as they may be shown: redacted when the policy redacts any."""
        return self.args if self.redacted_args is None else self.redacted_args
