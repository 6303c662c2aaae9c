-- toolguard guarded store, SQLite schema version 6: who holds what and who waits for it.
--
-- Same tables and meaning as ../011_holds.sql: a row per key held through a model's turn
-- (`hold: true`), a row per key a holding caller waits for; the guards search them for a
-- cycle of waits. Times are seconds since the epoch.

CREATE TABLE IF NOT EXISTS toolguard_hold (
    key     TEXT PRIMARY KEY CHECK (key <> ''),
    caller  TEXT NOT NULL CHECK (caller <> ''),
    since   REAL NOT NULL,
    expires REAL NOT NULL
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS toolguard_hold_wait (
    caller  TEXT NOT NULL CHECK (caller <> ''),
    key     TEXT NOT NULL CHECK (key <> ''),
    expires REAL NOT NULL,
    PRIMARY KEY (caller, key)
) WITHOUT ROWID;

INSERT OR IGNORE INTO toolguard_schema_version (version, name) VALUES (6, '006_holds');
