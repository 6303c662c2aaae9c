"""The review page's guards: who may read it, from which host name, under which headers.

The audit log holds what models sent, so the page treats every value as
hostile and the server as something a browser on the same machine could be
tricked into reading. Three small ASGI layers, outermost first:

- ``SecurityHeaders``: a strict Content-Security-Policy (no script at all, styles
  and images from this server only, no framing) and friends on every response,
  errors included: an exception the page did not expect becomes a plain 500
  with the same headers, never the server's bare one.
- ``Unambiguous``: a request with two ``Host`` headers (or two ``Authorization``
  headers) is a 400 (RFC 9110): no layer may read one and another the other.
- ``ReadOnly``: GET and HEAD only, on every path.
- ``TokenGate``: with an access token, every page needs it, as
  ``Authorization: Bearer TOKEN`` or the cookie that ``/login?token=TOKEN`` sets.
- ``LoopbackHosts``: without a token, only requests addressed to a loopback name
  are answered, so a web page that rebinds its own DNS name to 127.0.0.1 cannot
  read the log through the visitor's browser.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Iterable
from html import escape
from http.cookies import SimpleCookie
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from toolguard.errors import ConfigurationError

__all__ = [
    "AMBIGUOUS_HEADERS",
    "CONTENT_SECURITY_POLICY",
    "COOKIE_NAME",
    "MIN_TOKEN_LENGTH",
    "LoopbackHosts",
    "ReadOnly",
    "SecurityHeaders",
    "TokenGate",
    "Unambiguous",
    "check_token",
    "cookie_value",
    "is_loopback",
]

#: No script, no plugin, no frame; styles, images and forms only from this server.
CONTENT_SECURITY_POLICY = ("default-src 'none'; style-src 'self'; img-src 'self'; "
                           "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
)

#: Headers a request may carry once at most: which one a layer reads must not matter.
AMBIGUOUS_HEADERS = (b"host", b"authorization")

log = logging.getLogger("toolguard.review")

COOKIE_NAME = "toolguard_review"
#: Shorter tokens are refused: the token is the only thing between the network and the log.
MIN_TOKEN_LENGTH = 16
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """True for a loopback IP literal (127.0.0.0/8, ::1) or the name ``localhost``."""
    name = host.strip().strip("[]").lower()
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_token(token: str) -> None:
    """Raise ``ConfigurationError`` for a token too short (or not text) to protect the log."""
    if not isinstance(token, str) or len(token) < MIN_TOKEN_LENGTH:
        msg = f"the review page's access token needs at least {MIN_TOKEN_LENGTH} characters"
        raise ConfigurationError(msg)


def cookie_value(token: str) -> str:
    """What the login cookie holds: derived from the token, so the cookie never is the token."""
    return hmac.new(token.encode(), b"toolguard review session", hashlib.sha256).hexdigest()


class SecurityHeaders:
    """Adds the CSP and the other hardening headers to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        started = False

        async def send_with_headers(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                present = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(name, value) for name, value in _HEADERS if name not in present]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        except Exception:  # a bug or a dead store mid-page: logged here, never a bare 500
            log.exception("the review page failed on %s", scope.get("path", "")[:200])
            if started:  # the status line is out: the server closes the connection
                return
            await _plain(send_with_headers, 500, "The review page failed on this request; "
                         "the server's log says why.")


class Unambiguous:
    """Refuses a request that carries a header of ``AMBIGUOUS_HEADERS`` twice (400)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            names = [key.lower() for key, _ in scope.get("headers", [])]
            twice = [n for n in AMBIGUOUS_HEADERS if names.count(n) > 1]
            if twice:
                await _plain(send, 400, f"Two {twice[0].decode().title()} headers: the request "
                                        f"is ambiguous (RFC 9110).")
                return
        await self.app(scope, receive, send)


class ReadOnly:
    """Refuses every method but GET and HEAD, whatever the route: the page changes nothing."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") not in ("GET", "HEAD"):
            await _plain(send, 405, "The review page is read-only: GET and HEAD only.",
                         [(b"allow", b"GET, HEAD")])
            return
        await self.app(scope, receive, send)


