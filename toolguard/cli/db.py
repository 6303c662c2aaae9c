"""``toolguard db``: install, upgrade and inspect the guarded store's schema.

Mounted by the main CLI as ``app.add_typer(db_app, name="db")``. Expected
failures print one line on stderr and exit with a code scripts can test:

    0  done / schema up to date
    1  ``status``: schema missing or older than this toolguard (run ``init``)
    2  bad URL or settings
    3  the database cannot be reached
    4  the database refused (permissions, a broken schema, ...)

When the lock backend is PostgreSQL, its tables (``toolguard_lock_*``) are
installed and inspected beside the store's. The lock URL is found as at run
time: ``--lock-url``, else ``TOOLGUARD_LOCK_URL``, else ``TOOLGUARD_REDIS_URL``,
else the embedded SQLite file; never the store's own database unless the lock
URL names it. Other lock backends have no schema to install: nothing is said
about them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from toolguard.errors import BackendUnavailable, ConfigurationError, ToolGuardError
from toolguard.runtime.connection_errors import redacted_url as redact

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
    "resolve_lock_url",
    "resolve_store_url",
]

EXIT_BEHIND = 1
EXIT_CONFIG = 2
EXIT_UNREACHABLE = 3
EXIT_REFUSED = 4

db_app = typer.Typer(help="The guarded store's schema (and the PostgreSQL lock backend's tables): "
                          "install, upgrade, inspect.\n\nThe lock backend is the one the guard "
                          "uses: --lock-url, else TOOLGUARD_LOCK_URL, else TOOLGUARD_REDIS_URL, "
                          "else the embedded SQLite file. Only a PostgreSQL lock backend has tables "
                          "to install; Redis, etcd and SQLite locks need nothing.",
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
LockUrlOption = Annotated[str | None, typer.Option(
    "--lock-url", metavar="URL",
    help="Lock backend URL. Default: TOOLGUARD_LOCK_URL, else TOOLGUARD_REDIS_URL, else the embedded "
         "SQLite file. A postgresql:// lock backend gets its tables (toolguard_lock_*) installed "
         "and checked too; other backends need nothing.", show_default=False)]
LockSchemaOption = Annotated[str | None, typer.Option(
    "--lock-schema", metavar="SCHEMA",
    help="PostgreSQL schema of the lock tables, as passed to connect(url, schema=...) (created by "
         "init). Default: the search_path. Independent of --schema.", show_default=False)]


def resolve_lock_url(url: str | None) -> str:
    """``url``, else the lock URL the guard would use (``Settings.resolved_lock_url``)."""
    if url:
        return url
    from toolguard.config import Settings

    return Settings().resolved_lock_url()


def resolve_store_url(url: str | None) -> str:
    """``url``, else ``TOOLGUARD_DATABASE_URL``, else the embedded SQLite file."""
    if url:
        return url
    from toolguard.config import Settings

    return Settings().resolved_store_url()




_shown = redact


@contextmanager
def _failures(url: str, what: str = "store") -> Iterator[None]:
    """Expected failures become one line on stderr and an exit code; no traceback.

    ``what`` names the server in the message: the store, or the lock server.
    """
    shown = _shown(url)
    try:
        yield
    except ConfigurationError as error:
        typer.echo(f"error: {shown}: {error}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    except BackendUnavailable as error:
        typer.echo(f"error: cannot connect to the {what} at {shown}: {error}", err=True)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    except BackendRefused as error:
        typer.echo(f"error: {shown}: {error}", err=True)
        raise typer.Exit(EXIT_REFUSED) from None
    except ToolGuardError as error:
        typer.echo(f"error: {error.reason}: {error}", err=True)
        raise typer.Exit(EXIT_REFUSED) from None
    except Exception as error:  # a database error we did not map: still no traceback
        typer.echo(f"error: the {what} at {_shown(url)} refused: {type(error).__name__}: "
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
    from toolguard.runtime.extras import require

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


def _where(url: str, schema: str | None) -> str:
    return f"{_shown(url)}" + (f" (schema {schema})" if schema else "")


def _postgres_locks(lock_url: str, lock_schema: str | None) -> bool:
    """Whether the lock backend has tables to install; ``--lock-schema`` needs one that does."""
    if is_postgres_url(lock_url):
        return True
    if lock_schema:
        msg = f"--lock-schema only applies to a PostgreSQL lock backend, not {_shown(lock_url)}"
        raise ConfigurationError(msg)
    return False


def _lock_versions(lock_url: str, lock_schema: str | None, timeout: float, *,
                   install: bool) -> tuple[int, int]:
    """The lock schema version before, and after an install if ``install``."""
    from toolguard.runtime.extras import require

    require("postgres", "the PostgreSQL lock backend")
    from toolguard.locks.postgres import check_schema_name, install_lock_schema, lock_schema_version

    check_schema_name(lock_schema)
    probe_postgres(lock_url, timeout)  # a wrong role or database fails here, at once (exit 4)
    before = lock_schema_version(lock_url, schema=lock_schema, timeout_s=timeout)
    if not install:
        return before, before
    return before, install_lock_schema(lock_url, schema=lock_schema, timeout_s=timeout)


@db_app.command("init")
def init(url: UrlOption = None, schema: SchemaOption = None, lock_url: LockUrlOption = None,
         lock_schema: LockSchemaOption = None, timeout: TimeoutOption = 10.0) -> None:
    """Install the schema, or upgrade it to this toolguard's version. Safe to repeat.

    With a PostgreSQL lock backend (--lock-url, TOOLGUARD_LOCK_URL, TOOLGUARD_REDIS_URL,
    in that order), its lock tables are installed or upgraded too.
    """
    target = resolve_store_url(url)
    locks = resolve_lock_url(lock_url)
    with _failures(locks, "lock server"):
        postgres_locks = _postgres_locks(locks, lock_schema)
    with _failures(target):
        store = open_cli_store(target, schema, timeout)
        try:
            before = store.schema_version()
            after = store.install()
        finally:
            store.close()
    where = _where(target, schema)
    if before == after:
        typer.echo(f"schema already at version {after} in {where}")
    else:
        typer.echo(f"schema upgraded from version {before} to {after} in {where}")
    if not postgres_locks:
        return
    with _failures(locks, "lock server"):
        before, after = _lock_versions(locks, lock_schema, timeout, install=True)
    where = _where(locks, lock_schema)
    if before == after:
        typer.echo(f"lock schema already at version {after} in {where}")
    else:
        typer.echo(f"lock schema upgraded from version {before} to {after} in {where}")


@db_app.command("status")
def status(url: UrlOption = None, schema: SchemaOption = None, lock_url: LockUrlOption = None,
           lock_schema: LockSchemaOption = None, timeout: TimeoutOption = 10.0) -> None:
    """Show the installed schema version; exit 1 if it is missing or behind.

    With a PostgreSQL lock backend, its lock schema version too (exit 1 if it is
    missing or behind: `toolguard db init` installs it).
    """
    from toolguard.store import latest_version

    target = resolve_store_url(url)
    locks = resolve_lock_url(lock_url)
    with _failures(locks, "lock server"):
        postgres_locks = _postgres_locks(locks, lock_schema)
    with _failures(target):
        store = None if _missing_sqlite_file(target, schema) else open_cli_store(target, schema, timeout)
        try:
            installed = store.schema_version() if store is not None else 0
        finally:
            if store is not None:
                store.close()
        latest = latest_version("sqlite" if target.startswith("sqlite:") else "postgresql")
    behind = _report("schema", installed, latest, _where(target, schema))
    if postgres_locks:
        from toolguard.locks.postgres import SCHEMA_VERSION

        with _failures(locks, "lock server"):
            lock_installed, _ = _lock_versions(locks, lock_schema, timeout, install=False)
        behind = _report("lock schema", lock_installed, SCHEMA_VERSION,
                         _where(locks, lock_schema)) or behind
    if behind:
        raise typer.Exit(EXIT_BEHIND)


def _report(what: str, installed: int, latest: int, where: str) -> bool:
    """One line about one schema; True if it is missing or behind (``init`` would change it)."""
    if installed == 0:
        missing = "not installed" if what == "schema" else f"{what} not installed"
        typer.echo(f"{missing} in {where}; run `toolguard db init`")
        return True
    if installed < latest:
        typer.echo(f"{what} version {installed} in {where}, {latest} available; "
                   f"run `toolguard db init`")
        return True
    newer = f" (newer than this toolguard's {latest})" if installed > latest else ""
    typer.echo(f"{what} version {installed}{newer} in {where}")
    return False
