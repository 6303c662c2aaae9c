"""The PostgreSQL lock schema: its SQL, the statements built on it, and installing it.

Everything here is text for the database and the one transaction that puts it
there: the tables and plpgsql functions, the statements a backend sends, the
version mark, and ``install_lock_schema``/``lock_schema_version`` for deploy
scripts and ``toolguard db init`` (no backend, no pool). Separate from
``toolguard.locks.postgres`` (the backends, which only run these statements) so
that the schema and its upgrade path can be read, and changed, in one place.

Upgrading from lock schema 1: the tables are kept (tokens stay above everything
granted before), the helper functions are replaced (their bodies mean the same in
both versions), and the new acquire function takes one more argument (the hand-off
TTL), so it is a separate overload. The version 1 acquire is left in place on
purpose: clients of the previous release that are still running keep working on
the same tables during a rolling upgrade, with their own semantics (their hand-offs
still run for their full TTL, which is what they expect).

Lock schema 3 changes function bodies only (same signatures, so version 2 clients
use them as they are): acquire creates or locks the key's fence row in one
statement (version 2 inserted it, then locked it in a second statement, and an
idle-row sweep in between made the grant fail with a NOT NULL violation), and a
grant creates a fence row that is missing instead of minting NULL.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, cast

import psycopg
from psycopg import errors as pg_errors

from toolguard.errors import BackendUnavailable, ConfigurationError

#: The lock schema's version, stored in the comment of the acquire function.
SCHEMA_VERSION = 3
SCHEMA_MARK = f"toolguard lock schema {SCHEMA_VERSION}"
_MARK_PREFIX = "toolguard lock schema "

#: The SQL of the current lock schema; ``{s}`` is the schema prefix (``"name".`` or empty).
SCHEMA = """
CREATE TABLE IF NOT EXISTS {s}toolguard_lock_fence (
    key   text PRIMARY KEY,
    token bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS {s}toolguard_lock_holder (
    key        text PRIMARY KEY,
    owner      text NOT NULL,
    token      bigint NOT NULL,
    expires_at timestamptz NOT NULL
);
-- ttl_ms: how long a hand-off to this waiter lasts until its first renewal.
CREATE TABLE IF NOT EXISTS {s}toolguard_lock_waiter (
    key           text NOT NULL,
    owner         text NOT NULL,
    arrival       bigint GENERATED ALWAYS AS IDENTITY,
    ttl_ms        integer NOT NULL,
    channel       text NOT NULL,
    present_until timestamptz NOT NULL,
    PRIMARY KEY (key, owner)
);
CREATE INDEX IF NOT EXISTS toolguard_lock_waiter_line ON {s}toolguard_lock_waiter (key, arrival);

-- Mint p_key's next token and make p_owner its holder for p_ttl_ms (the caller holds
-- the fence row lock). Returns the token. A fence row that is missing all the same (swept
-- as idle) is created with the database time, as acquire would: never a NULL token.
CREATE OR REPLACE FUNCTION {s}toolguard_lock_grant(p_key text, p_owner text, p_ttl_ms integer)
RETURNS bigint LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_token bigint;
BEGIN
    INSERT INTO {s}toolguard_lock_fence AS f (key, token)
    VALUES (p_key, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)
    ON CONFLICT (key) DO UPDATE SET token = greatest(f.token + 1, excluded.token)
    RETURNING f.token INTO v_token;
    INSERT INTO {s}toolguard_lock_holder (key, owner, token, expires_at)
    VALUES (p_key, p_owner, v_token, clock_timestamp() + p_ttl_ms * interval '1 millisecond')
    ON CONFLICT (key) DO UPDATE
       SET owner = excluded.owner, token = excluded.token, expires_at = excluded.expires_at;
    DELETE FROM {s}toolguard_lock_waiter WHERE key = p_key AND owner = p_owner;
    RETURN v_token;
END $$;

-- Give the free p_key to its first live waiter, if any, for that waiter's hand-off TTL,
-- and NOTIFY that waiter's process with 'owner token key' (the caller holds the fence
-- row lock).
CREATE OR REPLACE FUNCTION {s}toolguard_lock_pass(p_key text)
RETURNS void LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_next {s}toolguard_lock_waiter%ROWTYPE;
BEGIN
    DELETE FROM {s}toolguard_lock_waiter WHERE key = p_key AND present_until < clock_timestamp();
    SELECT * INTO v_next FROM {s}toolguard_lock_waiter WHERE key = p_key ORDER BY arrival LIMIT 1;
    IF FOUND THEN
        PERFORM pg_notify(v_next.channel, v_next.owner || ' '
                          || {s}toolguard_lock_grant(p_key, v_next.owner, v_next.ttl_ms)
                          || ' ' || p_key);
    END IF;
END $$;

