-- toolguard guarded store, PostgreSQL schema version 4: production controls.
--
-- Apply on top of the earlier files (same rules: idempotent, one transaction):
--   psql -v ON_ERROR_STOP=1 --single-transaction -f 004_controls.sql
-- It depends only on 001 (nothing of 002 or 003).
--
--   toolguard_quota, toolguard_quota_entry   quotas (rate, in-flight, budget), see below
--   toolguard_pause                          the kill switch (`toolguard pause`)
--   toolguard_approval                       approval requests and who decided them
--   toolguard_audit.policy_version           the digest of the policy that decided
--
-- Quotas count entries that expire: a call counted by a rate or budget quota
-- stays counted for the window (a sliding window: at most `limit` in any
-- trailing window), an in-flight slot until it is released or its lease ends
-- (a crashed process frees its slots within the lease). `toolguard_quota.used`
-- is the sum of the live entries' amounts; expired entries are pruned by the
-- next admission of the same scope, which subtracts them, so an admission costs
-- O(1) amortized and never scans a window.
-- An entry's id is the intent's idempotency key (rate, budget) or the attempt's
-- id (in-flight): an entry already present is not counted twice, so a retried
-- or replayed intent does not draw a budget again.

SELECT pg_advisory_xact_lock(hashtext('toolguard.install'));

