-- toolguard guarded store, SQLite schema version 5: what a caller read is checked when it
-- writes.
--
-- Same tables and meaning as ../010_reads.sql: a version per key, advanced by every accepted
-- fenced write, and what each caller (agent + conversation) last saw of each key. The store
-- reads, checks and advances them in its own statements (SQLite has no stored functions);
-- writers hold the database's write lock, so no row locks are needed. observed_at is the
-- store's clock in seconds since the epoch (a read's age is checked against read_ttl_s).

CREATE TABLE IF NOT EXISTS toolguard_version (
    key        TEXT PRIMARY KEY CHECK (key <> ''),
    version    INTEGER NOT NULL DEFAULT 0 CHECK (version >= 0),
    agent      TEXT,
    intent_id  TEXT,
    updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE TABLE IF NOT EXISTS toolguard_read (
    caller      TEXT NOT NULL CHECK (caller <> ''),
    key         TEXT NOT NULL CHECK (key <> ''),
    version     INTEGER NOT NULL CHECK (version >= 0),
    observed_at REAL NOT NULL,
    PRIMARY KEY (caller, key)
) WITHOUT ROWID;

INSERT OR IGNORE INTO toolguard_schema_version (version, name) VALUES (5, '005_reads');
