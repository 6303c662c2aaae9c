-- The lead qualifier's tables. Portable: the same file runs on SQLite and PostgreSQL.
--
-- `pipeline` separates the guarded run from the unguarded one (and test runs from
-- each other) in one database. Every write is a read-modify-write of the whole
-- record, the way an ORM `save()` or a CRM "update record" call does it.

CREATE TABLE IF NOT EXISTS toolguard_demo_leads (
    pipeline     TEXT NOT NULL,
    lead_id      TEXT NOT NULL,
    company      TEXT NOT NULL,
    email        TEXT NOT NULL,
    employees    INTEGER,
    industry     TEXT,
    email_status TEXT,
    score        INTEGER NOT NULL DEFAULT 0,
    tier         TEXT,
    version      INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (pipeline, lead_id)
);

-- One row per applied write, inserted by the tool with its update (insert-only, so
-- it never loses a row): how the demo tells a double-applied retry from a lost
-- update. `detail` is JSON: what the write set, its score delta, what it saw.
CREATE TABLE IF NOT EXISTS toolguard_demo_lead_events (
    pipeline TEXT NOT NULL,
    lead_id  TEXT NOT NULL,
    version  INTEGER NOT NULL,
    agent    TEXT NOT NULL,
    tool     TEXT NOT NULL,
    call_id  TEXT NOT NULL,
    detail   TEXT NOT NULL
);
