"""The review page: a read-only web view of the audit log (``toolguard serve``).

Rejected intents first, filtered like ``toolguard audit`` (tool, agent, reason,
key, workflow, time), one page per decision that says why (the reason, what
the model read, the policy rule at its file:line, the lease's keys and tokens,
the redacted arguments, every attempt under the same idempotency key) and a
chart of decisions over time by reason, drawn as SVG by the server.

Needs the ``review`` extra (Starlette, Jinja2, uvicorn). ``create_app(store)``
builds the ASGI app for any server; ``toolguard serve`` runs it on loopback.
"""

from __future__ import annotations

from toolguard.review.app import create_app
from toolguard.review.rules import PolicySource
from toolguard.review.security import CONTENT_SECURITY_POLICY, MIN_TOKEN_LENGTH, is_loopback

__all__ = ["CONTENT_SECURITY_POLICY", "MIN_TOKEN_LENGTH", "PolicySource", "create_app", "is_loopback"]
