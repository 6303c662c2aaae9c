-- toolguard guarded store, PostgreSQL schema version 2: the fast path.
--
-- Apply on top of 001_initial.sql (same rules: idempotent, one transaction):
--   psql -v ON_ERROR_STOP=1 --single-transaction -f 002_fast_path.sql
--
-- A guarded call no longer reserves its idempotency key in a round trip of its
-- own (toolguard_begin_intent stays, for callers who want to know before they
-- lock): the fenced transaction's first statement, toolguard_enter, creates and
-- locks the intent row, reports a replay and rejects a conflict. So that
-- `attempts` still counts the tries that reached the store, toolguard_enter now
-- counts an attempt that reconciles a 'failed' or 'unknown' intent (a 'pending'
-- row was counted by toolguard_begin_intent already). The count lands only if
-- the transaction commits; a failed attempt is counted where its failure is
-- recorded (the client upserts the row as 'failed'/'unknown', counting it
-- unless it is 'pending').
--
-- It also fences a single key (the common case) with toolguard_fence directly,
-- skipping toolguard_fence_all's sort: one key has nothing to order, and the
-- checks are the same (a NULL, empty or non-positive value raises TG002). An
-- empty key array, which version 1 let through unfenced, now raises TG002 too
-- (the Python client never sends one).
--
-- Signature and result are unchanged: a client written for version 1 works on
-- version 2, and the version-2 client works on version 1 (only the counting
-- differs).

SELECT pg_advisory_xact_lock(hashtext('toolguard.install'));

-- First statement of a fenced transaction: fence every key (sorted), then lock
-- the intent row (creating it if it does not exist, with p_intent_keys as its
-- resource keys, default the fenced keys) and report whether it is already
-- applied, in which case the caller must roll back and return `result` instead
-- of running the mutation again. The same key for another tool or other
-- arguments raises TG004.
CREATE OR REPLACE FUNCTION toolguard_enter(
    p_keys text[], p_tokens bigint[],
    p_idempotency_key text, p_tool text, p_agent text, p_workflow text, p_args_hash text,
    p_intent_keys text[] DEFAULT NULL)
RETURNS TABLE (applied boolean, result jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v toolguard_intent%ROWTYPE;
BEGIN
    IF coalesce(cardinality(p_keys), 0) = 0 THEN
        RAISE EXCEPTION USING ERRCODE = 'TG002',
            MESSAGE = 'a fenced transaction needs at least one key and its token';
    END IF;
    IF cardinality(p_keys) = 1 AND cardinality(p_tokens) = 1 THEN
        -- p_keys[1] is NULL for an array not indexed from 1: toolguard_fence rejects it.
        PERFORM toolguard_fence(p_keys[1], p_tokens[1]);
    ELSE
        PERFORM toolguard_fence_all(p_keys, p_tokens);
    END IF;
    IF p_idempotency_key IS NULL THEN
        RETURN QUERY SELECT false, NULL::jsonb;
        RETURN;
    END IF;
    INSERT INTO toolguard_intent AS i (idempotency_key, tool, agent, workflow, keys, args_hash)
    VALUES (p_idempotency_key, p_tool, p_agent, p_workflow,
            coalesce(nullif(p_intent_keys, '{}'), p_keys, '{}'), p_args_hash)
    ON CONFLICT (idempotency_key) DO UPDATE SET
        updated_at = now(),
        attempts = i.attempts + CASE WHEN i.status IN ('failed', 'unknown')
                                          AND i.tool = EXCLUDED.tool
                                          AND i.args_hash = EXCLUDED.args_hash
                                     THEN 1 ELSE 0 END
    RETURNING i.* INTO v;
    IF v.tool IS DISTINCT FROM p_tool OR v.args_hash IS DISTINCT FROM p_args_hash THEN
        RAISE EXCEPTION USING ERRCODE = 'TG004',
            MESSAGE = format('idempotency key %s was already used for %s with other arguments',
                             p_idempotency_key, v.tool),
            DETAIL = json_build_object('idempotency_key', p_idempotency_key)::text;
    END IF;
    RETURN QUERY SELECT v.status = 'applied', v.result;
END;
$$;

INSERT INTO toolguard_schema_version (version, name) VALUES (2, '002_fast_path')
ON CONFLICT (version) DO NOTHING;
