"""The SQLite store's statements, and the text forms its audit rows are written and read in.

Every statement ``SqliteStore`` sends as text: the fence upsert, the intent
rows, the audit insert that chooses its row's id and time in the statement so
that ``toolguard_audit_row_hash`` can cover them, the reads. Beside them the
columns' text forms: ``_iso`` for the ``at`` column, and ``_entry`` (with
``_salvaged`` for a row another program wrote) to read an audit row back. Apart
from the connection and session code so that what the store writes can be read
in one place; no I/O here. ``toolguard.store.sqlite`` re-exports the public names.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Final

from toolguard.errors import StoreError
from toolguard.store.base import (
    AUDIT_COLUMNS,
    AUDIT_SELECT,
    POLICY_VERSION_MAX,
    AuditEntry,
    finite_ms,
)

DIALECT: Final = "sqlite"
NOW = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
ROW_HASH_FUNCTION = "toolguard_audit_row_hash"

VERSION_TABLE = f"""
CREATE TABLE IF NOT EXISTS toolguard_schema_version (
    version INTEGER PRIMARY KEY, name TEXT NOT NULL,
    installed_at TEXT NOT NULL DEFAULT ({NOW}))"""
INSTALLED = "SELECT version FROM toolguard_schema_version"
FENCE = (f"INSERT INTO toolguard_high_water (key, token) VALUES (?, ?) ON CONFLICT (key) "
         f"DO UPDATE SET token = excluded.token, updated_at = {NOW} "
         f"WHERE toolguard_high_water.token <= excluded.token RETURNING token")
INTENT_ROW = ("SELECT tool, args_hash, status, attempts, result FROM toolguard_intent "
              "WHERE idempotency_key = ?")
NEW_INTENT = ("INSERT INTO toolguard_intent (idempotency_key, tool, agent, workflow, keys, args_hash) "
              "VALUES (?, ?, ?, ?, ?, ?)")
#: The first attempt's intent row, in the statement that also finds an existing one: nothing
#: inserted (rowcount 0) means the key was seen before, and ``INTENT_ROW`` says how.
NEW_INTENT_IF_ABSENT = NEW_INTENT + " ON CONFLICT (idempotency_key) DO NOTHING"
RETRY_INTENT = (f"UPDATE toolguard_intent SET status = 'pending', attempts = attempts + 1, "
                f"updated_at = {NOW} WHERE idempotency_key = ?")
APPLY = (f"UPDATE toolguard_intent SET status = 'applied', result = ?, tokens = ?, last_error = NULL, "
         f"applied_at = {NOW}, updated_at = {NOW} WHERE idempotency_key = ? AND status <> 'applied'")
#: An attempt that reaches the fenced transaction on a failed/unknown intent is counted there
#: (only if it commits; a failed one is counted by ``FAIL_INTENT``).
COUNT_ATTEMPT = (f"UPDATE toolguard_intent SET attempts = attempts + 1, updated_at = {NOW} "
                 f"WHERE idempotency_key = ?")
# The failed attempt's own row may have been rolled back with it: upsert, never touching an
# applied row or another request's (other tool or args); count an attempt not counted yet.
FAIL_INTENT = (
    "INSERT INTO toolguard_intent AS i (idempotency_key, tool, agent, workflow, keys, args_hash, "
    "status, last_error) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
    f"ON CONFLICT (idempotency_key) DO UPDATE SET status = excluded.status, "
    f"last_error = excluded.last_error, updated_at = {NOW}, "
    f"attempts = i.attempts + (i.status <> 'pending') "
    f"WHERE i.status <> 'applied' AND i.tool = excluded.tool AND i.args_hash = excluded.args_hash")
#: The row's id and time are chosen in the statement (the next AUTOINCREMENT id, SQLite's
#: clock), so that its hash can cover them: ``toolguard_audit_row_hash`` (registered on every
#: connection, ``chain.sqlite_row_hash``) hashes the values as the columns will keep them.
#: Writers hold the database's write lock, so the id cannot be taken by anyone else meanwhile.
_NEXT_ID = ("max(coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'toolguard_audit'), 0), "
            "coalesce((SELECT max(id) FROM toolguard_audit), 0)) + 1")
_AUDIT_ROW = ", ".join(f"v.{c}" for c in ("id", "at", *AUDIT_COLUMNS))
AUDIT_INSERT = (
    f"INSERT INTO toolguard_audit (id, at, {', '.join(AUDIT_COLUMNS)}, row_hash) "
    f"SELECT {_AUDIT_ROW}, {ROW_HASH_FUNCTION}({_AUDIT_ROW}) "
    f"FROM (SELECT {_NEXT_ID} AS id, {NOW} AS at, "
    f"{', '.join(f'? AS {c}' for c in AUDIT_COLUMNS)}) AS v RETURNING id, at")
# --- decisions across calls (schema version 5, ``toolguard.store.reads``) ---
#: The versions of the keys (a JSON array) as a read finds them before the tool's own reads.
VERSIONS_OF = ("SELECT key, version FROM toolguard_version "
               "WHERE key IN (SELECT value FROM json_each(?))")
#: A write's read check: per key (a JSON array, sorted), whether only decided on, the caller's
#: observation younger than the cut-off (seconds since the epoch), and the key's version now.
READ_CHECK = ("SELECT k.value, k.value IN (SELECT value FROM json_each(?)), r.version, "
              "coalesce(v.version, 0), v.agent, v.intent_id FROM json_each(?) AS k "
              "LEFT JOIN toolguard_version AS v ON v.key = k.value "
              "LEFT JOIN toolguard_read AS r ON r.caller = ? AND r.key = k.value "
              "AND r.observed_at > ? ORDER BY k.value")
#: An accepted write advances the version of every key it wrote (a JSON array).
WRITTEN = ("INSERT INTO toolguard_version (key, version, agent, intent_id) "
           "SELECT value, 1, ?, ? FROM json_each(?) WHERE true ON CONFLICT (key) DO UPDATE "
           f"SET version = version + 1, agent = excluded.agent, intent_id = excluded.intent_id, "
           f"updated_at = {NOW}")
#: What a caller saw: ``[[key, version], ...]`` (a read), at the time given.
OBSERVE_AT = ("INSERT INTO toolguard_read (caller, key, version, observed_at) "
              "SELECT ?, json_extract(value, '$[0]'), json_extract(value, '$[1]'), ? "
              "FROM json_each(?) WHERE true ON CONFLICT (caller, key) DO UPDATE "
              "SET version = excluded.version, observed_at = excluded.observed_at")
#: What a caller wrote counts as its read of it (read-your-writes): keys at their version now.
OBSERVE_WRITTEN = ("INSERT INTO toolguard_read (caller, key, version, observed_at) "
                   "SELECT ?, k.value, coalesce(v.version, 0), ? FROM json_each(?) AS k "
                   "LEFT JOIN toolguard_version AS v ON v.key = k.value WHERE true "
                   "ON CONFLICT (caller, key) DO UPDATE "
                   "SET version = excluded.version, observed_at = excluded.observed_at")
MARK_UNKNOWN = (f"UPDATE toolguard_intent SET status = 'unknown', updated_at = {NOW} "
                f"WHERE idempotency_key = ? AND status <> 'applied'")
MARK_UNKNOWN_UPSERT = (
    "INSERT INTO toolguard_intent AS i (idempotency_key, tool, agent, workflow, keys, args_hash, "
    "status) VALUES (?, ?, ?, ?, ?, ?, 'unknown') "
    f"ON CONFLICT (idempotency_key) DO UPDATE SET status = 'unknown', updated_at = {NOW} "
    f"WHERE i.status <> 'applied' AND i.tool = excluded.tool AND i.args_hash = excluded.args_hash")
HAS_APPLIED = ("SELECT EXISTS (SELECT 1 FROM toolguard_intent WHERE status = 'applied' AND tool = ? "
               "AND EXISTS (SELECT 1 FROM json_each(toolguard_intent.keys) WHERE json_each.value = ?) "
               "AND (? IS NULL OR workflow = ?))")
AUDIT_QUERY = f"SELECT {', '.join(AUDIT_SELECT)} FROM toolguard_audit"


def _iso(moment: datetime) -> str:
    """The ``at`` column's text form (UTC, milliseconds), so text order is time order."""
    utc = moment.astimezone(UTC)
    return utc.strftime("%Y-%m-%dT%H:%M:%S.") + f"{utc.microsecond // 1000:03d}Z"


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


