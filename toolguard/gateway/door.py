"""The gateway's HTTP door: which requests reach MCP at all.

A gateway listening on HTTP answers only requests addressed to it by its own
names, from no foreign web page, with a credential when it has any:

- **Host and Origin** (DNS rebinding): FastMCP's own guard, in its strict mode,
  serves only the listen address and the loopback names (``localhost``,
  ``127.0.0.1``, ``[::1]``) in ``Host`` plus the names given with
  ``--allow-host``, and refuses an ``Origin`` that is not the request's own
  origin, a loopback one on a loopback ``Host``, or one given with
  ``--allow-origin`` (421 and 403, before any MCP processing).
- **Credentials**: with tokens or OAuth configured (``Identity``), FastMCP's
  bearer-token middleware answers 401 with ``WWW-Authenticate`` before
  ``initialize``, ``tools/list`` or any call.

A refused request decided nothing, so it leaves no audit row: ``DoorWatch``
counts it (the ``toolguard.gateway.refused_requests`` metric) and logs a line
at most every ``LOG_EVERY_S`` seconds, so a burst costs a counter increment
per request, not a database write.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toolguard.errors import GuardMisconfigured
from toolguard.runtime import telemetry

if TYPE_CHECKING:
    from fastmcp import FastMCP
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["HOSTS_ENV", "MCP_PATH", "ORIGINS_ENV", "Door", "DoorWatch", "is_loopback", "split_list"]

log = logging.getLogger("toolguard.gateway")

#: Where the gateway serves MCP.
MCP_PATH = "/mcp"
#: Environment variables of ``--allow-host`` and ``--allow-origin`` (comma-separated).
HOSTS_ENV = "TOOLGUARD_GATEWAY_ALLOWED_HOSTS"
ORIGINS_ENV = "TOOLGUARD_GATEWAY_ALLOWED_ORIGINS"
#: At most one log line per this many seconds about refused requests (each is counted).
LOG_EVERY_S = 10.0
#: FastMCP's loggers that write a line per refused credential: ``DoorWatch`` sums them up.
_PER_REQUEST_LOGGERS = ("fastmcp.server.auth.middleware", "mcp.server.auth.middleware.bearer_auth")
#: The statuses only the door answers with: FastMCP's Host guard (421), its Origin guard
#: (403) and the bearer-token middleware (401); MCP itself answers none of them.
_REFUSALS = {421: "host", 403: "origin", 401: "credential"}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, without port) is this machine's loopback."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Door:
    """Where the gateway listens and which other names and origins it answers.

    ``allowed_hosts``: more ``Host`` names (a gateway behind a reverse proxy or
    reached by a DNS name; ``*.example.com`` patterns work); ``allowed_origins``:
    browser origins allowed to call it (``https://app.example.com``).
    ``resource_url``: the gateway's public URL of ``/mcp`` (what OAuth clients
    and the protected-resource metadata name), by default ``http://HOST:PORT/mcp``.
    """

    host: str
    port: int
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    resource_url: str | None = None

    def __post_init__(self) -> None:
        for origin in self.allowed_origins:
            if origin != "*" and "://" not in origin:
                msg = f"--allow-origin takes an origin such as https://app.example.com, got {origin!r}"
                raise GuardMisconfigured(msg)
        if "*" in self.allowed_hosts or "*" in self.allowed_origins:
            log.warning("the gateway answers every Host or Origin (*): a web page that rebinds "
                        "its name to this address can call it through a visitor's browser")

    @property
    def url(self) -> str:
        """The gateway's public URL of ``/mcp``."""
        if self.resource_url:
            return self.resource_url
        where = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{where}:{self.port}{MCP_PATH}"

    def hosts(self) -> list[str]:
        """The ``Host`` names served besides the loopback ones (FastMCP adds those)."""
        unspecified = self.host in ("0.0.0.0", "::", "")  # FastMCP adds the address reached
        names = [*([] if unspecified else [self.host]), *self.allowed_hosts]
        if self.resource_url:
            from urllib.parse import urlsplit

            public = urlsplit(self.resource_url).hostname
            if public:
                names.append(public)
        return names

    def app(self, server: FastMCP) -> ASGIApp:
        """The ASGI app: FastMCP's streamable-HTTP app behind its strict Host/Origin guard."""
        app = server.http_app(path=MCP_PATH, transport="http", host_origin_protection=True,
                              allowed_hosts=self.hosts(),
                              allowed_origins=list(self.allowed_origins))
        for name in _PER_REQUEST_LOGGERS:  # one line per refused request is no summary
            logging.getLogger(name).setLevel(logging.WARNING)
        return DoorWatch(app)

    async def serve(self, server: FastMCP, *, log_level: str = "warning") -> None:
        """Serve ``server`` on this door until cancelled (Ctrl-C)."""
        import uvicorn

        config = uvicorn.Config(self.app(server), host=self.host, port=self.port,
                                log_level=log_level, lifespan="on", timeout_graceful_shutdown=2)
        await uvicorn.Server(config).serve()


def split_list(values: Sequence[str] | None) -> tuple[str, ...]:
    """Repeated options and comma-separated environment values, as one tuple."""
    return tuple(part.strip() for value in values or () for part in value.split(",")
                 if part.strip())


class DoorWatch:
    """Counts and logs the requests the door refused, around the whole app.

    Nothing was decided for such a request, so it is no audit row; a burst of
    them costs one counter increment each and a log line every ``every_s``.
    """

    def __init__(self, app: ASGIApp, *, every_s: float = LOG_EVERY_S) -> None:
        self.app = app
        self.every_s = every_s
        self._counts: Counter[str] = Counter()
        self._next_log = 0.0
        self._lifespan = getattr(app, "lifespan", None)

    @property
    def lifespan(self) -> Any:
        """The wrapped app's lifespan (for servers that read it from the app)."""
        return self._lifespan

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                reason = _REFUSALS.get(message["status"])
                if reason is not None:
                    self.refused(reason, scope)
            await send(message)

        await self.app(scope, receive, watched)

    def refused(self, reason: str, scope: Scope) -> None:
        """Count one refused request; log what was refused since the last line, if it is time."""
        telemetry.door_refused(reason)
        self._counts[reason] += 1
        now = time.monotonic()
        if now < self._next_log:
            return
        self._next_log = now + self.every_s
        counts = ", ".join(f"{count} {name}" for name, count in sorted(self._counts.items()))
        self._counts.clear()
        headers = {k.lower(): v for k, v in scope.get("headers", ())
                   if k.lower() in (b"host", b"origin")}
        shown = " ".join(f"{name.decode()}={_shown(value)}" for name, value in headers.items())
        log.warning("toolguard gateway: refused at the door (%s); last: %s %s %s", counts,
                    scope.get("method", "?"), _shown(scope.get("path", "").encode()), shown)


def _shown(value: bytes) -> str:
    """A header value as a short, printable, quoted text (it is the caller's to write)."""
    return repr(value.decode("latin-1")[:80])
