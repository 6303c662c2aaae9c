-- toolguard guarded store, PostgreSQL schema version 3: stale blockers are ended, results are exact.
--
-- Apply on top of 002_fast_path.sql (same rules: idempotent, one transaction):
--   psql -v ON_ERROR_STOP=1 --single-transaction -f 003_stale_blockers_exact_results.sql
--
-- Results are stored exactly as recorded.
--
--    toolguard_intent.result becomes `json` (the text as given) instead of
--    `jsonb`: jsonb refused strings with NUL (\u0000), reordered object keys and
--    turned 1e16 into 10000000000000000. The new toolguard_record(key, result
--    json, tokens jsonb) records it; toolguard_apply(key, result jsonb, tokens
--    jsonb) stays for older clients (their results go through jsonb as before).
--    toolguard_enter and toolguard_begin_intent now return `result json`: the
--    same values to any JSON parser.
--
-- Old clients keep working: toolguard_enter and toolguard_apply keep their
-- signatures. A client of this version needs this
-- schema (it calls toolguard_record).

SELECT pg_advisory_xact_lock(hashtext('toolguard.install'));

-- --- exact results ---------------------------------------------------------------------------------

DO $$
BEGIN
    IF (SELECT atttypid FROM pg_attribute
        WHERE attrelid = 'toolguard_intent'::regclass AND attname = 'result') = 'jsonb'::regtype THEN
        ALTER TABLE toolguard_intent ALTER COLUMN result TYPE json USING result::json;
    END IF;
END;
$$;

-- Last statement before COMMIT: record the intent's result (exactly as given) and
-- the tokens it was applied under. The intent row is locked by toolguard_enter.
CREATE OR REPLACE FUNCTION toolguard_record(p_idempotency_key text, p_result json, p_tokens jsonb)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE toolguard_intent
    SET status = 'applied', result = p_result, tokens = p_tokens, last_error = NULL,
        applied_at = now(), updated_at = now()
    WHERE idempotency_key = p_idempotency_key AND status <> 'applied';
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'TG003',
            MESSAGE = format('no unapplied intent %s to record (call toolguard_enter first)',
                             p_idempotency_key);
    END IF;
END;
$$;

-- Version 1 and 2 clients: the same, with the result as jsonb.
CREATE OR REPLACE FUNCTION toolguard_apply(p_idempotency_key text, p_result jsonb, p_tokens jsonb)
RETURNS void
LANGUAGE sql AS $$
    SELECT toolguard_record(p_idempotency_key, p_result::json, p_tokens)
$$;

-- The return type changes (result json), so both are dropped and created again.
DROP FUNCTION IF EXISTS toolguard_begin_intent(text, text, text, text, text[], text);
CREATE FUNCTION toolguard_begin_intent(
    p_idempotency_key text, p_tool text, p_agent text, p_workflow text,
    p_keys text[], p_args_hash text)
RETURNS TABLE (outcome text, previous_status text, attempts integer, result json)
LANGUAGE plpgsql AS $$
DECLARE
    v toolguard_intent%ROWTYPE;
BEGIN
    INSERT INTO toolguard_intent (idempotency_key, tool, agent, workflow, keys, args_hash)
    VALUES (p_idempotency_key, p_tool, p_agent, p_workflow, coalesce(p_keys, '{}'), p_args_hash)
    ON CONFLICT (idempotency_key) DO NOTHING;
    IF FOUND THEN
        RETURN QUERY SELECT 'begun'::text, NULL::text, 1, NULL::json;
        RETURN;
    END IF;
    SELECT * INTO v FROM toolguard_intent i WHERE i.idempotency_key = p_idempotency_key FOR UPDATE;
    IF v.tool IS DISTINCT FROM p_tool OR v.args_hash IS DISTINCT FROM p_args_hash THEN
        RAISE EXCEPTION USING ERRCODE = 'TG004',
            MESSAGE = format('idempotency key %s was already used for %s with other arguments',
                             p_idempotency_key, v.tool),
            DETAIL = json_build_object('idempotency_key', p_idempotency_key)::text;
    END IF;
    IF v.status = 'applied' THEN
        RETURN QUERY SELECT 'replay'::text, v.status, v.attempts, v.result;
        RETURN;
    END IF;
    UPDATE toolguard_intent i SET status = 'pending', attempts = i.attempts + 1, updated_at = now()
    WHERE i.idempotency_key = p_idempotency_key;
    RETURN QUERY SELECT 'begun'::text, v.status, v.attempts + 1, NULL::json;
END;
$$;

-- First statement of a fenced transaction (as in version 2, returning result json).
DROP FUNCTION IF EXISTS toolguard_enter(text[], bigint[], text, text, text, text, text, text[]);
CREATE FUNCTION toolguard_enter(
    p_keys text[], p_tokens bigint[],
    p_idempotency_key text, p_tool text, p_agent text, p_workflow text, p_args_hash text,
    p_intent_keys text[] DEFAULT NULL)
RETURNS TABLE (applied boolean, result json)
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
        RETURN QUERY SELECT false, NULL::json;
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

INSERT INTO toolguard_schema_version (version, name) VALUES (3, '003_stale_blockers_exact_results')
ON CONFLICT (version) DO NOTHING;
