-- toolguard guarded store, SQLite schema version 2: production controls.
--
-- Same tables and meaning as ../004_controls.sql (quotas, the kill switch,
-- approvals, the audit's policy_version). It depends only on 001. SQLite has no
-- stored functions: an admission is one BEGIN IMMEDIATE transaction run by
-- toolguard/limits/sqlite.py (prune the scope's expired entries, check, insert).
-- Times are milliseconds since the epoch (INTEGER) in the quota tables, ISO 8601
-- UTC text elsewhere. ALTER TABLE ... ADD COLUMN has no IF NOT EXISTS in SQLite:
-- the installer applies this file once (it records version 2).

CREATE TABLE IF NOT EXISTS toolguard_quota (
    scope      TEXT PRIMARY KEY CHECK (scope <> ''),
    used       REAL NOT NULL DEFAULT 0 CHECK (used >= 0),
    updated_ms INTEGER NOT NULL DEFAULT 0
);

CREATE TABLE IF NOT EXISTS toolguard_quota_entry (
    scope      TEXT NOT NULL,
    entry      TEXT NOT NULL CHECK (entry <> ''),
    amount     REAL NOT NULL CHECK (amount >= 0),
    expires_ms INTEGER NOT NULL,
    PRIMARY KEY (scope, entry)
);
CREATE INDEX IF NOT EXISTS toolguard_quota_entry_expiry ON toolguard_quota_entry (scope, expires_ms);

CREATE TABLE IF NOT EXISTS toolguard_pause (
    kind      TEXT NOT NULL CHECK (kind IN ('tool', 'agent', 'all')),
    name      TEXT NOT NULL CHECK (name <> ''),
    reason    TEXT,
    paused_by TEXT,
    paused_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (kind, name)
);

CREATE TABLE IF NOT EXISTS toolguard_approval (
    id               TEXT PRIMARY KEY CHECK (id <> ''),
    tool             TEXT NOT NULL,
    agent            TEXT,
    workflow         TEXT,
    idempotency_key  TEXT NOT NULL,
    args_hash        TEXT NOT NULL,
    policy_version   TEXT NOT NULL,
    keys             TEXT NOT NULL DEFAULT '[]',
    args             TEXT,
    why              TEXT,
    status           TEXT NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'approved', 'denied')),
    requested_at     TEXT NOT NULL,
    expires_at       TEXT NOT NULL,
    decided_by       TEXT,
    decided_at       TEXT,
    note             TEXT,
    edited_args      TEXT,
    edited_args_hash TEXT,
    UNIQUE (tool, idempotency_key)
);
CREATE INDEX IF NOT EXISTS toolguard_approval_pending ON toolguard_approval (requested_at)
    WHERE status = 'pending';

ALTER TABLE toolguard_audit ADD COLUMN policy_version TEXT;

INSERT OR IGNORE INTO toolguard_schema_version (version, name) VALUES (2, '002_controls');
