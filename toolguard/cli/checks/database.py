"""The SQL side: the store's schema, a PostgreSQL lock backend's schema, the paused-holder bound.

Whether the SQL toolguard installs is at this version (the store's tables, the
``toolguard_lock_*`` functions), and whether a PostgreSQL store's role may end a
paused holder's transaction. Separate from the lock server's checks: these read
the databases, not the lock server's configuration.
"""

from __future__ import annotations

import re
from typing import Any

from toolguard.cli.checks.probes import _LockProbe, _redact
from toolguard.cli.checks.report import Check, _reason

_SCHEMA_WHY = "the fence check, idempotency records and the append-only audit log are SQL in the store"


def _schema(store: Any, installed: int) -> Check:
    title = "Store schema version"
    if store is None:
        return Check("schema", title, "skip", "the store did not answer", _SCHEMA_WHY)
    from toolguard.store import latest_version

    latest = latest_version("sqlite" if store.dialect == "sqlite" else "postgresql")
    data = {"installed": installed, "latest": latest}
    if installed == 0:
        return Check("schema", title, "fail", "not installed", _SCHEMA_WHY,
                     fix="toolguard db init", data=data)
    if installed < latest:
        return Check("schema", title, "fail", f"version {installed}, this toolguard needs {latest}",
                     _SCHEMA_WHY, fix="toolguard db init", data=data)
    if installed > latest:
        return Check("schema", title, "warn",
                     f"version {installed}, newer than this toolguard's {latest}", _SCHEMA_WHY,
                     fix="upgrade toolguard on this host", data=data)
    return Check("schema", title, "pass", f"version {installed} (latest)", _SCHEMA_WHY, data=data)


_LOCK_SCHEMA_WHY = ("every acquire, renewal and release of the PostgreSQL lock backend is one of "
                    "its SQL functions (toolguard_lock_*); the first lock call installs or "
                    "upgrades them, which needs CREATE on the schema")


def _lock_schema(probe: _LockProbe | None, lock_url: str, lock_schema: str | None) -> Check:
    title = "Lock schema version (PostgreSQL locks)"
    if probe is None:
        return Check("lock_schema", title, "skip", "the lock server did not answer",
                     _LOCK_SCHEMA_WHY)
    if probe.lock_schema_version is None:
        return Check("lock_schema", title, "skip",
                     f"not PostgreSQL ({probe.label}): no lock tables to install", _LOCK_SCHEMA_WHY)
    from toolguard.locks.postgres import SCHEMA_VERSION

    where = f" (schema {lock_schema})" if lock_schema else ""
    fix = f"toolguard db init --lock-url {_redact(lock_url)}" + (
        f" --lock-schema {lock_schema}" if lock_schema else "")
    try:
        installed = probe.lock_schema_version()
    except Exception as error:
        return Check("lock_schema", title, "fail", f"cannot read it{where}: {_reason(error)}",
                     _LOCK_SCHEMA_WHY, refused=True)
    data = {"installed": installed, "latest": SCHEMA_VERSION, "schema": lock_schema}
    if installed == 0:
        return Check("lock_schema", title, "warn",
                     f"not installed{where}: the first lock call installs it", _LOCK_SCHEMA_WHY,
                     fix=fix, data=data)
    if installed < SCHEMA_VERSION:
        return Check("lock_schema", title, "warn",
                     f"version {installed}{where}, this toolguard's is {SCHEMA_VERSION}: the first "
                     f"lock call upgrades it", _LOCK_SCHEMA_WHY, fix=fix, data=data)
    if installed > SCHEMA_VERSION:
        return Check("lock_schema", title, "warn",
                     f"version {installed}{where}, newer than this toolguard's {SCHEMA_VERSION}",
                     _LOCK_SCHEMA_WHY, fix="upgrade toolguard on this host", data=data)
    return Check("lock_schema", title, "pass", f"version {installed}{where} (latest)",
                 _LOCK_SCHEMA_WHY, data=data)


_SIGNAL_WHY = ("a holder stopped inside its fenced transaction keeps its fence rows locked; the next "
               "holder, with a newer token, ends that transaction once the stopped holder's lease "
               "is gone (pg_terminate_backend). That needs the same role for every client or "
               "pg_signal_backend; without it the next holder waits until the stopped one wakes or "
               "dies (fail safe, but unbounded)")

#: The store's role, whether it is a superuser or in pg_signal_backend, and the other login
#: roles that may fence in this store (UPDATE on toolguard_high_water) whose sessions it may
#: not end. Superusers are left out: only a superuser may end a superuser's session.
_SIGNAL_QUERY = """
SELECT current_user, r.rolsuper, pg_has_role(current_user, 'pg_signal_backend', 'USAGE'),
       ARRAY(SELECT o.rolname::text FROM pg_roles o
              WHERE o.rolcanlogin AND NOT o.rolsuper AND o.rolname <> current_user
                AND has_table_privilege(o.oid, 'toolguard_high_water', 'UPDATE')
                AND NOT pg_has_role(current_user, o.oid, 'USAGE')
              ORDER BY 1)
  FROM pg_roles r WHERE r.rolname = current_user
"""


def _signal(store: Any, installed: int) -> Check:
    title = "Paused-holder bound (PostgreSQL store)"
    if store is None:
        return Check("pg_signal", title, "skip", "the store did not answer", _SIGNAL_WHY)
    if store.dialect != "postgresql":
        return Check("pg_signal", title, "skip",
                     "SQLite store: nothing can end another process's transaction (a stopped "
                     "holder blocks writers until it wakes; see toolguard/sql/README.md)",
                     _SIGNAL_WHY)
    if installed < 3:
        return Check("pg_signal", title, "skip", "the store's schema is not installed (version 3 "
                     "brings the bound)", _SIGNAL_WHY)
    try:
        with store.connection() as conn:
            row = conn.execute(_SIGNAL_QUERY).fetchone()
    except Exception as error:
        return Check("pg_signal", title, "warn", f"cannot read the role's permissions: "
                     f"{_reason(error)}", _SIGNAL_WHY)
    role, superuser, signaller, others = row[0], bool(row[1]), bool(row[2]), list(row[3] or [])
    data = {"role": role, "superuser": superuser, "pg_signal_backend": signaller,
            "unsignalable_roles": others}
    if superuser:
        return Check("pg_signal", title, "pass",
                     f"role {role} is a superuser: it may end any paused holder's transaction",
                     _SIGNAL_WHY, data=data)
    if signaller:
        return Check("pg_signal", title, "pass",
                     f"role {role} is a member of pg_signal_backend: it may end a paused holder's "
                     f"transaction (a superuser's excepted)", _SIGNAL_WHY, data=data)
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        return Check("pg_signal", title, "warn",
                     f"role {role} may not end the sessions of {shown}, which may fence here too, "
                     f"and is not in pg_signal_backend: a paused holder of theirs makes the next "
                     f"holder wait until it wakes", _SIGNAL_WHY, data=data,
                     fix=f"GRANT pg_signal_backend TO {_ident(role)} (or one role for every client)")
    return Check("pg_signal", title, "pass",
                 f"role {role} is the only role that may fence here (others it may not signal: "
                 f"none): one role for every client", _SIGNAL_WHY, data=data)


def _ident(name: str) -> str:
    """A role name as SQL would need it in a GRANT (quoted unless plain)."""
    if re.fullmatch(r"[a-z_][a-z0-9_$]*", name):
        return name
    return '"' + name.replace('"', '""') + '"'
