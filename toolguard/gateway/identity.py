"""Who is calling through the gateway: from its configuration or the request's credential.

The agent a ``tools/call`` runs as is never read from the call itself (its
arguments or ``_meta`` are the model's to write). A gateway serving one client
over stdio, or one local client on loopback HTTP, is given the agent when it
is started (``--agent``). One listening for several clients has credentials:
static bearer tokens (``--token AGENT:TOKEN``, compared in constant time) or
OAuth access tokens (``OAuthSettings``), checked at the HTTP door by FastMCP's
bearer-token middleware, which answers 401 before any MCP processing; the
agent is then the verified token's claim (``agent_claim``). No credential, no
request: nothing reaches the guard, so nothing is audited per refused request.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastmcp.server.auth import AccessToken, AuthProvider, TokenVerifier

from toolguard.errors import GuardMisconfigured

if TYPE_CHECKING:
    from toolguard.gateway.oauth import OAuthSettings

__all__ = ["AGENT_CLAIM", "Identity", "StaticTokens", "parse_token"]

#: Shorter tokens are refused at start-up: they could be guessed.
MIN_TOKEN_LENGTH = 16
#: The claim naming the agent, by default (a static token's agent is put there too).
AGENT_CLAIM = "sub"


def parse_token(text: str) -> tuple[str, str]:
    """``AGENT:TOKEN`` as (agent, token); ``GuardMisconfigured`` when it is not that."""
    agent, sep, token = text.partition(":")
    if not sep or not agent.strip() or not token:
        msg = f"a token is given as AGENT:TOKEN, got {len(text)} characters without that shape"
        raise GuardMisconfigured(msg)
    if len(token) < MIN_TOKEN_LENGTH:
        msg = (f"the token of agent {agent.strip()!r} has {len(token)} characters; give at least "
               f"{MIN_TOKEN_LENGTH} (e.g. python -c 'import secrets; print(secrets.token_urlsafe())')")
        raise GuardMisconfigured(msg)
    return agent.strip(), token


@dataclass(frozen=True)
class Identity:
    """The agent of every connection (``agent``), or of each request's credential.

    ``tokens`` maps static bearer tokens to agents; ``oauth`` verifies OAuth
    access tokens and names the claim that holds the agent. With either, a
    request without a valid credential is refused at the HTTP door.
    """

    agent: str | None = None
    tokens: Mapping[str, str] = field(default_factory=dict)  # token -> agent
    oauth: OAuthSettings | None = None

    def __post_init__(self) -> None:
        if self.agent is not None and not self.agent.strip():
            msg = "--agent must name an agent, got an empty text"
            raise GuardMisconfigured(msg)
        if self.tokens and self.oauth is not None:
            msg = "give static tokens (--token) or OAuth (--jwks-url), not both"
            raise GuardMisconfigured(msg)

    @property
    def credentials(self) -> bool:
        """True when each HTTP request must bring a credential."""
        return bool(self.tokens) or self.oauth is not None

    def auth_provider(self, resource_url: str | None = None) -> AuthProvider | None:
        """What checks each HTTP request's credential (None: no credentials configured).

        ``resource_url`` is the gateway's public URL of ``/mcp``: OAuth needs it for
        the protected-resource metadata that its 401 answers point to.
        """
        if self.oauth is not None:
            return self.oauth.provider(resource_url)
        if self.tokens:
            return StaticTokens(self.tokens)
        return None

    def agent_of(self, token: AccessToken | None) -> str | None:
        """The agent of a request whose verified credential is ``token``; None: unknown."""
        if not self.credentials:
            return self.agent
        if token is None:
            return None
        claim = self.oauth.agent_claim if self.oauth is not None else AGENT_CLAIM
        value = (token.claims or {}).get(claim)
        return value if isinstance(value, str) and value.strip() else None


class StaticTokens(TokenVerifier):
    """Bearer tokens given at start-up, each naming its agent; every token compared, in
    constant time, so how long a refusal takes says nothing of how close a guess was."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        super().__init__()
        self._tokens = [(token.encode(), agent) for token, agent in tokens.items()]

    async def verify_token(self, token: str) -> AccessToken | None:
        try:
            presented = token.strip().encode("ascii")
        except UnicodeError:
            return None
        found = None
        for secret, agent in self._tokens:  # no early exit to time
            if hmac.compare_digest(secret, presented):
                found = agent
        if found is None:
            return None
        # the secret stays here: what travels on is the agent it names
        return AccessToken(token="static", client_id=found, scopes=[], subject=found,
                           claims={AGENT_CLAIM: found})
