"""A connection error that no retry can fix is a configuration mistake, not an outage.

A typo in a URL (a database that does not exist, a wrong password or user, a
host name DNS does not know, a Redis database index past the server's
``databases``) fails the same way on every attempt. Typed as
``BackendUnavailable`` ("temporarily down") it sends retry loops round forever
and makes a pool wait out its timeout, logging each attempt. ``definitive(error)``
says why such an error is final (else None); every backend that connects
(PostgreSQL store and locks, Redis locks and quotas, etcd) raises
``misconfigured(...)``, a ``ConfigurationError``, for it at once and keeps
``BackendUnavailable`` for what may pass: refused or timed-out connections, a
server starting up or shutting down, too many connections, a DNS server that
did not answer (``EAI_AGAIN``).

Decided from the error's type, errno and text (libpq, redis-py and the
resolver give no code for these): a message this module does not know
stays transient. Pure: no I/O.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from typing import Any

from toolguard.errors import BackendUnavailable, ConfigurationError, ToolGuardError
from toolguard.runtime.safe_text import text_of

__all__ = ["definitive", "failure", "misconfigured", "postgres_probe_options", "redacted_url",
           "refuse_misconfigured"]

#: Server and libpq answers to a connection attempt that name a setup mistake.
_FINAL_TEXTS = re.compile(
    r"database \"[^\"]*\" does not exist"            # PostgreSQL 3D000
    r"|role \"[^\"]*\" does not exist"               # 28000
    r"|password authentication failed"               # 28P01
    r"|no pg_hba\.conf entry"                        # 28000
    r"|fe_sendauth: no password supplied"
    r"|SCRAM authentication requires"
    r"|server does not support SSL, but SSL was required"
    r"|invalid connection option"
    r"|invalid (?:integer|sslmode) value"
    r"|invalid username-password pair"               # Redis 6+ AUTH / HELLO
    r"|WRONGPASS"
    r"|NOAUTH Authentication required"
    r"|invalid password"                             # Redis before 6
    r"|AUTH <password> called without any password configured"
    r"|DB index is out of range"                     # SELECT past `databases`
    r"|Name or service not known"                    # EAI_NONAME: the name does not exist
    r"|nodename nor servname provided, or not known"
    r"|No address associated with hostname",
    re.IGNORECASE)

#: ``getaddrinfo`` answers that mean "this name does not exist" (not "ask again later").
_NO_SUCH_NAME = {socket.EAI_NONAME} | ({socket.EAI_NODATA} if hasattr(socket, "EAI_NODATA")
                                       else set())


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and its causes (``raise ... from``, and the one it was raised while handling)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen and len(seen) < 16:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def definitive(error: BaseException) -> str | None:
    """Why ``error`` is a setup mistake no retry fixes (a short reason), or None: may pass."""
    for link in _chain(error):
        if isinstance(link, socket.gaierror) and link.errno in _NO_SUCH_NAME:
            return "the host name does not resolve"
        found = _FINAL_TEXTS.search(text_of(link, 2_000))
        if found is not None:
            return found.group(0)
    return None


def misconfigured(backend: str, where: str, error: BaseException, why: str) -> ConfigurationError:
    """The ``ConfigurationError`` for a definitive connection error (``where``: a redacted URL)."""
    texts = (" ".join(text_of(link, 500).split()) for link in _chain(error))
    detail = next((text for text in texts if text), type(error).__name__)
    place = f" {where}" if where else ""
    msg = (f"{backend}{place}: {why}: a configuration error, not an outage (retrying will not "
           f"help): check the URL, credentials and database ({detail})")
    return ConfigurationError(msg)


def refuse_misconfigured(backend: str, error: BaseException, where: str = "") -> None:
    """Raise ``misconfigured(...)`` if ``error`` is definitive; else return (the caller re-raises)."""
    why = definitive(error)
    if why is not None:
        raise misconfigured(backend, where, error, why) from error


def failure(backend: str, error: BaseException, where: str = "") -> ToolGuardError:
    """A connection error as toolguard types it: ``ConfigurationError`` if definitive, else
    ``BackendUnavailable`` (the server may come back)."""
    why = definitive(error)
    if why is not None:
        return misconfigured(backend, where, error, why)
    return BackendUnavailable(f"{backend}: {text_of(error, 2_000)}")


def postgres_probe_options(options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Options of the one direct connection a PostgreSQL backend makes before its pool.

    Short: a server that is down or slow is not a verdict (the pool deals with it);
    only an answer is.
    """
    return {**(options or {}), "connect_timeout": 2, "autocommit": True}


def redacted_url(url: str) -> str:
    """``url`` without its password (``redis://:***@host``), for messages."""
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)
