"""The PostgreSQL store's statements, and the parameters and rows that go with them.

Every statement ``PostgresStore`` and ``AsyncPostgresStore`` send, as text: the
install's, the fenced write's one-message ``ENTER_TX`` and ``FINISH_TX``, a failed
write's ``ROLLBACK_FAILURE`` / ``COMMIT_FAILURE``, and the reads. Beside them the
plain functions that build their parameter tuples (``text_array``: a ``text[]``
literal) and read their rows back. Apart from the connection and session code so
that what goes over the wire can be read, and checked, in one place; no I/O here.
``toolguard.store.postgres`` re-exports the public names.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, Final

from toolguard.errors import StoreError
from toolguard.store.base import (
    AUDIT_COLUMNS,
    AUDIT_SELECT,
    AsyncFencedTransaction,
    AuditEntry,
    Begun,
    FencedTransaction,
    FencePlan,
    IntentRecord,
    IntentStatus,
    Replay,
    finite_ms,
)

DIALECT: Final = "postgresql"


INSTALL_LOCK = "SELECT pg_advisory_xact_lock(hashtext('toolguard.install'))"
VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS toolguard_schema_version (
    version integer PRIMARY KEY, name text NOT NULL,
    installed_at timestamptz NOT NULL DEFAULT now())"""
RECORD_VERSION = ("INSERT INTO toolguard_schema_version (version, name) VALUES (%s, %s) "
                  "ON CONFLICT (version) DO NOTHING")
INSTALLED = "SELECT version FROM toolguard_schema_version"
HAS_VERSION_TABLE = "SELECT to_regclass('toolguard_schema_version') IS NOT NULL"

BEGIN_INTENT = ("SELECT outcome, previous_status, attempts, result FROM toolguard_begin_intent("
                "%s::text, %s::text, %s::text, %s::text, %s::text[], %s::text)")
ENTER = ("SELECT applied, result FROM toolguard_enter("
         "%s::text[], %s::bigint[], %s::text, %s::text, %s::text, %s::text, %s::text, %s::text[])")
#: One message (client-side binding): open the transaction and fence it.
ENTER_TX = "BEGIN; " + ENTER
#: ``json``, not ``jsonb``: the result's text is kept exactly (NUL, key order, 1e16...).
APPLY = "SELECT toolguard_record(%s::text, %s::json, %s::jsonb)"
_AUDIT_VALUES = ("%s, %s, %s, %s, %s, %s, %s, %s::text[], %s::jsonb, %s::jsonb, %s, "
                 "%s::double precision, %s::integer, %s::text")
_AUDIT_INTO = f"INSERT INTO toolguard_audit ({', '.join(AUDIT_COLUMNS)}) VALUES ({_AUDIT_VALUES})"
AUDIT_INSERT = f"{_AUDIT_INTO} RETURNING id, at"
#: Record the result and write the audit row in one function call (schema version 9).
FINISH = f"SELECT toolguard_finish(%s::text, %s::json, %s::jsonb, {_AUDIT_VALUES})"
#: One message (client-side binding): finish and commit.
FINISH_TX = f"{FINISH}; COMMIT"
#: A write without an intent record: its keys' versions advance, its audit row, the commit.
WRITTEN = "SELECT toolguard_written(%s::text[], %s::text, %s::text)"
FINISH_TX_NO_INTENT = f"{WRITTEN}; {_AUDIT_INTO}; COMMIT"

# --- decisions across calls (schema version 10, ``toolguard.store.reads``) ---
#: After ``toolguard_enter``, in the same message: lock the version rows in one sorted order and
#: return the caller's observations beside the current versions (the client decides).
READ_CHECK = ("SELECT key, decided, observed, current, agent, intent_id FROM toolguard_read_check("
              "%s::text, %s::text[], %s::text[], %s::double precision, %s::integer)")
