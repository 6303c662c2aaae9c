"""Who is calling through the gateway: from its configuration or the connection's token.

The agent a ``tools/call`` runs as is never read from the call itself (its
arguments or ``_meta`` are the model's to write). A gateway serving one client
over stdio is given the agent when it is started (``--agent``); one listening
on HTTP maps each bearer token to an agent (``--token AGENT:TOKEN``), so each
client connection is known by what it presents, compared in constant time.
With tokens configured, a request without a known token has no identity, and
the guard refuses it (``missing_identity``), audited like any refusal.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field

from toolguard.errors import GuardMisconfigured

__all__ = ["Identity", "parse_token"]

#: Shorter tokens are refused at start-up: they could be guessed.
MIN_TOKEN_LENGTH = 16


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
    """The agent of every connection (``agent``), or of each bearer token (``tokens``)."""

    agent: str | None = None
    tokens: Mapping[str, str] = field(default_factory=dict)  # token -> agent

    def __post_init__(self) -> None:
        if self.agent is not None and not self.agent.strip():
            msg = "--agent must name an agent, got an empty text"
            raise GuardMisconfigured(msg)

    def agent_of(self, headers: Mapping[str, str] | None) -> str | None:
        """The agent of a request with these HTTP ``headers`` (None: over stdio); None: unknown."""
        if not self.tokens:
            return self.agent
        presented = _bearer(headers or {})
        if presented is None:
            return None
        found = None
        for token, agent in self.tokens.items():  # every token compared: no early exit to time
            if hmac.compare_digest(token.encode(), presented.encode()):
                found = agent
        return found


def _bearer(headers: Mapping[str, str]) -> str | None:
    value = next((v for k, v in headers.items() if k.lower() == "authorization"), None)
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    try:
        return token.strip().encode("ascii").decode("ascii")
    except UnicodeError:
        return None
