"""``toolguard serve``: the review page, read-only, over the store ``toolguard audit`` reads.

It listens on 127.0.0.1 unless told otherwise, and refuses any address that is
not loopback without an access token (``--token`` or ``TOOLGUARD_REVIEW_TOKEN``);
with a token, every page needs it. Needs the ``review`` extra.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from toolguard.cli._common import (
    EXIT_FAILED,
    EXIT_USAGE,
    SchemaOption,
    TimeoutOption,
    UrlOption,
    console,
    fail,
    failures,
    open_cli_store,
    redact,
    resolve_store_url,
)
from toolguard.cli.db import _missing_sqlite_file
from toolguard.runtime.extras import install_hint

if TYPE_CHECKING:
    from toolguard.review import PolicySource

__all__ = ["DEFAULT_PORT", "TOKEN_ENV", "serve"]

DEFAULT_PORT = 8765
TOKEN_ENV = "TOOLGUARD_REVIEW_TOKEN"


def serve(
    host: Annotated[str, typer.Option(
        "--host", metavar="ADDRESS",
        help="Address to listen on. Anything but loopback (127.0.0.1, ::1, localhost) needs "
             "--token.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(
        "--port", "-p", min=0, max=65535, metavar="PORT",
        help="Port to listen on (0: any free port; the address is printed).")] = DEFAULT_PORT,
    token: Annotated[str | None, typer.Option(
        "--token", metavar="TOKEN", envvar=TOKEN_ENV, show_envvar=True,
        help="Access token (16 characters or more): every page then needs it, as "
             "'Authorization: Bearer TOKEN' or via the login form. Required off loopback.",
        show_default=False)] = None,
    policy: Annotated[list[Path] | None, typer.Option(
        "--policy", metavar="FILE", exists=True, readable=True,
        help="Policy file or folder: each decision's page then shows its rule at file:line. "
             "Repeatable.", show_default=False)] = None,
    url: UrlOption = None, schema: SchemaOption = None, timeout: TimeoutOption = 5.0,
) -> None:
    """Serve the review page: rejected intents first, filters, one page per decision, charts.

    Read-only: the page only queries the audit log. Stop it with Ctrl-C.
    """
    try:
        import uvicorn

        from toolguard.review import MIN_TOKEN_LENGTH, PolicySource, create_app, is_loopback
    except ImportError as error:
        fail(f"toolguard serve needs the review extra ({error.name} is missing): {install_hint('review')}",
              EXIT_USAGE)

    token = token or None
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        fail(f"--token needs at least {MIN_TOKEN_LENGTH} characters (e.g. python -c "
              f"'import secrets; print(secrets.token_urlsafe())')", EXIT_USAGE)
    addresses = _addresses(host, port)
    if token is None and not all(is_loopback(address[4][0]) for address in addresses):
        fail(f"{host} is not a loopback address: anyone who reaches it could read the audit "
              f"log. Give an access token (--token or {TOKEN_ENV}), or listen on 127.0.0.1.",
              EXIT_USAGE)

    source: PolicySource | None = None
    if policy:
        with failures("--policy"):
            source = PolicySource(policy)

    target = resolve_store_url(url)
    shown = redact(target)
    if _missing_sqlite_file(target, schema):
        fail(f"no audit log at {shown} yet: run `toolguard demo`, or point --url (or "
              f"TOOLGUARD_DATABASE_URL) at your store", EXIT_USAGE)
    with failures(shown):
        store = open_cli_store(target, schema, timeout)
        try:
            installed = store.schema_version()
        except BaseException:
            store.close()
            raise
    if installed == 0:
        store.close()
        fail(f"the toolguard schema is not installed in {shown}: run `toolguard db init`",
              EXIT_FAILED)

    try:
        listener = _listen(addresses)
    except BaseException:
        store.close()
        raise
    try:
        app = create_app(store, policy=source, token=token, store_label=shown,
                         allowed_hosts=() if _is_ip(host) else (host,))
        bound = listener.getsockname()
        where = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        out = console()
        out.print(f"toolguard review: http://{where}:{bound[1]}/ (read-only) · store {shown}"
                  + (f" · policy {source.label}" if source else ""), markup=False, soft_wrap=True)
        if token:
            out.print("Every page needs the access token: enter it on the page, or send "
                      "'Authorization: Bearer TOKEN'.", markup=False, soft_wrap=True)
        out.print("Ctrl-C stops it.", style="dim", markup=False)
        # No access log: a login URL carries the token. Forwarded headers are trusted from
        # loopback only (uvicorn's default), so a local TLS proxy can mark the cookie Secure.
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                server_header=False)
        uvicorn.Server(config).run(sockets=[listener])
    finally:
        listener.close()
        store.close()


def _addresses(host: str, port: int) -> list[tuple[Any, ...]]:
    try:
        found = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        fail(f"--host {host}: {error.strerror}", EXIT_USAGE)
    if not found:
        fail(f"--host {host}: no address", EXIT_USAGE)
    return found


def _listen(addresses: list[tuple[Any, ...]]) -> socket.socket:
    """A listening socket on the first address that works (so the printed port is the real one)."""
    errors = []
    for family, kind, proto, _, address in addresses:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(128)
        except OSError as error:
            sock.close()
            errors.append(f"{address[0]} port {address[1]}: {error.strerror or error}")
            continue
        return sock
    fail(f"cannot listen on {'; '.join(errors)}", EXIT_USAGE)


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True
