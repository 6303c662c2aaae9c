"""What the guard-level control tests share: a policy, intents and a tool that counts its runs."""

from __future__ import annotations

import uuid
from typing import Any

from toolguard.call.context import CallContext
from toolguard.call.intent import Intent, WorkflowIdentity

EFFECT = "INSERT INTO effect (tool, lead, delta, call, token) VALUES (%s, %s, %s, %s, %s)"


def intent(tool: str, args: Any, *, agent: str | None = "scorer", call_id: str | None = None,
           thread: str = "thread-1") -> Intent:
    """A model's call: ``call_id`` and ``thread`` make its idempotency key."""
    return Intent(tool=tool, args=args, agent=agent, call_id=call_id or uuid.uuid4().hex,
                  workflow=WorkflowIdentity(thread_id=thread))


def write(ctx: CallContext) -> dict[str, Any]:
    """A fenced tool body: one ``effect`` row per applied call."""
    lead = str(ctx.args.get("lead_id", "-"))
    token = ctx.lease.tokens.get(ctx.keys[0]) if ctx.lease is not None and ctx.keys else None
    ctx.tx.execute(EFFECT, (ctx.tool, lead, int(ctx.args.get("amount", 0)),
                            ctx.intent.call_id, token))
    return {"ok": lead}