ENTER_CHECK_TX = f"{ENTER_TX}; {READ_CHECK}"
#: A checked write's finish: what it wrote counts as the caller's read of it (read-your-writes).
OBSERVE_WRITTEN = "SELECT toolguard_observe(%s::text, %s::text[], NULL)"
FINISH_OBSERVE_TX = f"{FINISH}; {OBSERVE_WRITTEN}; COMMIT"
FINISH_OBSERVE_TX_NO_INTENT = f"{WRITTEN}; {OBSERVE_WRITTEN}; {_AUDIT_INTO}; COMMIT"
#: A read: open the transaction and read the keys' versions before the tool's own reads.
READ_BEGIN_TX = "BEGIN; SELECT key, version FROM toolguard_version WHERE key = ANY(%s::text[])"
#: A read's finish: record the versions read, its audit row, commit.
READ_FINISH_TX = f"SELECT toolguard_observe(%s::text, %s::text[], %s::bigint[]); {_AUDIT_INTO}; COMMIT"
# Upsert the intent row as 'failed'/'unknown' (its own row may have been rolled back with the
# failed transaction), never touching an applied row or another request's row (other tool or
# args). An attempt the row has not counted yet (its status is not 'pending') is counted here.
_INTENT_FAILED = (
    "INSERT INTO toolguard_intent AS i (idempotency_key, tool, agent, workflow, keys, args_hash, "
    "status, last_error) "
    "SELECT %s::text, %s::text, %s::text, %s::text, %s::text[], %s::text, %s::text, %s::text "
    "WHERE %s::boolean "
    "ON CONFLICT (idempotency_key) DO UPDATE SET status = EXCLUDED.status, "
    "last_error = EXCLUDED.last_error, updated_at = now(), "
    "attempts = i.attempts + (i.status <> 'pending')::integer "
    "WHERE i.status <> 'applied' AND i.tool = EXCLUDED.tool AND i.args_hash = EXCLUDED.args_hash "
    "RETURNING 1")
# One statement, so the audit row and the intent's status land together (or not at all).
FAILURE = f"WITH failed AS ({_INTENT_FAILED}) {_AUDIT_INTO}"
#: One message (client-side binding): end the failed transaction, then record the failure in a
#: transaction of its own (statements after ROLLBACK in one simple query commit together).
ROLLBACK_FAILURE = f"ROLLBACK; {FAILURE}"
#: The same for a replay found by ``toolguard_enter``: its fence advance is committed (the
#: store has seen its tokens), the intent row was left as it was, and the audit row follows.
COMMIT_FAILURE = f"COMMIT; {FAILURE}"
MARK_UNKNOWN = ("UPDATE toolguard_intent SET status = 'unknown', updated_at = now() "
                "WHERE idempotency_key = %s AND status <> 'applied'")
MARK_UNKNOWN_UPSERT = (
    "INSERT INTO toolguard_intent AS i (idempotency_key, tool, agent, workflow, keys, args_hash, "
    "status) VALUES (%s::text, %s::text, %s::text, %s::text, %s::text[], %s::text, 'unknown') "
    "ON CONFLICT (idempotency_key) DO UPDATE SET status = 'unknown', updated_at = now() "
    "WHERE i.status <> 'applied' AND i.tool = EXCLUDED.tool AND i.args_hash = EXCLUDED.args_hash")
HAS_APPLIED = ("SELECT EXISTS (SELECT 1 FROM toolguard_intent WHERE status = 'applied' "
               "AND tool = %s AND keys @> ARRAY[%s::text] "
               "AND (%s::text IS NULL OR workflow = %s::text))")
HIGH_WATERS = "SELECT key, token FROM toolguard_high_water WHERE key = ANY(%s::text[])"
AUDIT_QUERY = f"SELECT {', '.join(AUDIT_SELECT)} FROM toolguard_audit"


def _entry(row: Sequence[Any]) -> AuditEntry:
    values = dict(zip(AUDIT_SELECT, row, strict=True))
    values["keys"] = tuple(values["keys"] or ())
    values["tokens"] = {k: int(v) for k, v in (values["tokens"] or {}).items()}
    values["duration_ms"] = finite_ms(values["duration_ms"])
    return AuditEntry(**values)


def _begin_params(record: IntentRecord) -> tuple[Any, ...]:
    if record.idempotency_key is None:
        msg = f"begin_intent needs an idempotency key (tool {record.tool!r})"
        raise StoreError(msg, reason="invalid_intent")
    return (record.idempotency_key, record.tool, record.agent, record.workflow,
            list(record.keys), record.args_hash)


def _begun(key: str, row: Sequence[Any]) -> Begun | Replay:
    outcome, previous, attempts, result = row
    if outcome == "replay":
        return Replay(key, result, int(attempts))
    return Begun(key, int(attempts), previous)


