-- toolguard guarded store, SQLite schema version 4: the text of every policy version that
-- decided.
--
-- Same table and meaning as ../007_policy_versions.sql: a guard writes the canonical
-- content of a policy version (and the YAML files it was loaded from) when it first
-- decides under it; the review page and `toolguard audit show` show the deciding rule
-- from it. SQLite has no SHA-256 in SQL: the store checks the content against its
-- digest when it writes and when it reads. Append-only; needs only 001.

CREATE TABLE IF NOT EXISTS toolguard_policy_version (
    digest    TEXT PRIMARY KEY CHECK (length(digest) = 64 AND digest NOT GLOB '*[^0-9a-f]*'),
    content   TEXT NOT NULL,
    sources   TEXT CHECK (sources IS NULL OR json_type(sources) = 'array'),
    first_at  TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE TRIGGER IF NOT EXISTS toolguard_policy_version_no_update
BEFORE UPDATE ON toolguard_policy_version
BEGIN
    SELECT RAISE(ABORT, 'toolguard_policy_version is append-only: UPDATE is not allowed');
END;

CREATE TRIGGER IF NOT EXISTS toolguard_policy_version_no_delete
BEFORE DELETE ON toolguard_policy_version
BEGIN
    SELECT RAISE(ABORT, 'toolguard_policy_version is append-only: DELETE is not allowed');
END;

INSERT OR IGNORE INTO toolguard_schema_version (version, name)
VALUES (4, '004_policy_versions');
