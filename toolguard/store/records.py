"""The records a guarded store keeps: intents, their outcomes, audit rows and audit queries.

Plain validated values, no I/O: what ``begin_intent`` and ``fenced()`` take and
give back (``IntentRecord``, ``Begun``, ``Replay``), one audit row as written
(``AuditEntry``, ``AUDIT_COLUMNS``) and the filters that read rows back
(``AuditQuery``). Apart from the flow that writes them, so that the guard, the
controls and the review page can use them without the store's machinery.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Literal

from toolguard.errors import StoreError
from toolguard.store.storable import _JSON, _audit_json, _storable_text, storable_text, text_problem

Decision = Literal["accepted", "rejected", "replayed", "failed", "unknown"]
#: Decisions the store writes itself; the guard may add its own (the column is free text).
DECISIONS: tuple[str, ...] = ("accepted", "rejected", "replayed", "failed", "unknown")
IntentStatus = Literal["pending", "applied", "failed", "unknown"]


# --- records ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class IntentRecord:
    """What the store needs to know about one intent (all of it already validated).

    ``idempotency_key`` makes the write exactly-once; without it ``fenced()``
    still fences and audits, but a retry would apply again. ``args_hash`` is
    required with a key: the same key with another hash is a conflict.
    ``intent_id`` (the tool-call id), ``args`` (already redacted),
    ``node_attempt`` and ``policy_version`` (the version of the policy that
    decided, e.g. its hash) only go to the audit log.
    """

    tool: str
    idempotency_key: str | None = None
    args_hash: str | None = None
    agent: str | None = None
    workflow: str | None = None
    keys: tuple[str, ...] = ()
    intent_id: str | None = None
    args: Any = None
    node_attempt: int | None = None
    policy_version: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tool, str) or not self.tool:
            msg = f"an intent needs a tool name, got {self.tool!r}"
            raise StoreError(msg, reason="invalid_intent")
        if self.idempotency_key is not None and not (
                isinstance(self.idempotency_key, str) and self.idempotency_key):
            msg = f"idempotency_key must be a non-empty string or None, got {self.idempotency_key!r}"
            raise StoreError(msg, reason="invalid_intent")
        if self.idempotency_key is not None and not self.args_hash:
            msg = f"intent {self.idempotency_key!r} has an idempotency key but no args_hash"
            raise StoreError(msg, reason="invalid_intent")
        object.__setattr__(self, "keys", tuple(self.keys))
        for name in _INTENT_TEXT:
            value = getattr(self, name)
            for text in (value if name == "keys" else (value,)):
                if type(text) is str and text.isascii() and "\x00" not in text:
                    continue  # the usual text: nothing a store refuses
                problem = text_problem(text) if isinstance(text, str) else None
                if problem:
                    msg = f"intent field {name!r} {problem}: {text!r} (the stores cannot keep it)"
                    raise StoreError(msg, reason="invalid_intent")
        check_policy_version(self.policy_version, "invalid_intent")


#: The intent's text that identifies it in the stores: refused, never altered, if unstorable.
_INTENT_TEXT = ("tool", "idempotency_key", "args_hash", "agent", "workflow", "intent_id", "keys")


@dataclass(frozen=True, slots=True)
class Begun:
    """``begin_intent`` reserved the key: run the intent (``attempt`` counts from 1).

    ``previous_status`` is None for a new key, else the status of the earlier
    attempt that is being reconciled ('pending', 'failed' or 'unknown'): that
    attempt certainly did not apply, since applying records the result in the
    same transaction as the mutation.
    """

    idempotency_key: str
    attempt: int
    previous_status: str | None = None

    @property
    def reconciled(self) -> bool:
        return self.previous_status is not None


@dataclass(frozen=True, slots=True)
class Replay:
    """The intent was already applied: return ``result`` and run nothing."""

    idempotency_key: str
    result: Any
    attempts: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditEntry:
    """One audit row. ``id`` and ``at`` are set by the database.

    ``args`` must already be redacted: the store writes what it is given.
    ``policy_version`` names the version of the policy that decided (e.g. its
    hash); None (NULL) when the writer does not know it. Every row also gets a
    hash of its own content in the store (``row_hash``, see ``docs/audit.md``).
    """

    decision: str
    reason: str
    tool: str | None = None
    agent: str | None = None
    intent_id: str | None = None
    idempotency_key: str | None = None
    workflow: str | None = None
    keys: tuple[str, ...] = ()
    tokens: Mapping[str, int] = field(default_factory=dict)
    args: Any = None
    detail: str | None = None
    duration_ms: float | None = None
    node_attempt: int | None = None
    policy_version: str | None = None
    id: int | None = None
    at: datetime | None = None

    def __post_init__(self) -> None:
        if not self.decision or not self.reason:
            msg = "an audit entry needs a decision and a reason code"
            raise StoreError(msg, reason="invalid_audit")
        check_policy_version(self.policy_version, "invalid_audit")
        object.__setattr__(self, "keys", tuple(self.keys))
        object.__setattr__(self, "tokens", dict(self.tokens))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``at`` as ISO 8601 text, ``keys`` as a list."""
        data = asdict(self)
        data["keys"] = list(self.keys)
        data["at"] = self.at.isoformat() if self.at else None
        return data

    def insert_values(self, dialect: str) -> tuple[Any, ...]:
        """Column values in ``AUDIT_COLUMNS`` order; JSON columns (and SQLite's keys) as JSON text.

        Text a store could not keep (NUL, lone surrogates) gets U+FFFD instead
        (``storable_text``): an audit row is written whatever it records.
        """
        clean = _storable_text
        listed = [storable_text(k) for k in self.keys]
        keys: Any = listed if dialect == "postgresql" else _JSON.encode(listed)
        return (clean(self.agent), clean(self.tool), clean(self.intent_id),
                clean(self.idempotency_key), clean(self.workflow), storable_text(self.decision),
                storable_text(self.reason), keys,
                _JSON.encode({storable_text(k): v for k, v in self.tokens.items()}),
                None if self.args is None else _audit_json(self.args),
                clean(self.detail),
                # Exact types, as the columns keep them (the SQLite row hash is taken from these).
                None if self.duration_ms is None else float(self.duration_ms),
                None if self.node_attempt is None else int(self.node_attempt),
                clean(self.policy_version))