def text_array(values: Iterable[Any]) -> str:
    """A ``text[]`` input literal, every element quoted: the value of one ``%s::text[]`` parameter.

    The same text psycopg's list dumper produces, without its per-element type
    inspection. It is still a bound parameter: psycopg quotes the whole literal
    as one string. None becomes NULL; anything else its ``str()``.
    """
    parts = []
    for value in values:
        if value is None:
            parts.append("NULL")
            continue
        text = value if type(value) is str else str(value)
        if "\\" in text or '"' in text:
            text = text.replace("\\", "\\\\").replace('"', '\\"')
        parts.append('"' + text + '"')
    return "{" + ",".join(parts) + "}"


def _bigint_array(values: Iterable[int]) -> str:
    return "{" + ",".join([str(int(v)) for v in values]) + "}"


def _audit_values(entry: AuditEntry) -> tuple[Any, ...]:
    """``entry.insert_values`` with ``keys`` as a ``text[]`` literal (see ``text_array``)."""
    values = entry.insert_values(DIALECT)
    return (*values[:7], text_array(entry.keys), *values[8:])


def _enter_params(plan: FencePlan) -> tuple[Any, ...]:
    keys = text_array(plan.keys)
    tokens = _bigint_array([plan.tokens[k] for k in plan.keys])
    intent = plan.intent
    key = intent.idempotency_key if intent else None
    if intent is None or key is None:
        return (keys, tokens, None, None, None, None, None, None)
    return (keys, tokens, key, intent.tool, intent.agent, intent.workflow, intent.args_hash,
            text_array(intent.keys))


def _failure_params(plan: FencePlan, entry: AuditEntry,
                    status: IntentStatus | None) -> tuple[Any, ...]:
    intent = plan.intent
    if status is None or intent is None or intent.idempotency_key is None:
        row: tuple[Any, ...] = (None, None, None, None, None, None, None, None, False)
    else:
        row = (intent.idempotency_key, intent.tool, intent.agent, intent.workflow,
               text_array(intent.keys or plan.keys), intent.args_hash, status, entry.reason, True)
    return (*row, *_audit_values(entry))


def _mark_unknown(idempotency_key: str, record: IntentRecord | None) -> tuple[str, tuple[Any, ...]]:
    if record is None:
        return MARK_UNKNOWN, (idempotency_key,)
    if record.idempotency_key != idempotency_key:
        msg = (f"mark_unknown: the record's idempotency key {record.idempotency_key!r} is not "
               f"{idempotency_key!r}")
        raise StoreError(msg, reason="invalid_intent")
    return MARK_UNKNOWN_UPSERT, (idempotency_key, record.tool, record.agent, record.workflow,
                                 text_array(record.keys), record.args_hash)


def _finish_params(tx: FencedTransaction | AsyncFencedTransaction, plan: FencePlan,
                   entry: AuditEntry) -> tuple[str, tuple[Any, ...]]:
    """The finishing message of a fenced write (or a read) and its parameters."""
    values = _audit_values(entry)
    if plan.observe is not None:  # a read: record what was seen, audit, commit
        return READ_FINISH_TX, (plan.observe.caller, text_array(plan.keys),
                                _bigint_array([tx.versions.get(k, 0) for k in plan.keys]),
                                *values)
    key = tx.intent.idempotency_key if tx.intent else None
    caller = plan.reads.caller if plan.reads is not None else None
    keys = text_array(plan.keys)
    if key is None:
        written = (keys, entry.agent, entry.intent_id)
        if caller is None:
            return FINISH_TX_NO_INTENT, (*written, *values)
        return FINISH_OBSERVE_TX_NO_INTENT, (*written, caller, keys, *values)
    finish = (key, tx.result_json, tx.tokens_json, *values)
    if caller is None:
        return FINISH_TX, finish
    return FINISH_OBSERVE_TX, (*finish, caller, keys)


def _check_params(plan: FencePlan) -> tuple[Any, ...]:
    """``READ_CHECK``'s parameters for a write with a read check."""
    check = plan.reads
    assert check is not None
    return (check.caller, text_array(plan.keys), text_array(sorted(set(check.decides))),
            float(check.ttl_s), check.wait_ms)


def _moment(value: datetime) -> datetime:
    return value
