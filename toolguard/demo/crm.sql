-- The demo CRM's tables. They live in the CRM's own store (crm.db beside the agents'
-- store.db, or the toolguard_demo_crm schema on PostgreSQL), next to the toolguard tables
-- in which the CRM's FenceMiddleware keeps its fences, replays and audit log.
--
-- `pipeline` separates the guarded run from the unguarded one. A push sends the whole
-- lead record as the agent read it, the way a CRM "update record" call does.

CREATE TABLE IF NOT EXISTS toolguard_demo_crm_leads (
    pipeline     TEXT NOT NULL,
    lead_id      TEXT NOT NULL,
    company      TEXT NOT NULL,
    email        TEXT NOT NULL,
    employees    INTEGER,
    industry     TEXT,
    email_status TEXT,
    score        INTEGER NOT NULL,
    tier         TEXT,
    pushes       INTEGER NOT NULL,
    PRIMARY KEY (pipeline, lead_id)
);

-- One row per push the CRM applied (insert-only): how the demo tells a push applied twice
-- from a stale copy that landed last.
CREATE TABLE IF NOT EXISTS toolguard_demo_crm_pushes (
    pipeline TEXT NOT NULL,
    lead_id  TEXT NOT NULL,
    push     INTEGER NOT NULL,
    stage    TEXT NOT NULL,
    agent    TEXT NOT NULL,
    score    INTEGER NOT NULL,
    tier     TEXT
);
