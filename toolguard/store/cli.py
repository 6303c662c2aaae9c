"""``toolguard db``: install, upgrade and inspect the guarded store's schema.

Mounted by the main CLI as ``app.add_typer(db_app, name="db")``. Expected
failures print one line on stderr and exit with a code scripts can test:

    0  done / schema up to date
    1  ``status``: schema missing or older than this toolguard (run ``init``)
    2  bad URL or settings
    3  the database cannot be reached
    4  the database refused (permissions, a broken schema, ...)
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from toolguard.errors import BackendUnavailable, ConfigurationError, ToolGuardError

if TYPE_CHECKING:
    from toolguard.store import GuardedStore

__all__ = [
    "EXIT_BEHIND",
    "EXIT_CONFIG",
    "EXIT_REFUSED",
    "EXIT_UNREACHABLE",
    "BackendRefused",
    "classify_postgres_error",
    "db_app",
    "is_postgres_url",
    "open_cli_store",
    "probe_postgres",
    "redact",
    "resolve_store_url",
]

EXIT_BEHIND = 1
EXIT_CONFIG = 2
EXIT_UNREACHABLE = 3
EXIT_REFUSED = 4

db_app = typer.Typer(help="The guarded store's schema: install, upgrade, inspect.",
                     no_args_is_help=True)

UrlOption = Annotated[str | None, typer.Option(
    "--url", metavar="URL",
    help="Store URL (postgresql://... or sqlite:///...). Default: TOOLGUARD_DATABASE_URL, else the "
         "embedded SQLite file (./.toolguard/store.db).", show_default=False)]
SchemaOption = Annotated[str | None, typer.Option(
    "--schema", metavar="SCHEMA",
    help="PostgreSQL schema holding toolguard's tables (created by init). Default: the search_path.",
    show_default=False)]
TimeoutOption = Annotated[float, typer.Option(
    "--timeout", min=0.1, metavar="SECONDS",
    help="Seconds to wait for a server before giving up (exit 3).")]


def resolve_store_url(url: str | None) -> str:
    """``url``, else ``TOOLGUARD_DATABASE_URL``, else the embedded SQLite file."""
    if url:
        return url
    from toolguard.config import Settings

    return Settings().resolved_store_url()


def redact(url: str) -> str:
    """The URL without its password, for messages (needs no database driver)."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", url)


_shown = redact


