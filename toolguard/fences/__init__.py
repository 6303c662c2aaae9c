"""Fences that travel: REST services and MCP servers check toolguard's fencing tokens themselves.

Client side, inside a guarded tool:

* ``FencedClient`` / ``AsyncFencedClient`` (httpx, extra ``http``): every request
  carries the lease's fences, the agent and the intent id; unsafe methods an
  idempotency key.
* ``FencedSession`` / ``guarded_mcp_tools`` (extra ``mcp``): MCP ``tools/call``
  carries the same in ``_meta``.

Server side, in the service that owns the data:

* ``FenceMiddleware`` (ASGI: Starlette, FastAPI, any ASGI app; extra ``asgi``
  only for Starlette's request objects) and ``FenceToolMiddleware`` (FastMCP,
  extra ``mcp``) check and advance the fences in the service's own store, in
  the same transaction as the handler's writes (``fence_of(request).tx`` /
  ``current_fence().tx``), replay recorded answers and audit every decision.

Signed mode: ``FenceSigner`` (client side, from the lease in hand) and
``ClaimVerifier`` (server side, ``claims=``) make a fence count only when a
trusted key signed it for this service (``toolguard.fences.claims``; keys in
``toolguard.fences.keys``, extra ``signing`` for Ed25519).

The wire format is in ``toolguard.fences.wire``; the refusals and their codes
in ``toolguard.fences.problems``. Nothing here needs LangGraph, and each name
imports its third-party library only when it is first used.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports on first use
    from toolguard.fences.asgi import FenceMiddleware, fence_of
    from toolguard.fences.claims import Claim, ClaimRefused, ClaimVerifier, FenceSigner
    from toolguard.fences.gate import FenceGate, ServiceFence, current_fence
    from toolguard.fences.http_client import AsyncFencedClient, FencedClient
    from toolguard.fences.inflight import LocalInFlight, PostgresInFlight
    from toolguard.fences.keys import (
        FenceKeyError,
        Keyring,
        SigningKey,
        VerifyingKey,
        generate_signing_key,
        load_keyring,
        load_signing_key,
    )
    from toolguard.fences.mcp_client import FencedSession, guarded_mcp_tools
    from toolguard.fences.mcp_server import FenceToolMiddleware
    from toolguard.fences.outgoing import outgoing_fences
    from toolguard.fences.problems import FencesRequired, InFlight, KeyNotFenced, Problem
    from toolguard.fences.wire import Fences, WireError

__all__ = [
    "AsyncFencedClient",
    "Claim",
    "ClaimRefused",
    "ClaimVerifier",
    "FenceGate",
    "FenceKeyError",
    "FenceMiddleware",
    "FenceSigner",
    "FenceToolMiddleware",
    "FencedClient",
    "FencedSession",
    "Fences",
    "FencesRequired",
    "InFlight",
    "KeyNotFenced",
    "Keyring",
    "LocalInFlight",
    "PostgresInFlight",
    "Problem",
    "ServiceFence",
    "SigningKey",
    "VerifyingKey",
    "WireError",
    "current_fence",
    "fence_of",
    "generate_signing_key",
    "guarded_mcp_tools",
    "load_keyring",
    "load_signing_key",
    "outgoing_fences",
]

_WHERE = {
    "AsyncFencedClient": "http_client",
    "FencedClient": "http_client",
    "FenceGate": "gate",
    "ServiceFence": "gate",
    "current_fence": "gate",
    "FenceMiddleware": "asgi",
    "fence_of": "asgi",
    "FenceToolMiddleware": "mcp_server",
    "FencedSession": "mcp_client",
    "guarded_mcp_tools": "mcp_client",
    "Fences": "wire",
    "WireError": "wire",
    "FencesRequired": "problems",
    "InFlight": "problems",
    "KeyNotFenced": "problems",
    "Problem": "problems",
    "LocalInFlight": "inflight",
    "PostgresInFlight": "inflight",
    "outgoing_fences": "outgoing",
    "Claim": "claims",
    "ClaimRefused": "claims",
    "ClaimVerifier": "claims",
    "FenceSigner": "claims",
    "FenceKeyError": "keys",
    "Keyring": "keys",
    "SigningKey": "keys",
    "VerifyingKey": "keys",
    "generate_signing_key": "keys",
    "load_keyring": "keys",
    "load_signing_key": "keys",
}


#: The extra each part's third-party library comes from (a missing one raises ``MissingExtra``).
_EXTRA = {"http_client": "http", "mcp_server": "mcp", "mcp_client": "mcp"}


def _load(name: str) -> Any:
    """Load each part (and its library: httpx, fastmcp...) only when it is asked for."""
    module = _WHERE.get(name)
    if module is None:
        msg = f"module 'toolguard.fences' has no attribute {name!r}"
        raise AttributeError(msg)
    extra = _EXTRA.get(module)
    if extra is not None:
        from toolguard.runtime.extras import require

        require(extra, f"toolguard.fences.{name}")
    return getattr(import_module(f"toolguard.fences.{module}"), name)


if not TYPE_CHECKING:  # type checkers read the imports above: a name not there is an error
    __getattr__ = _load
