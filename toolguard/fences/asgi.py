"""ASGI middleware: a REST service checks and advances the fences of the requests it serves.

>>> from starlette.applications import Starlette
>>> from starlette.middleware import Middleware
>>> from toolguard.fences import FenceMiddleware, fence_of
>>> async def set_score(request):
...     tx = fence_of(request).tx          # the transaction the fences were checked in
...     await tx.execute("UPDATE leads SET score = %s WHERE id = %s", (80, "L-7"))
...     return JSONResponse({"ok": True})
>>> app = Starlette(routes=[...], middleware=[Middleware(FenceMiddleware, store=store)])

A plain ASGI middleware (one ``__call__``, no global state), so Starlette,
FastAPI and any ASGI app can mount it. For a fenced request it:

1. parses the fence headers strictly (``400`` problem if malformed, repeated or
   oversized); a route that requires fences and got none, or an unsafe method
   without ``Idempotency-Key``, gets ``428``;
2. refuses with ``409`` a request whose idempotency key is still in flight;
3. opens one transaction of the service's store that checks and advances every
   fence (``409`` with the key and both tokens if one is stale), finds a replay
   (the recorded response is sent again, with ``Idempotent-Replayed: true``) or
   a conflict (``422``: same key, another request);
4. runs the app with that transaction in the request (``fence_of(request).tx``),
   buffers its response, and commits the response's record together with the
   handler's writes; only then is the response sent. A response with status
   400 or more rolls the handler's writes back and is sent as it is.

Every refusal is an RFC 9457 ``application/problem+json`` body naming the
reason; every decision is audited in the service's store. Requests without
fence headers on routes that do not require them pass through untouched.
Handlers that use the transaction must be ``async`` (it belongs to the event loop).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from toolguard.errors import GuardMisconfigured, ToolGuardError
from toolguard.fences.claims import ClaimVerifier
from toolguard.fences.gate import (
    Answer,
    Applied,
    Declined,
    FenceGate,
    Outcome,
    Refused,
    Replayed,
    ServiceFence,
    audit_name,
)
from toolguard.fences.inflight import InFlightRegistry
from toolguard.fences.problems import CONTENT_TYPE, FencesRequired, Problem
from toolguard.fences.wire import (
    FENCING_TOKEN_HEADER,
    IDEMPOTENCY_KEY_HEADER,
    REPLAYED_HEADER,
    SAFE_METHODS,
    Fences,
    WireError,
    parse_headers,
    request_digest,
)
from toolguard.store import AsyncGuardedStore

__all__ = ["SAFE_METHODS", "FenceMiddleware", "fence_of", "unsafe_methods"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SCOPE_KEY = "toolguard.fence"
DEFAULT_MAX_BODY_BYTES = 1 << 20


def unsafe_methods(scope: Scope) -> bool:
    """The default ``require``: every method that can change state needs fences."""
    return scope.get("method", "GET") not in SAFE_METHODS


def fence_of(request: Any) -> ServiceFence:
    """The fence of a Starlette ``Request`` (or an ASGI scope) served by ``FenceMiddleware``."""
    scope = getattr(request, "scope", request)
    fence: ServiceFence | None = scope.get(SCOPE_KEY) if isinstance(scope, MutableMapping) else None
    if fence is None:
        msg = ("this request was not fenced: mount FenceMiddleware, and send the request with "
               "Fencing-Token and Idempotency-Key")
        raise ToolGuardError(msg, reason="no_fence")
    return fence


class FenceMiddleware:
    """Fences every request that carries fence headers or that ``require(scope)`` says needs them.

    ``store`` is the service's own ``AsyncGuardedStore`` (installed); its
    ``toolguard_high_water`` table holds the fences, ``toolguard_intent`` the
    recorded responses, ``toolguard_audit`` every decision. ``inflight`` tells
    a key still being served (default: advisory locks on PostgreSQL, this
    process on SQLite). ``max_body_bytes`` bounds the buffered request body (413).
    ``claims`` (a ``ClaimVerifier``) is signed mode: a fence counts only with a claim a
    trusted key signed for this service (401/403 otherwise); without it the service
    trusts the network (unsigned mode), and ``audience`` names it for the scope of
    its recorded answers (see ``toolguard.fences.scope``).
    """

    def __init__(self, app: ASGIApp, *, store: AsyncGuardedStore,
                 require: Callable[[Scope], bool] = unsafe_methods,
                 inflight: InFlightRegistry | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 claims: ClaimVerifier | None = None, audience: str | None = None) -> None:
        self.app = app
        self.gate = FenceGate(store, inflight=inflight, where="FenceMiddleware", claims=claims,
                              audience=audience)
        given: object = require  # untyped callers may pass anything
        if not callable(given):
            msg = f"FenceMiddleware: require must be a function of the ASGI scope, got {require!r}"
            raise GuardMisconfigured(msg)
        if (not isinstance(max_body_bytes, int) or isinstance(max_body_bytes, bool)
                or max_body_bytes < 0):
            msg = f"FenceMiddleware: max_body_bytes must be an int >= 0, got {max_body_bytes!r}"
            raise GuardMisconfigured(msg)
        self.require = require
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tool = _tool(scope)
        try:
            fences = parse_headers(scope.get("headers") or ())
        except WireError as error:
            await _send_problem(send, (await self.gate.refuse(error, tool=tool)).problem)
            return
        if not fences.present and not self.require(scope):
            await self.app(scope, receive, send)
            return
        missing = _missing(scope, fences)
        if missing:
            msg = f"this request needs {' and '.join(missing)} (a fenced call through toolguard)"
            refused = await self.gate.refuse(FencesRequired(msg, missing=missing), tool=tool,
                                             fences=fences)
            await _send_problem(send, refused.problem)
            return
        try:
            body = await _read_body(receive, self.max_body_bytes)
        except ToolGuardError as error:  # too large, or cut off by a disconnect
            refused = await self.gate.refuse(error, tool=tool, fences=fences)
            await _send_problem(send, refused.problem)
            return
        except asyncio.CancelledError as cancelled:  # nothing ran: one row all the same
            await self.gate.cancelled(cancelled, tool=tool, fences=fences)
            raise
        digest = request_digest(scope.get("method", ""), scope.get("raw_path") or scope["path"],
                                scope.get("query_string", b""), _body_headers(scope), body)
        outcome = await self.gate.run(fences, tool=tool, digest=digest,
                                      handler=self._handler(scope, receive, body))
        await _send_outcome(send, outcome)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A websocket cannot be fenced: one that carries fences is closed (1008) and audited."""
        try:
            fences = parse_headers(scope.get("headers") or ())
        except WireError as error:
            refusal: ToolGuardError = error
            fences = Fences()
        else:
            if not fences.present:
                await self.app(scope, receive, send)
                return
            msg = ("a websocket cannot be fenced (each message would need its own transaction): "
                   "send fenced writes as HTTP requests")
            refusal = ToolGuardError(msg, reason="fences_unsupported")
        message = await receive()  # websocket.connect
        refused = await self.gate.refuse(refusal, tool=_tool(scope), fences=fences)
        if message.get("type") == "websocket.connect":
            reason = refused.problem.reason
            await send({"type": "websocket.close", "code": 1008, "reason": reason})

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """At startup, a store whose schema is behind fails the startup, naming the fix."""
        message = await receive()
        if message.get("type") == "lifespan.startup":
            try:
                await self.gate.check_store()
            except GuardMisconfigured as error:
                await send({"type": "lifespan.startup.failed", "message": str(error)})
                return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return message
            return await receive()

        await self.app(scope, replay, send)

    def _handler(self, scope: Scope, receive: Receive,
                 body: bytes) -> Callable[[ServiceFence], Awaitable[Answer]]:
        async def serve(fence: ServiceFence) -> Answer:
            inner = dict(scope)
            inner[SCOPE_KEY] = fence
            # Every response must come through ``send`` as bytes, to be recorded.
            extensions = dict(inner.get("extensions") or {})
            extensions.pop("http.response.pathsend", None)
            extensions.pop("http.response.zerocopysend", None)
            inner["extensions"] = extensions
            response = _Captured()
            await self.app(inner, _replay_body(body, receive), response.send)
            status = response.status
            detail = f"HTTP {status}"
            if status >= 400:
                return Answer(response, commit=False, detail=f"{detail}: rolled back")
            return Answer(response, record=response.record(), detail=detail)

        return serve


