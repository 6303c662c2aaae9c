"""The review page: a read-only web view of the audit log (``toolguard serve``).

Rejected intents first, filtered like ``toolguard audit`` (tool, agent, reason,
key, workflow, time), one page per decision that says why (the reason, what
the model read, the policy rule at its file:line, the lease's keys and tokens,
the redacted arguments, every attempt under the same idempotency key) and a
chart of decisions over time by reason, drawn as SVG by the server.

Needs the ``review`` extra (Starlette, Jinja2, uvicorn). ``create_app(store)``
builds the ASGI app for any server; ``toolguard serve`` runs it on loopback.
The rule lookup (``toolguard.review.rules``) needs none of it: ``toolguard audit
show`` uses it too, so the web parts are imported when first named.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toolguard.review.rules import PolicySource

if TYPE_CHECKING:
    from toolguard.review.app import create_app
    from toolguard.review.security import CONTENT_SECURITY_POLICY, MIN_TOKEN_LENGTH, is_loopback

__all__ = ["CONTENT_SECURITY_POLICY", "MIN_TOKEN_LENGTH", "PolicySource", "create_app", "is_loopback"]

_WEB = {"create_app": "toolguard.review.app", "CONTENT_SECURITY_POLICY": "toolguard.review.security",
        "MIN_TOKEN_LENGTH": "toolguard.review.security", "is_loopback": "toolguard.review.security"}


def __getattr__(name: str) -> Any:
    module = _WEB.get(name)
    if module is None:
        msg = f"module 'toolguard.review' has no attribute {name!r}"
        raise AttributeError(msg)
    import importlib

    return getattr(importlib.import_module(module), name)