class LoopbackHosts:
    """Answers only requests whose ``Host`` is a loopback name (or one of ``extra``)."""

    def __init__(self, app: ASGIApp, *, extra: Iterable[str] = ()) -> None:
        self.app = app
        self.extra = frozenset(name.strip("[]").lower() for name in extra)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = _host_name(_header(scope, b"host"))
        if not host or not (is_loopback(host) or host in self.extra):
            await _plain(send, 421, "This page answers only to a loopback address such as "
                                    "127.0.0.1 (start it with --token to serve other names).")
            return
        await self.app(scope, receive, send)


class TokenGate:
    """Every request needs the token (Bearer header or login cookie); ``/static/`` is public."""

    def __init__(self, app: ASGIApp, *, token: str) -> None:
        check_token(token)
        self.app = app
        self.token = token
        self.cookie = cookie_value(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):  # mounted under a prefix: match our own routes
            path = path[len(root):]
        if path.startswith("/static/"):
            await self.app(scope, receive, send)
            return
        if path == "/login":
            await self._login(scope, send)
            return
        if self._allowed(scope):
            await self.app(scope, receive, send)
            return
        await _login_page(send, scope, 401, "This review page needs its access token.")

    def _allowed(self, scope: Scope) -> bool:
        bearer = _header(scope, b"authorization")
        if bearer[:7].lower() == "bearer " and _same(bearer[7:].strip(), self.token):
            return True
        cookies = SimpleCookie()
        try:
            cookies.load(_header(scope, b"cookie"))
        except Exception:  # a malformed Cookie header is no cookie
            return False
        morsel = cookies.get(COOKIE_NAME)
        return morsel is not None and _same(morsel.value, self.cookie)

    async def _login(self, scope: Scope, send: Send) -> None:
        given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [""])[0]
        if not _same(given, self.token):
            await _login_page(send, scope, 401, "That token is not this page's access token."
                              if given else "This review page needs its access token.")
            return
        secure = "; Secure" if scope.get("scheme") == "https" else ""
        root = scope.get("root_path", "")
        cookie = f"{COOKIE_NAME}={self.cookie}; Path={root or '/'}; HttpOnly; SameSite=Lax{secure}"
        await send({"type": "http.response.start", "status": 303,
                    "headers": [(b"location", f"{root}/".encode()), (b"set-cookie", cookie.encode()),
                                (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())


def _header(scope: Scope, name: bytes) -> str:
    headers: Iterable[tuple[bytes, bytes]] = scope.get("headers", [])
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return ""


def _host_name(host: str) -> str:
    """``Host`` without its port: ``127.0.0.1:8765`` -> ``127.0.0.1``, ``[::1]:80`` -> ``::1``.

    Anything after the name but ``:`` and a numeric port (``[::1].evil.com``,
    ``127.0.0.1:80@evil.com``) makes it no host at all ("", which no check accepts).
    """
    host = host.strip().lower()
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        return name if _port_only(rest) else ""
    if host.count(":") == 1:
        name, _, port = host.partition(":")
        return name if _port_only(":" + port) else ""
    return host


def _port_only(rest: str) -> bool:
    """True for "" or ``:`` followed by 1 to 5 digits."""
    return rest == "" or (rest.startswith(":") and rest[1:].isascii() and rest[1:].isdigit()
                          and len(rest) <= 6)


async def _plain(send: Send, status: int, text: str,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = text.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def _login_page(send: Send, scope: Scope, status: int, why: str) -> None:
    """A form that sends the token to ``/login`` (GET: the page has no state to change)."""
    root = escape(scope.get("root_path", ""))
    body = (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<title>toolguard review: log in</title>'
            f'<link rel="stylesheet" href="{root}/static/review.css"></head><body>'
            f'<main class="login"><h1>toolguard review</h1><p>{escape(why)}</p>'
            f'<form action="{root}/login" method="get"><label>Access token '
            f'<input type="password" name="token" autocomplete="current-password" required>'
            f'</label> <button type="submit">Log in</button></form></main></body></html>').encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/html; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b'Bearer realm="toolguard review"')]})
    await send({"type": "http.response.body", "body": body})
