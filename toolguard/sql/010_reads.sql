-- toolguard guarded store, PostgreSQL schema version 10: what a caller read is checked when it
-- writes (decisions across tool calls).
--
-- Apply on top of the earlier files (same rules: idempotent, one transaction):
--   psql -v ON_ERROR_STOP=1 --single-transaction -f 010_reads.sql
--
-- A model reads in one tool call and writes what it decided in a later one. Fencing tokens do
-- not tell whether a record changed since a caller read it (one lease may write several times
-- under one token), so every key gets a version: a number that grows with every write the
-- store accepts on it, advanced inside the fenced transaction (toolguard_finish). A read
-- records what its caller (agent + conversation) saw of each key in toolguard_read; a later
-- write by that caller is checked against it by toolguard_read_check, under row locks taken in
-- one sorted order (written keys FOR UPDATE, keys the decision rests on FOR SHARE), so two
-- writes that each decide on the other's key never deadlock and never both commit unnoticed.

SELECT pg_advisory_xact_lock(hashtext('toolguard.install'));

-- One row per key ever written or decided on: its version and who wrote it last (for the
-- operator: the intent and agent of the write a stale read missed).
CREATE TABLE IF NOT EXISTS toolguard_version (
    key        text PRIMARY KEY CHECK (key <> ''),
    version    bigint NOT NULL DEFAULT 0 CHECK (version >= 0),
    agent      text,
    intent_id  text,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- What each caller last saw of each key. A caller's newer read (or its own accepted write)
-- replaces its older observation; an observation older than the policy's read_ttl_s counts as
-- none.
CREATE TABLE IF NOT EXISTS toolguard_read (
    caller      text NOT NULL CHECK (caller <> ''),
    key         text NOT NULL CHECK (key <> ''),
    version     bigint NOT NULL CHECK (version >= 0),
    observed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (caller, key)
);

-- Advance the version of every written key (sorted, so two writers lock rows in one order).
CREATE OR REPLACE FUNCTION toolguard_written(p_keys text[], p_agent text, p_intent_id text)
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO toolguard_version AS v (key, version, agent, intent_id)
    SELECT k, 1, p_agent, p_intent_id FROM unnest(p_keys) AS k WHERE k <> '' ORDER BY k
    ON CONFLICT (key) DO UPDATE SET version = v.version + 1, agent = EXCLUDED.agent,
        intent_id = EXCLUDED.intent_id, updated_at = now();
$$;

-- As version 9, and every accepted write advances its keys' versions in the same call.
CREATE OR REPLACE FUNCTION toolguard_finish(
    p_idempotency_key text, p_result json, p_tokens jsonb,
    p_agent text, p_tool text, p_intent_id text, p_audit_idempotency_key text, p_workflow text,
    p_decision text, p_reason text, p_keys text[], p_audit_tokens jsonb, p_args jsonb,
    p_detail text, p_duration_ms double precision, p_node_attempt integer,
    p_policy_version text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM toolguard_record(p_idempotency_key, p_result, p_tokens);  -- TG003 if none
    PERFORM toolguard_written(p_keys, p_agent, p_intent_id);
    INSERT INTO toolguard_audit (agent, tool, intent_id, idempotency_key, workflow, decision,
                                 reason, keys, tokens, args, detail, duration_ms, node_attempt,
                                 policy_version)
    VALUES (p_agent, p_tool, p_intent_id, p_audit_idempotency_key, p_workflow, p_decision,
            p_reason, p_keys, p_audit_tokens, p_args, p_detail, p_duration_ms, p_node_attempt,
            p_policy_version);
END;
$$;

-- Lock the version rows of the written keys (FOR UPDATE) and of the keys the decision rests on
-- (FOR SHARE), one key at a time in one sorted order, making missing rows (version 0) on the
-- way; then return, per key, the caller's current observation (NULL: none younger than
-- p_ttl_s) beside the key's version and last writer. Called right after toolguard_enter, in
-- the fenced transaction: the fence rows are taken before any version row by every writer, so
-- the two phases cannot wait on each other in a cycle. Waiting for a version row is bounded by
-- p_wait_ms (lock_not_available, 55P03, after it). Decides nothing: the caller compares.
CREATE OR REPLACE FUNCTION toolguard_read_check(
    p_caller text, p_written text[], p_decides text[], p_ttl_s double precision,
    p_wait_ms integer)
RETURNS TABLE (key text, decided boolean, observed bigint, current bigint, agent text,
               intent_id text)
LANGUAGE plpgsql AS $$
DECLARE
    v_key text;
    v_keys text[];
    v_timeout text := current_setting('lock_timeout');
BEGIN
    v_keys := ARRAY(SELECT DISTINCT k FROM unnest(coalesce(p_written, '{}') ||
                                                  coalesce(p_decides, '{}')) AS k
                    WHERE k <> '' ORDER BY k);
    PERFORM set_config('lock_timeout', greatest(coalesce(p_wait_ms, 0), 1)::text || 'ms', true);
    FOREACH v_key IN ARRAY v_keys LOOP
        INSERT INTO toolguard_version (key) VALUES (v_key) ON CONFLICT DO NOTHING;
        IF v_key = ANY(p_written) THEN
            PERFORM 1 FROM toolguard_version v WHERE v.key = v_key FOR UPDATE;
        ELSE
            PERFORM 1 FROM toolguard_version v WHERE v.key = v_key FOR SHARE;
        END IF;
    END LOOP;
    PERFORM set_config('lock_timeout', v_timeout, true);
    RETURN QUERY
    SELECT v.key, NOT (v.key = ANY(coalesce(p_written, '{}'))), r.version, v.version, v.agent,
           v.intent_id
    FROM toolguard_version v
    LEFT JOIN toolguard_read r
           ON r.caller = p_caller AND r.key = v.key
          AND r.observed_at > now() - make_interval(secs => p_ttl_s)
    WHERE v.key = ANY(v_keys)
    ORDER BY v.key;
END;
$$;

-- Record what a caller saw: each key at the version given (a read: the versions read before
-- the tool's own reads), or at its current version (p_versions NULL: the caller's own write,
-- read-your-writes).
CREATE OR REPLACE FUNCTION toolguard_observe(p_caller text, p_keys text[], p_versions bigint[])
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO toolguard_read AS r (caller, key, version, observed_at)
    SELECT p_caller, o.key, coalesce(o.version, v.version, 0), now()
    FROM unnest(p_keys, coalesce(p_versions, '{}'::bigint[])) AS o(key, version)
    LEFT JOIN toolguard_version v ON v.key = o.key
    WHERE o.key IS NOT NULL AND o.key <> ''
    ORDER BY o.key
    ON CONFLICT (caller, key) DO UPDATE SET version = EXCLUDED.version,
        observed_at = EXCLUDED.observed_at;
$$;

INSERT INTO toolguard_schema_version (version, name) VALUES (10, '010_reads')
ON CONFLICT (version) DO NOTHING;
