"""The contract with the SQL shipped in ``toolguard/sql``: its migrations and its errors.

The numbered schema files (read once at import), which of them a store still
needs, and the ``TGnnn`` SQLSTATEs its SQL functions raise, mapped back to
toolguard's errors. Shared by both dialects, and apart from the fenced flow:
installing and diagnosing a schema needs none of it.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

from toolguard.errors import (
    AuditAppendOnly,
    ConfigurationError,
    IdempotencyConflict,
    InvalidFencingToken,
    RecordNotFound,
    StaleFencingToken,
    StoreError,
)

#: The custom SQLSTATE class ``TG``, raised by the SQL functions in ``toolguard/sql``.
SQLSTATES: Mapping[str, type[StoreError]] = {
    "TG001": StaleFencingToken,
    "TG002": InvalidFencingToken,
    "TG003": RecordNotFound,
    "TG004": IdempotencyConflict,
    "TG005": AuditAppendOnly,
}

SCHEMA_HINT = "the toolguard schema is not installed here: run `toolguard db init`"


# --- migrations ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Migration:
    """One numbered schema file: ``NNN_name.sql``."""

    version: int
    name: str
    sql: str


_MIGRATION_NAME = re.compile(r"^(\d{3})_(\w+)\.sql$")


def _read_shipped(dialect: Literal["postgresql", "sqlite"]) -> tuple[Migration, ...] | str:
    """The schema files of ``dialect`` read from the package, or why they cannot be."""
    folder = resources.files("toolguard").joinpath("sql")
    if dialect == "sqlite":
        folder = folder.joinpath("sqlite")
    found: list[Migration] = []
    try:
        entries = list(folder.iterdir())
        for entry in entries:
            match = _MIGRATION_NAME.match(entry.name)
            if match and entry.is_file():
                found.append(Migration(int(match.group(1)), f"{match.group(1)}_{match.group(2)}",
                                       entry.read_text(encoding="utf-8")))
    except OSError as error:
        return f"toolguard's SQL files are missing from the installation ({folder}): {error}"
    if not found:
        return f"no schema files found in {folder}"
    found.sort(key=lambda m: m.version)
    return tuple(found)


#: The packaged schema files, read once at import: the async paths check a store's schema
#: version on their first call, and reading files there would block the event loop.
_SHIPPED: dict[str, tuple[Migration, ...] | str] = {
    dialect: _read_shipped(dialect) for dialect in ("postgresql", "sqlite")}


def migrations(dialect: Literal["postgresql", "sqlite"]) -> tuple[Migration, ...]:
    """The schema files shipped in ``toolguard/sql`` (``sql/sqlite`` for SQLite), in order.

    Read once, when toolguard is imported (no file I/O here: async paths call this)."""
    shipped = _SHIPPED[dialect]
    if isinstance(shipped, str):
        raise ConfigurationError(shipped)
    return shipped


def latest_version(dialect: Literal["postgresql", "sqlite"]) -> int:
    """The schema version this toolguard installs."""
    return migrations(dialect)[-1].version


def pending_migrations(steps: Iterable[Migration], installed: Collection[int]) -> list[Migration]:
    """The steps not recorded as installed, in version order.

    By the set of recorded versions, not by "above the highest one": files are
    numbered by whoever adds them, so a store may have received version 5 before
    version 4 exists; 4 is applied when it arrives. Every file is written to be
    independent of files with other numbers that touch other tables.
    """
    done = set(installed)
    return sorted((step for step in steps if step.version not in done), key=lambda m: m.version)


def effective_version(installed: Collection[int], shipped: Sequence[Migration]) -> int:
    """The schema version a store counts as: the highest shipped version with every shipped
    version up to it installed (so a missing file shows as "behind"); with all of them
    installed, the highest recorded one (a newer toolguard's, if any). 0: nothing installed."""
    done = set(installed)
    if not done:
        return 0
    for step in sorted(shipped, key=lambda m: m.version):
        if step.version not in done:
            below = [v for v in done if v < step.version]
            return max(below) if below else 0
    return max(done)


# --- errors --------------------------------------------------------------------------


def error_from_sqlstate(sqlstate: str | None, message: str, detail: str | None) -> StoreError | None:
    """The toolguard error for a ``TGnnn`` SQLSTATE (None for any other state)."""
    cls = SQLSTATES.get(sqlstate or "")
    if cls is None:
        return None
    if cls is StaleFencingToken:
        info: dict[str, Any] = {}
        with contextlib.suppress(ValueError, TypeError):
            info = json.loads(detail or "{}")
        return StaleFencingToken(message, key=str(info.get("key", "")), token=info.get("token"),
                                 current=info.get("current"))
    return cls(message)


def schema_missing(error: BaseException) -> StoreError:
    return StoreError(f"{SCHEMA_HINT} ({error})", reason="schema_not_installed")
