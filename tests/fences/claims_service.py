"""The fenced services of the signed-mode tests: ``service_app``'s handlers, in signed mode.

Started by ``uvicorn --factory fences.claims_service:create_app`` (or ``create_mcp_app``)
with the environment of ``service_app`` plus ``FENCES_AUDIENCE`` (the service's name)
and the verifying keys in ``TOOLGUARD_FENCE_VERIFY_KEYS`` (or ``..._FILE``). With
``FENCES_UNSIGNED=1`` the service runs unsigned, its answers scoped to the audience.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from fences.service_app import _options, health, prepare, read_lead, set_score
from toolguard.fences import ClaimVerifier, FenceMiddleware, FenceToolMiddleware, load_keyring
from toolguard.store import open_async_store


def _trust() -> dict[str, Any]:
    audience = os.environ["FENCES_AUDIENCE"]
    if os.environ.get("FENCES_UNSIGNED") == "1":
        return {"audience": audience}
    return {"claims": ClaimVerifier(audience=audience, keys=load_keyring())}


def create_app() -> Starlette:
    prepare()
    url, options = _options()
    store = open_async_store(url, **options)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await store.close()

    routes = [Route("/leads/{lead}/score", set_score, methods=["POST"]),
              Route("/leads/{lead}", read_lead, methods=["GET"]),
              Route("/health", health, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan,
                     middleware=[Middleware(FenceMiddleware, store=store, **_trust())])


def create_mcp_app() -> Any:
    from fastmcp import FastMCP

    from toolguard.fences import current_fence

    prepare()
    url, options = _options()
    store = open_async_store(url, **options)
    mcp = FastMCP("crm", middleware=[FenceToolMiddleware(store=store, **_trust())])

    @mcp.tool
    async def set_score(lead_id: str, score: int) -> dict:
        """Set a lead's score."""
        fence = current_fence()
        fence.require(f"lead:{lead_id}")
        await fence.tx.execute("INSERT INTO leads (id, score, writes) VALUES (%s, %s, 1) "
                               "ON CONFLICT (id) DO UPDATE SET score = excluded.score, "
                               "writes = leads.writes + 1", (lead_id, score))
        return {"lead": lead_id, "score": score, "signed_by": [c.key_id for c in fence.claims]}

    return mcp.http_app(path="/mcp")
