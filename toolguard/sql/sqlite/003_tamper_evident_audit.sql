-- toolguard guarded store, SQLite schema version 3: a tamper-evident audit log.
--
-- Same tables and meaning as ../005_tamper_evident_audit.sql. It touches only the
-- audit log's tables and needs 002_controls.sql before it (which adds the audit's
-- policy_version column, part of every row's hash). Apply it
-- once (the installer records it in toolguard_schema_version; SQLite's ALTER
-- TABLE ADD COLUMN cannot be repeated).
--
-- SQLite has no SHA-256 in SQL: the Python store registers the function
-- toolguard_audit_row_hash(id, at, agent, ...) on its connections and computes
-- row_hash in the INSERT itself, from the values as they are stored (see
-- toolguard/store/sqlite.py and docs/audit.md for the canonical form). A client
-- that inserts without it leaves row_hash NULL: the next seal then covers the row
-- with the hash of its content at that time.

ALTER TABLE toolguard_audit ADD COLUMN row_hash BLOB;

CREATE TABLE IF NOT EXISTS toolguard_audit_seal (
    seq        INTEGER PRIMARY KEY CHECK (seq > 0),
    after_id   INTEGER NOT NULL UNIQUE CHECK (after_id >= 0),
    last_id    INTEGER NOT NULL,
    row_count  INTEGER NOT NULL CHECK (row_count > 0),
    rows       BLOB NOT NULL,
    prev_hash  TEXT NOT NULL CHECK (length(prev_hash) = 64),
    seal_hash  TEXT NOT NULL UNIQUE CHECK (length(seal_hash) = 64),
    sealed_at  TEXT NOT NULL,
    CHECK (last_id > after_id),
    CHECK (length(rows) = 40 * row_count)
);

CREATE TABLE IF NOT EXISTS toolguard_audit_retention (
    through_seq INTEGER PRIMARY KEY CHECK (through_seq > 0),
    through_id  INTEGER NOT NULL,
    final_hash  TEXT NOT NULL CHECK (length(final_hash) = 64),
    rows        INTEGER NOT NULL,
    seals       INTEGER NOT NULL,
    file_sha256 TEXT,
    dropped_at  TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

-- Append-only, like the log. Dropping an exported range drops and re-creates the
-- delete triggers inside its own write transaction (toolguard audit export --drop).
CREATE TRIGGER IF NOT EXISTS toolguard_audit_seal_no_update BEFORE UPDATE ON toolguard_audit_seal
BEGIN
    SELECT RAISE(ABORT, 'toolguard_audit_seal is append-only: UPDATE is not allowed');
END;

CREATE TRIGGER IF NOT EXISTS toolguard_audit_seal_no_delete BEFORE DELETE ON toolguard_audit_seal
BEGIN
    SELECT RAISE(ABORT, 'toolguard_audit_seal is append-only: DELETE is not allowed');
END;

CREATE TRIGGER IF NOT EXISTS toolguard_audit_retention_no_update
BEFORE UPDATE ON toolguard_audit_retention
BEGIN
    SELECT RAISE(ABORT, 'toolguard_audit_retention is append-only: UPDATE is not allowed');
END;

CREATE TRIGGER IF NOT EXISTS toolguard_audit_retention_no_delete
BEFORE DELETE ON toolguard_audit_retention
BEGIN
    SELECT RAISE(ABORT, 'toolguard_audit_retention is append-only: DELETE is not allowed');
END;

INSERT OR IGNORE INTO toolguard_schema_version (version, name)
VALUES (3, '003_tamper_evident_audit');