class _Captured:
    """The app's response, held until the fenced transaction has committed."""

    def __init__(self) -> None:
        self.status = 500
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.started = False

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.started = True
            self.status = int(message["status"])
            self.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers") or ()]
        elif kind == "http.response.body":
            self.chunks.append(bytes(message.get("body", b"")))

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def record(self) -> dict[str, Any]:
        """The response as JSON, for replays (body as base64: any bytes)."""
        return {"status": self.status,
                "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in self.headers],
                "body": base64.b64encode(self.body).decode("ascii")}

    async def replay(self, send: Send) -> None:
        if not self.started:
            msg = "the app returned without sending a response"
            raise RuntimeError(msg)
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


async def _send_outcome(send: Send, outcome: Outcome) -> None:
    if isinstance(outcome, Applied | Declined):
        await outcome.value.replay(send)
    elif isinstance(outcome, Replayed):
        record = outcome.record
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in record["headers"]]
        headers.append((REPLAYED_HEADER.lower().encode(), b"true"))
        await send({"type": "http.response.start", "status": int(record["status"]),
                    "headers": headers})
        await send({"type": "http.response.body", "body": base64.b64decode(record["body"])})
    elif isinstance(outcome, Refused):
        await _send_problem(send, outcome.problem)


async def _send_problem(send: Send, problem: Problem) -> None:
    await _send_json(send, problem.status, problem.body(), CONTENT_TYPE)


