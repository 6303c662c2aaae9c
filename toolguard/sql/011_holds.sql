-- toolguard guarded store, PostgreSQL schema version 11: who holds what and who waits for it,
-- where every process sees it (holding a record through a model's turn).
--
-- Apply on top of the earlier files (same rules: idempotent, one transaction):
--   psql -v ON_ERROR_STOP=1 --single-transaction -f 011_holds.sql
--
-- A read with `hold: true` keeps its key's lock for its caller (agent + conversation) until the
-- caller writes the key. Holds taken across calls can wait on each other in a cycle; the lock
-- servers cannot see it (each sees one key), so the guards keep the wait-for graph here: a row
-- per held key (its holder, and when the holder's oldest hold began, which decides who yields),
-- and a row per key a holding caller waits for. Each waiter searches the graph for a cycle
-- through itself when it starts waiting and while it waits; the youngest caller on a cycle
-- yields. Times are seconds since the epoch on the writing guard's clock; a row past its
-- `expires` counts as gone (a dead process's rows lapse with its hold or wait).

SELECT pg_advisory_xact_lock(hashtext('toolguard.install'));

CREATE TABLE IF NOT EXISTS toolguard_hold (
    key     text PRIMARY KEY CHECK (key <> ''),
    caller  text NOT NULL CHECK (caller <> ''),
    since   double precision NOT NULL,
    expires double precision NOT NULL
);

CREATE TABLE IF NOT EXISTS toolguard_hold_wait (
    caller  text NOT NULL CHECK (caller <> ''),
    key     text NOT NULL CHECK (key <> ''),
    expires double precision NOT NULL,
    PRIMARY KEY (caller, key)
);

INSERT INTO toolguard_schema_version (version, name) VALUES (11, '011_holds')
ON CONFLICT (version) DO NOTHING;
