"""Where a fenced service keeps a recorded answer: the idempotency key within its scope.

A recorded answer belongs to one service (its audience) and one agent: two
services on one store, or two agents that reuse a key and a body, never replay
each other's answers. The stored key is::

    <audience>/<agent>/<the request's Idempotency-Key>

with the audience and the agent percent-encoded as lock keys are on the wire
(``/`` and ``%`` among the bytes encoded), and empty when unknown, so the
mapping is injective: no two (audience, agent, key) triples share a stored key.
Nothing changes in the store's schema; the service's audit log and
``toolguard_intent`` show the scoped key.
"""

from __future__ import annotations

from toolguard.fences.wire import encode_key

__all__ = ["scoped_key"]


def scoped_key(key: str, *, audience: str | None, agent: str | None) -> str:
    """The stored idempotency key of ``key`` sent by ``agent`` to the service ``audience``."""
    return f"{_part(audience)}/{_part(agent)}/{key}"


def _part(text: str | None) -> str:
    return encode_key(text) if text else ""
