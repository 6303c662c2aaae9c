-- toolguard guarded store, SQLite schema version 1 (the embedded default).
--
-- Same tables and meaning as ../001_initial.sql. SQLite has no stored
-- functions: the fence check and advance is one upsert the caller runs inside
-- its BEGIN IMMEDIATE transaction (see toolguard/store/sqlite.py):
--   INSERT INTO toolguard_high_water (key, token) VALUES (?, ?)
--   ON CONFLICT (key) DO UPDATE SET token = excluded.token, updated_at = ...
--     WHERE toolguard_high_water.token <= excluded.token
--   RETURNING token;          -- no row returned: the token is stale
-- Arrays and JSON values are stored as JSON text; times as ISO 8601 UTC text.
-- Running it twice changes nothing.

CREATE TABLE IF NOT EXISTS toolguard_schema_version (
    version      INTEGER PRIMARY KEY,
    name         TEXT NOT NULL,
    installed_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE TABLE IF NOT EXISTS toolguard_high_water (
    key        TEXT PRIMARY KEY CHECK (key <> ''),
    token      INTEGER NOT NULL CHECK (typeof(token) = 'integer' AND token > 0),
    updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE TABLE IF NOT EXISTS toolguard_intent (
    idempotency_key TEXT PRIMARY KEY CHECK (idempotency_key <> ''),
    tool            TEXT NOT NULL,
    agent           TEXT,
    workflow        TEXT,
    keys            TEXT NOT NULL DEFAULT '[]',
    args_hash       TEXT NOT NULL,
    status          TEXT NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'applied', 'failed', 'unknown')),
    tokens          TEXT,
    result          TEXT,
    attempts        INTEGER NOT NULL DEFAULT 1 CHECK (attempts >= 0),
    last_error      TEXT,
    created_at      TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    updated_at      TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    applied_at      TEXT
);
CREATE INDEX IF NOT EXISTS toolguard_intent_tool_status ON toolguard_intent (tool, status);

CREATE TABLE IF NOT EXISTS toolguard_audit (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    at              TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    agent           TEXT,
    tool            TEXT,
    intent_id       TEXT,
    idempotency_key TEXT,
    workflow        TEXT,
    decision        TEXT NOT NULL CHECK (decision <> ''),
    reason          TEXT NOT NULL CHECK (reason <> ''),
    keys            TEXT NOT NULL DEFAULT '[]',
    tokens          TEXT NOT NULL DEFAULT '{}',
    args            TEXT,
    detail          TEXT,
    duration_ms     REAL,
    node_attempt    INTEGER
);
CREATE INDEX IF NOT EXISTS toolguard_audit_at ON toolguard_audit (at);
CREATE INDEX IF NOT EXISTS toolguard_audit_tool_at ON toolguard_audit (tool, at);
CREATE INDEX IF NOT EXISTS toolguard_audit_idempotency_key ON toolguard_audit (idempotency_key);
CREATE INDEX IF NOT EXISTS toolguard_audit_intent_id ON toolguard_audit (intent_id);

-- Append-only. SQLite has no TRUNCATE: "DELETE FROM t" without WHERE fires
-- this trigger too (a DELETE trigger disables the truncate optimisation).
CREATE TRIGGER IF NOT EXISTS toolguard_audit_no_update BEFORE UPDATE ON toolguard_audit
BEGIN
    SELECT RAISE(ABORT, 'toolguard_audit is append-only: UPDATE is not allowed');
END;

CREATE TRIGGER IF NOT EXISTS toolguard_audit_no_delete BEFORE DELETE ON toolguard_audit
BEGIN
    SELECT RAISE(ABORT, 'toolguard_audit is append-only: DELETE is not allowed');
END;

INSERT OR IGNORE INTO toolguard_schema_version (version, name) VALUES (1, '001_initial');
