"""httpx clients that send the current lease's fences with every request.

>>> from toolguard.fences import FencedClient
>>> http = FencedClient(base_url="https://crm.internal")
>>> @guarded(guard, agent="intent_scorer")
... def update_lead_score(lead_id: str, score: int) -> dict:
...     return http.post(f"/leads/{lead_id}/score", json={"score": score}).json()

Inside a guarded tool, every request gets ``Fencing-Token`` (each lock key of
the lease and its token), ``Toolguard-Agent`` and ``Toolguard-Intent``; an
unsafe method also gets ``Idempotency-Key`` (numbered per call, see
``toolguard.fences.outgoing``), unless the request sets one itself. A request
sent after the lease was lost raises ``LockLost`` before it leaves. A refusal
by a fenced service (an RFC 9457 problem naming a toolguard reason) raises the
typed error (``StaleFencingToken``, ``IdempotencyConflict``, ``InFlight``...), so
the guard audits the call as refused, not as applied; pass
``raise_refusals=False`` to get the response instead. Outside a guarded call a
request raises ``ToolGuardError`` (``no_context``): a fenced client never sends
unfenced.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import httpx

from toolguard.call.context import current
from toolguard.errors import ToolGuardError
from toolguard.fences.claims import FenceSigner, HeldLease, check_signer
from toolguard.fences.outgoing import outgoing_fences
from toolguard.fences.problems import CONTENT_TYPE, error_from_problem
from toolguard.fences.wire import (
    CLAIM_HEADER,
    IDEMPOTENCY_KEY_HEADER,
    SAFE_METHODS,
    decode_text,
)

__all__ = ["AsyncFencedClient", "FencedClient", "check_redirect", "fence_request",
           "raise_for_refusal"]


_SENT = "toolguard.fenced"  # request extension: (origin, id) of the request fenced here
_SIGNER = "toolguard.signer"  # request extension: the signer of a signed request (redirects)


def fence_request(request: httpx.Request, signer: FenceSigner | None = None) -> httpx.Request:
    """Add the current call's fence headers to ``request`` (in place); returns it.

    With ``signer``, ``Fencing-Claim`` too: signed from the lease in hand, for the
    signer's audience. A request that sets its own ``Idempotency-Key`` gets it signed.
    """
    own_key = IDEMPOTENCY_KEY_HEADER in request.headers
    unsafe = request.method.upper() not in SAFE_METHODS
    fences = outgoing_fences(idempotent=unsafe and not own_key)
    if own_key and signer is not None:
        fences = replace(fences, idempotency_key=decode_text(
            request.headers[IDEMPOTENCY_KEY_HEADER], field=IDEMPOTENCY_KEY_HEADER))
    if signer is not None:
        fences = signer.sign(fences, _lease())
    for name, value in fences.headers().items():
        if name == IDEMPOTENCY_KEY_HEADER and own_key:
            continue
        request.headers[name] = value
    _framing_last(request)
    request.extensions = {**request.extensions, _SENT: (_origin(request.url), id(request)),
                          _SIGNER: signer}
    return request


def _framing_last(request: httpx.Request) -> None:
    """Keep ``Transfer-Encoding`` after the fence headers: a service reads fence fields only
    before it (what follows may be a chunked body's trailers, see ``wire.parse_headers``)."""
    raw = request.headers.raw
    if not any(name.lower() == b"transfer-encoding" for name, _ in raw):
        return
    ordered = ([(n, v) for n, v in raw if n.lower() != b"transfer-encoding"]
               + [(n, v) for n, v in raw if n.lower() == b"transfer-encoding"])
    request.headers = httpx.Headers(ordered)


def _lease() -> HeldLease:
    lease = current().lease
    if lease is None:  # outgoing_fences refused a call without a lock already
        msg = "this call holds no lease: nothing to sign"
        raise ToolGuardError(msg, reason="no_fences")
    return lease


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    return (url.scheme, url.host, url.port)


def check_redirect(request: httpx.Request) -> None:
    """A redirect hop of a fenced request (httpx ``follow_redirects``), before it is sent.

    To another origin it is refused (``fenced_redirect``): the lease's tokens and the
    idempotency key are for the service the tool called, not for whoever it points at.
    Within the origin, a hop whose method became a safe one (``303`` after a ``POST``)
    drops ``Idempotency-Key``: the key names the write, and the service would refuse
    the read as that key reused for another request.
    """
    sent = request.extensions.get(_SENT)
    if sent is None or sent[1] == id(request):
        return
    if _origin(request.url) != sent[0]:
        msg = (f"a fenced request was redirected to another origin ({request.url.scheme}://"
               f"{request.url.host}): not followed, its fences are for the service it was sent to")
        raise ToolGuardError(msg, reason="fenced_redirect")
    if request.method.upper() in SAFE_METHODS and IDEMPOTENCY_KEY_HEADER in request.headers:
        request.headers.pop(IDEMPOTENCY_KEY_HEADER, None)
        if CLAIM_HEADER in request.headers:  # its claims named the key: signed again without it
            signer = request.extensions.get(_SIGNER)
            if signer is None:
                msg = "a signed request was redirected, and its client has no signer to re-sign it"
                raise ToolGuardError(msg, reason="fenced_redirect")
            fences = signer.sign(outgoing_fences(idempotent=False), _lease())
            request.headers[CLAIM_HEADER] = fences.headers()[CLAIM_HEADER]


async def _acheck_redirect(request: httpx.Request) -> None:
    check_redirect(request)


def _with_hook(hooks: Any, hook: Any) -> dict[str, list[Any]]:
    out = {name: list(found) for name, found in dict(hooks).items()}
    out["request"] = [*out.get("request", []), hook]
    return out


def _problem(response: httpx.Response) -> dict[str, Any] | None:
    if response.status_code < 400:
        return None
    if response.headers.get("content-type", "").split(";")[0].strip() != CONTENT_TYPE:
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def raise_for_refusal(response: httpx.Response) -> httpx.Response:
    """Raise the typed toolguard error if ``response`` is a fenced service's refusal."""
    body = _problem(response)
    if body is not None:
        error = error_from_problem(body)
        if error is not None:
            raise error
    return response


class FencedClient(httpx.Client):
    """An ``httpx.Client`` whose requests carry the running guarded call's fences.

    ``signer`` (a ``FenceSigner`` for the service's audience) signs them: the
    client of a service in signed mode needs one.
    """

    def __init__(self, *args: Any, raise_refusals: bool = True,
                 signer: FenceSigner | None = None, **kwargs: Any) -> None:
        self.signer = check_signer(signer, "FencedClient")
        super().__init__(*args, **kwargs)
        self.event_hooks = _with_hook(self.event_hooks, check_redirect)
        self.raise_refusals = raise_refusals

    def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        response = super().send(fence_request(request, self.signer), **kwargs)
        if self.raise_refusals and response.status_code >= 400:
            response.read()
            raise_for_refusal(response)
        return response


class AsyncFencedClient(httpx.AsyncClient):
    """The asyncio twin of ``FencedClient``."""

    def __init__(self, *args: Any, raise_refusals: bool = True,
                 signer: FenceSigner | None = None, **kwargs: Any) -> None:
        self.signer = check_signer(signer, "AsyncFencedClient")
        super().__init__(*args, **kwargs)
        self.event_hooks = _with_hook(self.event_hooks, _acheck_redirect)
        self.raise_refusals = raise_refusals

    async def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        response = await super().send(fence_request(request, self.signer), **kwargs)
        if self.raise_refusals and response.status_code >= 400:
            await response.aread()
            raise_for_refusal(response)
        return response