AUDIT_COLUMNS = ("agent", "tool", "intent_id", "idempotency_key", "workflow", "decision", "reason",
                 "keys", "tokens", "args", "detail", "duration_ms", "node_attempt", "policy_version")
AUDIT_SELECT = ("id", "at", *AUDIT_COLUMNS)
#: Longest ``policy_version`` the stores accept (a hash with a prefix fits many times over).
POLICY_VERSION_MAX = 200


def check_policy_version(value: object, reason: str) -> None:
    """``policy_version`` is None or a short non-empty string (a hash, a tag): refused otherwise."""
    if value is None:
        return
    if not isinstance(value, str) or not value or len(value) > POLICY_VERSION_MAX:
        msg = (f"policy_version must be None or a non-empty string of at most "
               f"{POLICY_VERSION_MAX} characters (e.g. the policy's hash), got {value!r}")
        raise StoreError(msg, reason=reason)



# --- audit queries -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditQuery:
    """Filters of ``query_audit``; ``where()`` renders them for one dialect."""

    decision: str | Collection[str] | None = None
    reason: str | Collection[str] | None = None
    tool: str | Collection[str] | None = None
    agent: str | Collection[str] | None = None
    key: str | None = None
    idempotency_key: str | None = None
    intent_id: str | None = None
    workflow: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    after_id: int | None = None
    limit: int | None = 100
    newest_first: bool = True

    def __post_init__(self) -> None:
        for moment in (self.since, self.until):
            if moment is not None and moment.tzinfo is None:
                msg = "since/until must be timezone-aware datetimes"
                raise StoreError(msg, reason="invalid_query")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 0):
            msg = f"limit must be a non-negative integer or None, got {self.limit!r}"
            raise StoreError(msg, reason="invalid_query")

    def where(self, dialect: str, moment: Callable[[datetime], Any]) -> tuple[str, list[Any]]:
        """A ``WHERE ...`` clause (or "") and its parameters, with ``%s`` placeholders."""
        clauses: list[str] = []
        params: list[Any] = []
        for column in ("decision", "reason", "tool", "agent"):
            value = getattr(self, column)
            if value is None:
                continue
            values = [value] if isinstance(value, str) else list(value)
            clauses.append(f"{column} IN ({', '.join(['%s'] * len(values))})" if values else "1 = 0")
            params.extend(values)
        for column in ("idempotency_key", "intent_id", "workflow"):
            value = getattr(self, column)
            if value is not None:
                clauses.append(f"{column} = %s")
                params.append(value)
        if self.key is not None:
            if dialect == "postgresql":
                clauses.append("keys @> ARRAY[%s]::text[]")
            else:
                clauses.append("EXISTS (SELECT 1 FROM json_each(toolguard_audit.keys) "
                               "WHERE json_each.value = %s)")
            params.append(self.key)
        if self.since is not None:
            clauses.append("at >= %s")
            params.append(moment(self.since))
        if self.until is not None:
            clauses.append("at < %s")
            params.append(moment(self.until))
        if self.after_id is not None:
            clauses.append("id > %s")
            params.append(self.after_id)
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", params

    def tail(self) -> tuple[str, list[Any]]:
        order = " ORDER BY id DESC" if self.newest_first else " ORDER BY id"
        if self.limit is None:
            return order, []
        return order + " LIMIT %s", [self.limit]


def finite_ms(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None
