-- toolguard guarded store, PostgreSQL schema version 8: less server work per fenced write.
--
-- Apply on top of the earlier files (same rules: idempotent, one transaction):
--   psql -v ON_ERROR_STOP=1 --single-transaction -f 008_hot_path.sql
--
-- Same guarantees, same signatures and results; two changes to what the server
-- does for every call:
--
-- 1. Recording the result is a HOT update. The ordering rules' index
--    (`after:`: "has tool T been applied on resource R?") covered applied intents
--    only (`WHERE status = 'applied'`), so the record's change of `status` was a
--    change of an indexed column: every record wrote a new entry in the primary
--    key's index and one in the GIN index, and left a dead one behind. The index
--    now covers every intent (`toolguard_intent_keys`, the query still asks for
--    `status = 'applied'`), and the table keeps 10 % of each page free
--    (`fillfactor = 90`), so the record's new row version fits beside the one the
--    same transaction inserted: no index is touched. The GIN entry is written at
--    the insert instead (into GIN's pending list). Building the index reads the
--    whole intent table under a lock that blocks writes to it: on a large table,
--    run this file when a short pause of fenced writes is acceptable.
--
-- 2. toolguard_enter fences one key itself. The usual call fences one key whose
--    high-water row exists and is free: toolguard_enter now publishes the token,
--    takes the row (SKIP LOCKED) and advances it itself, without calling
--    toolguard_fence, a second PL/pgSQL function. Everything else (a new key, a
--    row held by another transaction: the waiting and the stale-blocker path of
--    version 3; a stale token; several keys; invalid input) still goes through
--    toolguard_fence / toolguard_fence_all, which raise exactly as before.

SELECT pg_advisory_xact_lock(hashtext('toolguard.install'));

CREATE INDEX IF NOT EXISTS toolguard_intent_keys ON toolguard_intent USING gin (keys);
DROP INDEX IF EXISTS toolguard_intent_applied_keys;
ALTER TABLE toolguard_intent SET (fillfactor = 90);

CREATE OR REPLACE FUNCTION toolguard_enter(
    p_keys text[], p_tokens bigint[],
    p_idempotency_key text, p_tool text, p_agent text, p_workflow text, p_args_hash text,
    p_intent_keys text[] DEFAULT NULL)
RETURNS TABLE (applied boolean, result json)
LANGUAGE plpgsql AS $$
DECLARE
    v_current bigint;
    v_status text;
    v_result json;
    v_tool text;
    v_args_hash text;
BEGIN
    IF cardinality(p_keys) = 1 AND cardinality(p_tokens) = 1 AND p_keys[1] <> ''
       AND p_tokens[1] > 0 THEN
        -- As toolguard_fence: the token is published before the row is taken.
        PERFORM pg_advisory_xact_lock_shared(toolguard_token_lock(p_tokens[1]));
        SELECT token INTO v_current FROM toolguard_high_water WHERE key = p_keys[1]
        FOR UPDATE SKIP LOCKED;
        IF NOT FOUND OR v_current > p_tokens[1] THEN
            -- A new key, a row another transaction holds (wait, end a stale blocker), or
            -- a stale token (TG001, with the stored token): toolguard_fence's own path.
            PERFORM toolguard_fence(p_keys[1], p_tokens[1]);
        ELSIF v_current < p_tokens[1] THEN
            UPDATE toolguard_high_water SET token = p_tokens[1], updated_at = now()
            WHERE key = p_keys[1];
        END IF;
    ELSIF coalesce(cardinality(p_keys), 0) = 0 THEN
        RAISE EXCEPTION USING ERRCODE = 'TG002',
            MESSAGE = 'a fenced transaction needs at least one key and its token';
    ELSIF cardinality(p_keys) = 1 AND cardinality(p_tokens) = 1 THEN
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
    WHERE i.status <> 'applied'
    RETURNING i.status, i.result, i.tool, i.args_hash
    INTO v_status, v_result, v_tool, v_args_hash;
    IF NOT FOUND THEN  -- applied already: locked by the upsert above, not written
        SELECT i.status, i.result, i.tool, i.args_hash
        INTO v_status, v_result, v_tool, v_args_hash
        FROM toolguard_intent i WHERE i.idempotency_key = p_idempotency_key;
    END IF;
    IF v_tool IS DISTINCT FROM p_tool OR v_args_hash IS DISTINCT FROM p_args_hash THEN
        RAISE EXCEPTION USING ERRCODE = 'TG004',
            MESSAGE = format('idempotency key %s was already used for %s with other arguments',
                             p_idempotency_key, v_tool),
            DETAIL = json_build_object('idempotency_key', p_idempotency_key)::text;
    END IF;
    applied := v_status = 'applied';
    result := v_result;
    RETURN NEXT;
END;
$$;

INSERT INTO toolguard_schema_version (version, name) VALUES (8, '008_hot_path')
ON CONFLICT (version) DO NOTHING;
