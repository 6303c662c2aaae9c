"""The gateway server: FastMCP's proxy in front of one upstream, with ``GatewayMiddleware``.

``open_gateway`` connects to the upstream once at start-up, lists its tools
and registers each tool's strict argument model with the guard (a schema
toolguard cannot enforce, or a policy template naming an argument the schema
lacks, stops the start-up with the tool's name), then builds the proxy.
Everything but ``tools/call`` and ``tools/list`` (resources, prompts,
progress notifications, cancellations) is FastMCP's proxy, unchanged.

The upstream is a command (stdio: the gateway starts it, keeps it running,
and starts it again after it died) or a streamable-HTTP URL, which gets the
gateway's own headers only: a client's ``Authorization`` (a static token, an
OAuth access token issued for the gateway) and its other headers stay here.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastmcp import Client, FastMCP
from fastmcp.client.transports import ClientTransport, StdioTransport, StreamableHttpTransport
from fastmcp.client.transports.base import TransportOptions
from fastmcp.server import create_proxy

from toolguard.errors import GuardMisconfigured
from toolguard.gateway.identity import Identity
from toolguard.gateway.middleware import GatewayMiddleware
from toolguard.gateway.schemas import tool_model
from toolguard.guard import ToolGuard

if TYPE_CHECKING:
    from toolguard.fences.claims import FenceSigner

__all__ = ["TOKENS_ENV", "Upstream", "UpstreamTool", "list_upstream_tools", "open_gateway", "register_tools"]

log = logging.getLogger("toolguard.gateway")

#: The environment variable of the downstream clients' bearer tokens (``--token``).
TOKENS_ENV = "TOOLGUARD_GATEWAY_TOKENS"


@dataclass(frozen=True)
class Upstream:
    """Where the upstream MCP server is: a command to start (stdio) or a URL (streamable HTTP)."""

    command: tuple[str, ...] = ()
    url: str | None = None
    cwd: str | None = None

    def __post_init__(self) -> None:
        if bool(self.command) == bool(self.url):
            msg = ("give the upstream MCP server either as a command after -- (stdio) or as "
                   "--upstream URL (streamable HTTP), not both or neither")
            raise GuardMisconfigured(msg)
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            msg = f"--upstream must be an http:// or https:// URL, got {self.url!r}"
            raise GuardMisconfigured(msg)

    def transport(self, *, keep_alive: bool = True) -> ClientTransport:
        """A new transport to the upstream (stdio: a kept-alive subprocess, restarted if it died)."""
        if self.url is not None:
            return OwnHeadersTransport(self.url)
        env = {k: v for k, v in os.environ.items() if k != TOKENS_ENV}  # the clients' secrets stay here
        return StdioTransport(command=self.command[0], args=list(self.command[1:]),
                              env=env, cwd=self.cwd, keep_alive=keep_alive)

    @property
    def label(self) -> str:
        return self.url or " ".join(self.command)


class OwnHeadersTransport(StreamableHttpTransport):
    """A streamable-HTTP upstream that never gets the downstream client's headers.

    FastMCP's proxy forwards the client's headers (``Authorization`` included)
    to an HTTP upstream by default; a token issued for the gateway is not the
    upstream's to see, so each connection here turns that off.
    """

    @contextlib.asynccontextmanager
    async def connect_session(self, *, transport_options: TransportOptions | None = None,
                              **session_kwargs: Any) -> AsyncGenerator[Any, None]:
        options = replace(transport_options or TransportOptions(), forward_incoming_headers=False)
        async with super().connect_session(transport_options=options,
                                           **session_kwargs) as session:
            yield session


@dataclass(frozen=True)
class UpstreamTool:
    """One tool as the upstream lists it: its name and its argument schema."""

    name: str
    input_schema: dict[str, Any]


async def list_upstream_tools(upstream: Upstream) -> list[UpstreamTool]:
    """The upstream's tools, over a connection of their own (closed afterwards)."""
    try:
        async with Client(upstream.transport(keep_alive=False)) as client:
            listed = await client.list_tools()
    except Exception as error:
        msg = f"cannot list the tools of the upstream MCP server {upstream.label}: {error}"
        raise GuardMisconfigured(msg) from error
    return [UpstreamTool(tool.name, dict(tool.input_schema or {})) for tool in listed]


def register_tools(guard: ToolGuard, tools: Sequence[UpstreamTool]) -> None:
    """Register each upstream tool the policy can let through; refuse what cannot be judged.

    A tool the policy does not name is registered only when the policy allows
    unknown tools (else every call to it is refused ``unknown_tool`` anyway).
    """
    policy = guard.policy
    allow_unknown = policy.defaults.on_unknown_tool == "allow"
    for tool in tools:
        if tool.name in policy.tools or allow_unknown:
            guard.register(tool.name, tool_model(tool.name, tool.input_schema), stacklevel=3)
    listed = {tool.name for tool in tools}
    for name in policy.tools:
        if name not in listed:
            log.warning("the policy names %r, which the upstream does not list", name)


async def open_gateway(guard: ToolGuard, upstream: Upstream, *,
                       identity: Identity, hide_unlisted: bool = False, elicit: bool = True,
                       signer: FenceSigner | None = None, resource_url: str | None = None,
                       name: str = "toolguard-gateway") -> FastMCP:
    """The gateway server for ``upstream``, its tools registered with ``guard`` (see module doc).

    With credentials in ``identity``, the server checks each HTTP request's
    bearer token (``resource_url``: the gateway's public URL of ``/mcp``, which
    OAuth's protected-resource metadata names).
    """
    auth = identity.auth_provider(resource_url)
    register_tools(guard, await list_upstream_tools(upstream))
    middleware = GatewayMiddleware(guard, identity, hide_unlisted=hide_unlisted, elicit=elicit,
                                   signer=signer)
    return create_proxy(upstream.transport(), name=name, middleware=[middleware], auth=auth)
