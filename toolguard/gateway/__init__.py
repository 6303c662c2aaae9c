"""The MCP gateway: toolguard in front of any MCP server, for any MCP client.

``toolguard mcp proxy --policy policy.yml -- <upstream command>`` serves an MCP
server (stdio, or streamable HTTP with ``--listen``) that forwards to the
upstream through FastMCP's proxy; ``GatewayMiddleware`` runs every
``tools/call`` through ``ToolGuard.arun`` (validation against the upstream's
``inputSchema``, policy, locks, ordering, quotas, kill switch, approvals,
idempotency, audit) and forwards the lease's fences in ``_meta``. See
docs/gateway.md. Needs the ``mcp`` extra. Over HTTP, ``Door`` serves it behind
Host/Origin checks, and ``Identity`` (static tokens, ``OAuthSettings``) answers
401 before any MCP processing to a request without a valid credential.
"""

from __future__ import annotations

from toolguard.gateway.check import UpstreamReport, check_upstream
from toolguard.gateway.door import Door
from toolguard.gateway.identity import Identity
from toolguard.gateway.middleware import GatewayMiddleware, UpstreamLost, upstream_meta
from toolguard.gateway.oauth import OAuthSettings
from toolguard.gateway.schemas import UnjudgeableSchema, tool_model
from toolguard.gateway.server import Upstream, UpstreamTool, list_upstream_tools, open_gateway

__all__ = [
    "Door",
    "GatewayMiddleware",
    "Identity",
    "OAuthSettings",
    "UnjudgeableSchema",
    "Upstream",
    "UpstreamLost",
    "UpstreamReport",
    "UpstreamTool",
    "check_upstream",
    "list_upstream_tools",
    "open_gateway",
    "tool_model",
    "upstream_meta",
]