-- Grant p_key to p_owner for p_ttl_ms if it is free and p_owner is first in line; if
-- p_owner holds it already (a hand-off that raced with the end of a wait, a retry after
-- a lost reply), extend it to p_ttl_ms from now. Else queue p_owner (or refresh its
-- presence), to be handed the lock for p_handoff_ms. A free key whose first waiter is
-- someone else is handed to that waiter on the way.
-- Returns (token, 0, token) on a grant, (NULL, ms left on the holder's lease, the key's
-- last token) when queued: a hand-off to p_owner with a token at or below that one is
-- over already.
CREATE OR REPLACE FUNCTION {s}toolguard_lock_acquire(
    p_key text, p_owner text, p_ttl_ms integer, p_handoff_ms integer, p_presence_ms integer,
    p_channel text, OUT token bigint, OUT retry_ms integer, OUT last_token bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_holder {s}toolguard_lock_holder%ROWTYPE;
    v_first text;
BEGIN
    -- Create or lock the key's fence row in one statement: an idle-row sweep
    -- (toolguard.locks.upkeep) can never delete it between finding and locking it.
    INSERT INTO {s}toolguard_lock_fence AS f (key, token) VALUES (p_key, 0)
    ON CONFLICT (key) DO UPDATE SET token = f.token;
    DELETE FROM {s}toolguard_lock_holder WHERE key = p_key AND expires_at <= clock_timestamp();
    SELECT * INTO v_holder FROM {s}toolguard_lock_holder WHERE key = p_key;
    IF NOT FOUND THEN
        DELETE FROM {s}toolguard_lock_waiter
         WHERE key = p_key AND present_until < clock_timestamp();
        SELECT owner INTO v_first FROM {s}toolguard_lock_waiter WHERE key = p_key
         ORDER BY arrival LIMIT 1;
        IF v_first IS NULL OR v_first = p_owner THEN
            token := {s}toolguard_lock_grant(p_key, p_owner, p_ttl_ms);
            retry_ms := 0;
            last_token := token;
            RETURN;
        END IF;
        PERFORM {s}toolguard_lock_pass(p_key);
        SELECT * INTO v_holder FROM {s}toolguard_lock_holder WHERE key = p_key;
    ELSIF v_holder.owner = p_owner THEN
        UPDATE {s}toolguard_lock_holder
           SET expires_at = clock_timestamp() + p_ttl_ms * interval '1 millisecond'
         WHERE key = p_key;
        token := v_holder.token;
        retry_ms := 0;
        last_token := token;
        RETURN;
    END IF;
    INSERT INTO {s}toolguard_lock_waiter (key, owner, ttl_ms, channel, present_until)
    VALUES (p_key, p_owner, p_handoff_ms, p_channel,
            clock_timestamp() + p_presence_ms * interval '1 millisecond')
    ON CONFLICT (key, owner) DO UPDATE
       SET present_until = excluded.present_until, channel = excluded.channel,
           ttl_ms = excluded.ttl_ms;
    token := NULL;
    retry_ms := greatest(1, ceil(extract(epoch FROM v_holder.expires_at - clock_timestamp()) * 1000));
    SELECT f.token INTO last_token FROM {s}toolguard_lock_fence f WHERE f.key = p_key;
END $$;

-- Release p_key if p_owner holds it (then pass it to the first live waiter), and
-- leave its line either way. Returns true if p_owner held an unexpired lease.
CREATE OR REPLACE FUNCTION {s}toolguard_lock_release(p_key text, p_owner text)
RETURNS boolean LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_expires timestamptz;
BEGIN
    PERFORM 1 FROM {s}toolguard_lock_fence WHERE key = p_key FOR UPDATE;
    DELETE FROM {s}toolguard_lock_waiter WHERE key = p_key AND owner = p_owner;
    DELETE FROM {s}toolguard_lock_holder WHERE key = p_key AND owner = p_owner
    RETURNING expires_at INTO v_expires;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM {s}toolguard_lock_pass(p_key);
    RETURN v_expires > clock_timestamp();
END $$;
"""

_ACQUIRE_ARGS = "text,text,integer,integer,integer,text"
#: The acquire function of lock schema 1 (kept for its clients; see the module docstring).
_ACQUIRE_ARGS_V1 = "text,text,integer,integer,text"
_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}$")
#: SQLSTATEs meaning the lock schema is not (or no longer) there: install it again.
_SCHEMA_GONE = (pg_errors.UndefinedFunction, pg_errors.UndefinedTable, pg_errors.InvalidSchemaName)

# Extend every (key, owner) still held and unexpired; one row per input, in order.
RENEW = """
WITH held AS (
    SELECT * FROM unnest(%s::text[], %s::text[], %s::integer[]) WITH ORDINALITY
        AS h(key, owner, ttl_ms, n)
), renewed AS (
    UPDATE {s}toolguard_lock_holder l
       SET expires_at = clock_timestamp() + held.ttl_ms * interval '1 millisecond'
      FROM held
     WHERE l.key = held.key AND l.owner = held.owner AND l.expires_at > clock_timestamp()
    RETURNING held.n
)
SELECT held.n IN (SELECT n FROM renewed) FROM held ORDER BY held.n
"""
RAISE_FLOOR = """
INSERT INTO {s}toolguard_lock_fence (key, token) VALUES (%s, %s)
ON CONFLICT (key) DO UPDATE SET token = greatest({s}toolguard_lock_fence.token, excluded.token)
"""


def check_schema_name(schema: str | None) -> str | None:
    """A plain SQL identifier (as the store's ``schema=``), else ``ConfigurationError``."""
    if schema is not None and (not isinstance(schema, str) or not _SCHEMA_NAME.match(schema)):
        msg = f"schema must be a plain SQL identifier, got {schema!r}"
        raise ConfigurationError(msg)
    return schema


@dataclasses.dataclass(frozen=True)
class _Statements:
    """The lock SQL for one schema (the schema name is validated, then quoted)."""

    schema: str | None

    @functools.cached_property
    def prefix(self) -> str:
        return f'"{self.schema}".' if self.schema else ""

    def _q(self, text: str) -> str:
        return text.replace("{s}", self.prefix)

    @functools.cached_property
    def install(self) -> str:
        return self._q(SCHEMA)

    @functools.cached_property
    def create_schema(self) -> str | None:
        return f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"' if self.schema else None

    @functools.cached_property
    def mark(self) -> str:
        return self._q(f"COMMENT ON FUNCTION {{s}}toolguard_lock_acquire({_ACQUIRE_ARGS}) "
                       f"IS '{SCHEMA_MARK}'")

    @functools.cached_property
    def version(self) -> str:
        """One row: the marks of the current and of the version 1 acquire functions."""
        current = self._q(f"{{s}}toolguard_lock_acquire({_ACQUIRE_ARGS})")
        old = self._q(f"{{s}}toolguard_lock_acquire({_ACQUIRE_ARGS_V1})")
        return (f"SELECT obj_description(to_regprocedure('{current}'), 'pg_proc'), "
                f"obj_description(to_regprocedure('{old}'), 'pg_proc')")

    @functools.cached_property
    def install_lock(self) -> str:
        name = "toolguard_lock_schema" + (f":{self.schema}" if self.schema else "")
        return f"SELECT pg_advisory_xact_lock(hashtext('{name}'))"

    @functools.cached_property
    def acquire(self) -> str:
        return self._q("SELECT token, retry_ms, last_token FROM "
                       "{s}toolguard_lock_acquire(%s, %s, %s, %s, %s, %s)")

    @functools.cached_property
    def release(self) -> str:
        return self._q("SELECT {s}toolguard_lock_release(%s, %s)")

    @functools.cached_property
    def renew(self) -> str:
        return self._q(RENEW)

    @functools.cached_property
    def raise_floor(self) -> str:
        return self._q(RAISE_FLOOR)

    @functools.cached_property
    def current_token(self) -> str:
        return self._q("SELECT token FROM {s}toolguard_lock_fence WHERE key = %s")


def _version_of(row: tuple[Any, ...] | None) -> int:
    """The newest version marked in ``_Statements.version``'s row (0: none)."""
    versions = [int(mark[len(_MARK_PREFIX):]) for mark in row or ()
                if isinstance(mark, str) and mark.startswith(_MARK_PREFIX)
                and mark[len(_MARK_PREFIX):].isdigit()]
    return max(versions, default=0)


def _installed_version(conn: psycopg.Connection[Any], statements: _Statements) -> int:
    return _version_of(conn.execute(statements.version).fetchone())


def _install(conn: psycopg.Connection[Any], statements: _Statements, *, force: bool = False) -> int:
    """Create the schema, or upgrade an older one, in one transaction; returns the version.

    Serialized by an advisory lock, so concurrent first uses install once. Tables are
    kept (tokens stay above everything granted before); functions are created or
    replaced (see the module docstring for what happens to version 1's).
    """
    with conn.transaction():
        conn.execute(statements.install_lock)
        if statements.create_schema is not None:
            conn.execute(statements.create_schema)
        if not force and _installed_version(conn, statements) >= SCHEMA_VERSION:
            return SCHEMA_VERSION
        conn.execute(cast(Any, statements.install))
        conn.execute(statements.mark)
    return SCHEMA_VERSION


def install_lock_schema(url: str, *, schema: str | None = None, timeout_s: float = 10.0) -> int:
    """Install (or upgrade) the PostgreSQL lock schema at ``url``; returns its version.

    For ``toolguard db init`` and deploy scripts: one connection, no manager, no pool.
    """
    statements = _Statements(check_schema_name(schema))
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=max(1, int(timeout_s))) as conn:
            return _install(conn, statements)
    except psycopg.OperationalError as error:
        raise BackendUnavailable(f"postgres: {error}") from error


def lock_schema_version(url: str, *, schema: str | None = None, timeout_s: float = 10.0) -> int:
    """The lock schema version installed at ``url`` (0: none; ``SCHEMA_VERSION``: current)."""
    statements = _Statements(check_schema_name(schema))
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=max(1, int(timeout_s))) as conn:
            return _installed_version(conn, statements)
    except psycopg.OperationalError as error:
        raise BackendUnavailable(f"postgres: {error}") from error