#: The audit columns the store writes as text (JSON columns included).
_TEXT = ("at", "decision", "reason", "tool", "agent", "intent_id", "idempotency_key", "workflow",
         "keys", "tokens", "args", "detail", "policy_version")


def _entry(row: Sequence[Any]) -> AuditEntry:
    values = dict(zip(AUDIT_SELECT, row, strict=True))
    try:
        if not all(values[name] is None or isinstance(values[name], str) for name in _TEXT):
            raise TypeError("a text column holds another type")
        values["at"] = datetime.fromisoformat(values["at"]) if values["at"] else None
        values["keys"] = tuple(_loads(values["keys"]) or ())
        values["tokens"] = {k: int(v) for k, v in (_loads(values["tokens"]) or {}).items()}
        values["args"] = _loads(values["args"])
        values["duration_ms"] = finite_ms(values["duration_ms"])
        return AuditEntry(**values)
    except (TypeError, ValueError, AttributeError, StoreError):
        return _salvaged(dict(zip(AUDIT_SELECT, row, strict=True)))


def _salvaged(values: dict[str, Any]) -> AuditEntry:
    """A row no store writes (its file's owner, or another program, put other values in it),
    read as far as it goes: what does not parse is shown as its text, or left out. Its row
    hash no longer matches, so ``toolguard audit verify`` reports it."""
    def text(value: Any) -> str | None:
        if value is None or value == "":
            return None
        return value.hex() if isinstance(value, bytes) else str(value)

    def loaded(value: Any) -> Any:
        try:
            return _loads(value)
        except (TypeError, ValueError):
            return text(value)

    try:
        at: datetime | None = datetime.fromisoformat(str(values["at"])) if values["at"] else None
    except ValueError:
        at = None
    if at is not None and at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    keys = loaded(values["keys"])
    tokens = loaded(values["tokens"])
    try:
        duration = finite_ms(values["duration_ms"])
    except (TypeError, ValueError):
        duration = None
    node = values["node_attempt"]
    version = text(values["policy_version"])
    return AuditEntry(
        id=values["id"] if isinstance(values["id"], int) else None, at=at,
        decision=text(values["decision"]) or "?", reason=text(values["reason"]) or "?",
        tool=text(values["tool"]), agent=text(values["agent"]),
        intent_id=text(values["intent_id"]), idempotency_key=text(values["idempotency_key"]),
        workflow=text(values["workflow"]),
        keys=tuple(str(k) for k in keys) if isinstance(keys, list) else (),
        tokens={str(k): v for k, v in tokens.items() if isinstance(v, int)}
        if isinstance(tokens, dict) else {},
        args=loaded(values["args"]), detail=text(values["detail"]), duration_ms=duration,
        node_attempt=node if isinstance(node, int) and not isinstance(node, bool) else None,
        policy_version=version if version and len(version) <= POLICY_VERSION_MAX else None)


def _lenient_text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")
