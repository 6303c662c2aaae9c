"""OAuth 2.1 access tokens at the gateway's door (the MCP authorization specification).

The gateway is a resource server: a client brings an access token its
authorization server issued for the gateway, and FastMCP's ``JWTVerifier``
(joserfc underneath) checks it against the issuer's published keys (JWKS,
cached, fetched again for an unknown ``kid`` at most once per
``jwks_refresh_s``), with the one algorithm configured here: the token's own
``alg`` header chooses nothing, ``none`` and the HMAC algorithms are refused
at start-up (a JWKS holds public keys; an HMAC key made of one would let
anyone sign). ``iss``, ``aud``, ``exp`` (required) and ``nbf`` are checked,
and the agent is the claim ``agent_claim`` of the verified token.

The gateway publishes its Protected Resource Metadata (RFC 9728) at
``/.well-known/oauth-protected-resource`` (and the path-suffixed form the RFC
derives from ``/mcp``), and each 401 points to it in ``WWW-Authenticate``.
Tokens are never logged, audited or forwarded upstream.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from fastmcp.server.auth import AccessToken, RemoteAuthProvider
from fastmcp.server.auth.providers.jwt import JWTVerifier
from pydantic import AnyHttpUrl
from starlette.routing import Route

from toolguard.errors import GuardMisconfigured
from toolguard.gateway.door import MCP_PATH

__all__ = ["ALGORITHMS", "AccessTokenVerifier", "OAuthSettings", "ProtectedResource"]

#: The algorithms a gateway may be configured with: asymmetric only.
ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512",
              "EdDSA", "Ed25519", "Ed448")
#: An agent claim longer than this is no agent name.
MAX_AGENT_LENGTH = 256
#: At most one log line about refused tokens per this many seconds (each refusal is counted).
LOG_EVERY_S = 10.0
METADATA_PATH = "/.well-known/oauth-protected-resource"


@dataclass(frozen=True)
class OAuthSettings:
    """Which access tokens the gateway accepts, and which claim names the agent."""

    jwks_url: str
    issuer: str
    audience: str
    agent_claim: str = "sub"
    algorithm: str = "RS256"
    jwks_refresh_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.jwks_url.startswith(("https://", "http://")):
            msg = f"--jwks-url must be an https:// (or http://) URL, got {self.jwks_url!r}"
            raise GuardMisconfigured(msg)
        for name, value in (("--issuer", self.issuer), ("--audience", self.audience),
                            ("--agent-claim", self.agent_claim)):
            if not value or not value.strip():
                msg = f"OAuth needs {name}: give it (or its environment variable)"
                raise GuardMisconfigured(msg)
        if self.algorithm not in ALGORITHMS:
            msg = (f"--jwt-algorithm {self.algorithm!r} is not one the gateway verifies with; "
                   f"give one of {', '.join(ALGORITHMS)} (never none, never an HMAC: a JWKS "
                   f"holds public keys)")
            raise GuardMisconfigured(msg)
        if not math.isfinite(self.jwks_refresh_s) or self.jwks_refresh_s < 0:
            msg = f"the JWKS refresh interval must be 0 or more seconds, got {self.jwks_refresh_s}"
            raise GuardMisconfigured(msg)

    def verifier(self) -> AccessTokenVerifier:
        """The token verifier of these settings."""
        return AccessTokenVerifier(jwks_uri=self.jwks_url, issuer=self.issuer,
                                   audience=self.audience, algorithm=self.algorithm,
                                   jwks_refresh_interval=self.jwks_refresh_s,
                                   agent_claim=self.agent_claim)

    def provider(self, resource_url: str | None) -> ProtectedResource:
        """The auth provider of a gateway whose public URL of ``/mcp`` is ``resource_url``."""
        if not resource_url:
            msg = "OAuth needs the gateway's URL (--listen, or --resource-url behind a proxy)"
            raise GuardMisconfigured(msg)
        if not resource_url.rstrip("/").endswith(MCP_PATH):
            msg = f"--resource-url names the gateway's {MCP_PATH} endpoint, got {resource_url!r}"
            raise GuardMisconfigured(msg)
        from urllib.parse import urlsplit

        if urlsplit(resource_url).hostname in ("0.0.0.0", "::"):
            msg = (f"{resource_url} is no URL a client can reach: behind --listen on all "
                   f"addresses, give --resource-url with the gateway's public name")
            raise GuardMisconfigured(msg)
        base = resource_url.rstrip("/")[: -len(MCP_PATH)]
        try:
            issuer = AnyHttpUrl(self.issuer)
        except ValueError as error:
            msg = f"--issuer must be the authorization server's URL, got {self.issuer!r}"
            raise GuardMisconfigured(msg) from error
        return ProtectedResource(token_verifier=self.verifier(), authorization_servers=[issuer],
                                 base_url=base, resource_name="toolguard gateway")


class AccessTokenVerifier(JWTVerifier):
    """FastMCP's ``JWTVerifier``, stricter: ``exp`` required, the agent claim a name.

    A token without an expiry would be good forever once leaked; one without
    the agent claim names no one the policy could authorize.
    """

    def __init__(self, *, agent_claim: str = "sub", **options: Any) -> None:
        super().__init__(**options)
        self.agent_claim = agent_claim
        self.logger = logging.getLogger("toolguard.gateway.oauth")
        self.logger.addFilter(_EveryFewSeconds())

    async def load_access_token(self, token: str) -> AccessToken | None:
        found = await super().load_access_token(token)
        if found is None:
            return None
        claims = found.claims or {}
        expiry = claims.get("exp")
        if isinstance(expiry, bool) or not isinstance(expiry, int | float):
            self.logger.warning("bearer token refused: it has no expiry (exp)")
            return None
        agent = claims.get(self.agent_claim)
        if not isinstance(agent, str) or not agent.strip() or len(agent) > MAX_AGENT_LENGTH:
            self.logger.warning("bearer token refused: its %r claim names no agent",
                                self.agent_claim)
            return None
        return found


class ProtectedResource(RemoteAuthProvider):
    """FastMCP's resource-server provider, its metadata also at the root well-known path.

    RFC 9728 derives ``/.well-known/oauth-protected-resource/mcp`` from the
    resource URL; clients that look at the root path find the same document.
    """

    def get_routes(self, mcp_path: str | None = None) -> list[Route]:
        routes = super().get_routes(mcp_path)
        for route in list(routes):
            if isinstance(route, Route) and route.path.startswith(METADATA_PATH) \
                    and route.path != METADATA_PATH:
                routes.append(Route(METADATA_PATH, endpoint=route.endpoint,
                                    methods=sorted(route.methods or {"GET"})))
                break
        return routes


class _EveryFewSeconds(logging.Filter):
    """Lets one record through per ``LOG_EVERY_S``: a burst of bad tokens is one line."""

    def __init__(self) -> None:
        super().__init__()
        self._next = 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + LOG_EVERY_S
        return True