CREATE TABLE IF NOT EXISTS toolguard_quota (
    scope      text PRIMARY KEY CHECK (scope <> ''),
    used       numeric NOT NULL DEFAULT 0 CHECK (used >= 0),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS toolguard_quota_entry (
    scope      text NOT NULL,
    entry      text NOT NULL CHECK (entry <> ''),
    amount     numeric NOT NULL CHECK (amount >= 0),
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (scope, entry)
);
CREATE INDEX IF NOT EXISTS toolguard_quota_entry_expiry ON toolguard_quota_entry (scope, expires_at);

-- Admit one call against every quota it draws on, all or nothing, in one statement.
--   p_scopes   the counters (distinct), p_limits their limits, p_costs what this call adds,
--   p_ttl_ms   how long its entry counts, p_entries the entry ids
-- Returns refused = 0 and fresh[i] (false: the entry was counted before) when admitted;
-- else refused = i (1-based) of the first quota that refuses, retry_ms = when enough of its
-- entries will have expired (-1: the cost alone is over the limit), and nothing is counted.
-- Scope rows are locked in one canonical order, so admissions cannot deadlock; the
-- clock is read after the locks, so a call that waited is counted from when it got in.
CREATE OR REPLACE FUNCTION toolguard_quota_admit(
    p_scopes text[], p_limits numeric[], p_costs numeric[], p_ttl_ms bigint[], p_entries text[])
RETURNS TABLE (refused integer, retry_ms bigint, fresh boolean[])
LANGUAGE plpgsql AS $$
DECLARE
    n integer := coalesce(cardinality(p_scopes), 0);
    v_now timestamptz;
    v_used numeric[] := '{}';
    v_fresh boolean[] := '{}';
    v_gone numeric;
    v_u numeric;
    v_need numeric;
    v_at timestamptz;
    i integer;
BEGIN
    IF n = 0 OR coalesce(cardinality(p_limits), 0) <> n OR coalesce(cardinality(p_costs), 0) <> n
       OR coalesce(cardinality(p_ttl_ms), 0) <> n OR coalesce(cardinality(p_entries), 0) <> n
       OR (SELECT count(DISTINCT s) FROM unnest(p_scopes) s) <> n
       OR EXISTS (SELECT 1 FROM unnest(p_scopes, p_limits, p_costs, p_ttl_ms, p_entries)
                         AS u(s, l, c, t, e)
                  WHERE s IS NULL OR s = '' OR l IS NULL OR l <= 0 OR c IS NULL OR c < 0
                     OR t IS NULL OR t <= 0 OR e IS NULL OR e = '') THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'toolguard_quota_admit needs distinct non-empty scopes, each with a limit > 0, '
                      'a cost >= 0, a ttl > 0 and an entry id';
    END IF;
    INSERT INTO toolguard_quota AS q (scope)
    SELECT s FROM unnest(p_scopes) AS s ORDER BY s COLLATE "C"
    ON CONFLICT (scope) DO UPDATE SET updated_at = now();
    v_now := clock_timestamp();
    FOR i IN 1 .. n LOOP
        WITH gone AS (DELETE FROM toolguard_quota_entry
                      WHERE scope = p_scopes[i] AND expires_at <= v_now RETURNING amount)
        SELECT coalesce(sum(amount), 0) INTO v_gone FROM gone;
        IF v_gone > 0 THEN
            UPDATE toolguard_quota SET used = greatest(used - v_gone, 0)
            WHERE scope = p_scopes[i] RETURNING used INTO v_u;
        ELSE
            SELECT used INTO v_u FROM toolguard_quota WHERE scope = p_scopes[i];
        END IF;
        v_used[i] := v_u;
        v_fresh[i] := NOT EXISTS (SELECT 1 FROM toolguard_quota_entry
                                  WHERE scope = p_scopes[i] AND entry = p_entries[i]);
        IF v_fresh[i] AND v_u + p_costs[i] > p_limits[i] THEN
            IF p_costs[i] > p_limits[i] THEN
                RETURN QUERY SELECT i, -1::bigint, NULL::boolean[];
                RETURN;
            END IF;
            v_need := v_u + p_costs[i] - p_limits[i];
            SELECT x.expires_at INTO v_at
            FROM (SELECT e.expires_at, sum(e.amount) OVER (ORDER BY e.expires_at, e.entry) AS freed
                  FROM toolguard_quota_entry e WHERE e.scope = p_scopes[i]) AS x
            WHERE x.freed >= v_need ORDER BY x.expires_at LIMIT 1;
            RETURN QUERY SELECT i, greatest(ceil(extract(epoch FROM coalesce(v_at, v_now) - v_now)
                                                 * 1000)::bigint, 1), NULL::boolean[];
            RETURN;
        END IF;
    END LOOP;
    FOR i IN 1 .. n LOOP
        IF v_fresh[i] THEN
            INSERT INTO toolguard_quota_entry (scope, entry, amount, expires_at)
            VALUES (p_scopes[i], p_entries[i], p_costs[i],
                    v_now + make_interval(secs => p_ttl_ms[i] / 1000.0));
            UPDATE toolguard_quota SET used = used + p_costs[i], updated_at = v_now
            WHERE scope = p_scopes[i];
        END IF;
    END LOOP;
    RETURN QUERY SELECT 0, 0::bigint, v_fresh;
END;
$$;

-- Take entries back: a finished call's in-flight slot, or a budget drawn by a call that
-- did not apply. Locks the scope rows in the same order as toolguard_quota_admit.
-- Returns how many entries were removed.
CREATE OR REPLACE FUNCTION toolguard_quota_release(p_scopes text[], p_entries text[])
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_removed integer;
BEGIN
    PERFORM 1 FROM toolguard_quota WHERE scope = ANY (p_scopes) ORDER BY scope COLLATE "C" FOR UPDATE;
    WITH gone AS (
        DELETE FROM toolguard_quota_entry e
        USING unnest(p_scopes, p_entries) AS u(s, en)
        WHERE e.scope = u.s AND e.entry = u.en
        RETURNING e.scope, e.amount),
    per_scope AS (
        SELECT scope, sum(amount) AS total, count(*) AS removed FROM gone GROUP BY scope),
    updated AS (
        UPDATE toolguard_quota q SET used = greatest(q.used - p.total, 0), updated_at = now()
        FROM per_scope p WHERE q.scope = p.scope RETURNING p.removed)
    SELECT coalesce(sum(removed), 0) INTO v_removed FROM updated;
    RETURN v_removed;
END;
$$;

-- Extend live entries (a long call's in-flight slots) to p_ttl_ms from now. Returns, per
-- entry, whether it was still live (false: it expired or was released: the slot is lost).
CREATE OR REPLACE FUNCTION toolguard_quota_renew(p_scopes text[], p_entries text[], p_ttl_ms bigint)
RETURNS boolean[]
LANGUAGE plpgsql AS $$
DECLARE
    v_found boolean[];
BEGIN
    WITH renewed AS (
        UPDATE toolguard_quota_entry e
        SET expires_at = clock_timestamp() + make_interval(secs => p_ttl_ms / 1000.0)
        FROM unnest(p_scopes, p_entries) AS u(s, en)
        WHERE e.scope = u.s AND e.entry = u.en AND e.expires_at > clock_timestamp()
        RETURNING e.scope, e.entry)
    SELECT array_agg(EXISTS (SELECT 1 FROM renewed r WHERE r.scope = u.s AND r.entry = u.en)
                     ORDER BY u.ord)
    INTO v_found
    FROM unnest(p_scopes, p_entries) WITH ORDINALITY AS u(s, en, ord);
    RETURN v_found;
END;
$$;

-- The kill switch: a paused tool, agent, or everything (kind 'all', name '*').
CREATE TABLE IF NOT EXISTS toolguard_pause (
    kind      text NOT NULL CHECK (kind IN ('tool', 'agent', 'all')),
    name      text NOT NULL CHECK (name <> ''),
    reason    text,
    paused_by text,
    paused_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kind, name)
);

-- Approval requests, bound to the intent they were made for: its tool, idempotency key,
-- arguments' hash and the policy digest. `args` is redacted (what the person sees);
-- `edited_args` is what the person approved instead (re-validated before it runs).
CREATE TABLE IF NOT EXISTS toolguard_approval (
    id               text PRIMARY KEY CHECK (id <> ''),
    tool             text NOT NULL,
    agent            text,
    workflow         text,
    idempotency_key  text NOT NULL,
    args_hash        text NOT NULL,
    policy_version   text NOT NULL,
    keys             text[] NOT NULL DEFAULT '{}',
    args             jsonb,
    why              text,
    status           text NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'approved', 'denied')),
    requested_at     timestamptz NOT NULL DEFAULT now(),
    expires_at       timestamptz NOT NULL,
    decided_by       text,
    decided_at       timestamptz,
    note             text,
    edited_args      jsonb,
    edited_args_hash text,
    UNIQUE (tool, idempotency_key)
);
CREATE INDEX IF NOT EXISTS toolguard_approval_pending ON toolguard_approval (requested_at)
    WHERE status = 'pending';

ALTER TABLE toolguard_audit ADD COLUMN IF NOT EXISTS policy_version text;

INSERT INTO toolguard_schema_version (version, name) VALUES (4, '004_controls')
ON CONFLICT (version) DO NOTHING;