async def _send_json(send: Send, status: int, body: Any, content_type: str) -> None:
    data = json.dumps(body, separators=(",", ":")).encode("utf-8")
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def _missing(scope: Scope, fences: Fences) -> tuple[str, ...]:
    missing = []
    if not fences.tokens:
        missing.append(FENCING_TOKEN_HEADER)
    if fences.idempotency_key is None and scope.get("method", "GET") not in SAFE_METHODS:
        missing.append(IDEMPOTENCY_KEY_HEADER)
    return tuple(missing)


#: Headers that say how the body is read: every line of each is part of the request's digest.
_BODY_HEADERS = (b"content-type", b"content-encoding")


def _body_headers(scope: Scope) -> str:
    """Every line of the body's headers, in order (an app may read the first or the last)."""
    lines = [[bytes(k).lower().decode("latin-1"), bytes(v).decode("latin-1")]
             for k, v in scope.get("headers") or () if bytes(k).lower() in _BODY_HEADERS]
    return json.dumps(lines, separators=(",", ":"))


async def _read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body; ``ToolGuardError`` past ``limit`` bytes or if the client left
    before sending all of it (a cut-off body is never handed to the app)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            msg = (f"the client disconnected after {size} byte(s) of the request body, "
                   f"before its end: nothing was run")
            raise ToolGuardError(msg, reason="request_incomplete")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            msg = f"the request body is larger than {limit} bytes"
            raise ToolGuardError(msg, reason="request_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the buffered body once, then the real channel (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _tool(scope: Scope) -> str:
    """``METHOD /raw/path`` for the audit log and the intent row (printable, bounded)."""
    raw = scope.get("raw_path") or scope.get("path", "").encode("utf-8", "replace")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else str(raw)
    method = "WEBSOCKET" if scope.get("type") == "websocket" else scope.get("method", "?")
    text = f"{method} {path}"
    return audit_name("".join(c if " " <= c <= "~" else "\ufffd" for c in text))