@contextmanager
def _failures(url: str) -> Iterator[None]:
    """Expected failures become one line on stderr and an exit code; no traceback."""
    shown = _shown(url)
    try:
        yield
    except ConfigurationError as error:
        typer.echo(f"error: {shown}: {error}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    except BackendUnavailable as error:
        typer.echo(f"error: cannot connect to the store at {shown}: {error}", err=True)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    except BackendRefused as error:
        typer.echo(f"error: {shown}: {error}", err=True)
        raise typer.Exit(EXIT_REFUSED) from None
    except ToolGuardError as error:
        typer.echo(f"error: {error.reason}: {error}", err=True)
        raise typer.Exit(EXIT_REFUSED) from None
    except Exception as error:  # a database error we did not map: still no traceback
        typer.echo(f"error: the store at {_shown(url)} refused: {type(error).__name__}: "
                   f"{str(error).strip()}", err=True)
        raise typer.Exit(EXIT_REFUSED) from None


class BackendRefused(ToolGuardError):
    """The server answered and said no (unknown role or database, bad password, no SSL)."""

    reason = "backend_refused"


#: libpq's words for a connection string it cannot use: the URL is wrong (exit 2).
_URL_MISTAKES = ("invalid uri", "invalid connection option", "invalid sslmode", "invalid value for",
                 "invalid integer value", "invalid percent-encoded", "missing \"=\"",
                 "unterminated quoted string", "invalid port")
#: A server that answers FATAL for these may take the connection a moment later (exit 3).
_PASSING = ("starting up", "shutting down", "in recovery", "too many connections",
            "remaining connection slots", "not yet accepting connections")


def is_postgres_url(url: str) -> bool:
    return url.startswith(("postgresql:", "postgres:"))


def probe_postgres(url: str, timeout: float = 5.0) -> None:
    """One direct connection attempt, before any pool is made, so a mistake fails at once.

    A pool retries every failure until its timeout; a wrong database, role,
    password or ``sslmode`` never gets better, so it is classified here from
    the server's (or libpq's) answer: ``ConfigurationError`` for a URL libpq
    cannot use, ``BackendRefused`` for a server that said no,
    ``BackendUnavailable`` for one that did not answer. One line each.
    """
    from toolguard.extras import require

    require("postgres", "the PostgreSQL backend")
    import psycopg

    try:
        psycopg.connect(url, connect_timeout=max(1, round(timeout)), autocommit=True).close()
    except psycopg.Error as error:
        raise classify_postgres_error(error) from None


def classify_postgres_error(error: Exception) -> ToolGuardError:
    """A connection failure as the toolguard error (and so the exit code) it deserves.

    The message is one line and does not repeat the URL: the caller names it.
    """
    text = " ".join(str(error).split())
    lowered = text.lower()
    if "fatal:" in lowered:
        said = text[lowered.index("fatal:") + len("fatal:"):].strip()
        if any(word in lowered for word in _PASSING):
            return BackendUnavailable(f"the server is not taking connections yet: {said}")
        return BackendRefused(f"the server refused the connection: {said}")
    if "ssl was required" in lowered or "does not support ssl" in lowered:
        return BackendRefused("the server refused the connection: it does not support SSL, but the "
                              "URL's sslmode requires it")
    if any(word in lowered for word in _URL_MISTAKES):
        detail = text.removeprefix("connection is bad:").strip()
        return ConfigurationError(f"not a usable PostgreSQL URL: {detail}")
    detail = text.removeprefix("connection failed:").strip()
    return BackendUnavailable(f"no answer: {detail}")


def open_cli_store(url: str, schema: str | None = None, timeout: float = 5.0,
                   *, install: bool = False, create: bool = True) -> GuardedStore:
    """A store for one short command: a probe that fails at once, then a small, quiet pool.

    ``create=False`` (read-only commands) refuses to create the embedded SQLite
    file where there is none: it raises ``schema_not_installed`` instead.
    """
    from toolguard.store import open_store

    if not create and _missing_sqlite_file(url, schema):
        raise ToolGuardError("no toolguard store here yet (the file does not exist): run "
                             "`toolguard demo` or `toolguard db init`, or pass --url",
                             reason="schema_not_installed")

    # The pool logs every failed connection attempt; the command reports the failure itself.
    logging.getLogger("psycopg.pool").setLevel(logging.CRITICAL)

    options: dict[str, object] = {}
    if is_postgres_url(url):
        probe_postgres(url, timeout)
        options = {"schema": schema, "timeout_s": timeout, "min_size": 0, "max_size": 2}
    elif schema:
        msg = "--schema only applies to PostgreSQL"
        raise ConfigurationError(msg)
    return open_store(url, install=install, **options)


def _missing_sqlite_file(url: str, schema: str | None) -> bool:
    """``status`` must not create the embedded database file just to say it is empty."""
    if not url.startswith("sqlite:") or schema:
        return False
    from toolguard.locks import sqlite_path

    return not Path(sqlite_path(url)).exists()


@db_app.command("init")
def init(url: UrlOption = None, schema: SchemaOption = None, timeout: TimeoutOption = 10.0) -> None:
    """Install the schema, or upgrade it to this toolguard's version. Safe to repeat."""
    target = resolve_store_url(url)
    with _failures(target):
        store = open_cli_store(target, schema, timeout)
        try:
            before = store.schema_version()
            after = store.install()
        finally:
            store.close()
    where = f"{_shown(target)}" + (f" (schema {schema})" if schema else "")
    if before == after:
        typer.echo(f"schema already at version {after} in {where}")
    else:
        typer.echo(f"schema upgraded from version {before} to {after} in {where}")


@db_app.command("status")
def status(url: UrlOption = None, schema: SchemaOption = None,
           timeout: TimeoutOption = 10.0) -> None:
    """Show the installed schema version; exit 1 if it is missing or behind."""
    from toolguard.store import latest_version

    target = resolve_store_url(url)
    with _failures(target):
        store = None if _missing_sqlite_file(target, schema) else open_cli_store(target, schema, timeout)
        try:
            installed = store.schema_version() if store is not None else 0
        finally:
            if store is not None:
                store.close()
        latest = latest_version("sqlite" if target.startswith("sqlite:") else "postgresql")
    where = f"{_shown(target)}" + (f" (schema {schema})" if schema else "")
    if installed == 0:
        typer.echo(f"not installed in {where}; run `toolguard db init`")
        raise typer.Exit(EXIT_BEHIND)
    if installed < latest:
        typer.echo(f"schema version {installed} in {where}, {latest} available; "
                   f"run `toolguard db init`")
        raise typer.Exit(EXIT_BEHIND)
    newer = f" (newer than this toolguard's {latest})" if installed > latest else ""
    typer.echo(f"schema version {installed}{newer} in {where}")
