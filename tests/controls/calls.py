"""Build the facts of a call the way the guard will: validated args, their hash, the key."""

from __future__ import annotations

import uuid
from typing import Any

from toolguard.call.facts import CallFacts
from toolguard.call.intent import args_hash
from toolguard.policies import Policy, redacted_args

POLICY = {
    "version": 1,
    "tools": {
        "transfer": {
            "locks": ["account:{from_id}", "account:{to_id}"],
            "redact": ["memo"],
            "approval": {"when": [{"amount": {"gt": 1000}}, {"to_id": {"enum": ["offshore"]}}],
                         "expires": "10m", "reason": "large or unusual transfer"},
        },
        "wipe": {"read_only": True, "approval": True},
        "lookup": {"read_only": True},
    },
}


def policy(**changes: Any) -> Policy:
    data = {**POLICY, "tools": {**POLICY["tools"], **changes}}
    return Policy.from_dict(data)


def call(policy: Policy, tool: str, args: dict[str, Any], *, key: str | None = None,
         agent: str | None = "payments") -> CallFacts:
    rule = policy.tools[tool]
    keys = tuple(f"account:{args[k]}" for k in ("from_id", "to_id") if k in args)
    return CallFacts(tool=tool, agent=agent, args=args, idempotency_key=key or uuid.uuid4().hex,
                     args_hash=args_hash(args), attempt=uuid.uuid4().hex,
                     policy_digest=policy.digest, keys=keys, workflow="thread-1",
                     redacted_args=redacted_args(rule, args) if rule.redact else None)
