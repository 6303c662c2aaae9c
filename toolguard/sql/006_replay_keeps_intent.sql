-- toolguard guarded store, PostgreSQL schema version 6: a replay leaves its intent row alone.
--
-- Apply on top of the earlier files (same rules: idempotent, one transaction):
--   psql -v ON_ERROR_STOP=1 --single-transaction -f 006_replay_keeps_intent.sql
--
-- A fenced transaction that finds its intent applied already (a replay) is now
-- committed instead of rolled back: toolguard_enter checked and advanced the
-- fences before it found the replay, so the store has seen those tokens and must
-- refuse every lower one afterwards, exactly as if the write had run. Only the
-- fence advance may survive that commit: toolguard_enter no longer writes the
-- applied intent row on its way (version 3 bumped its updated_at through the
-- upsert, harmless while the replay was rolled back). The row is still locked
-- (ON CONFLICT DO UPDATE locks a row it does not update), then read as it is.
--
-- Same signature and result as in version 3: older clients keep working (a
-- client that still rolls a replay back simply loses the fence advance, as before).

SELECT pg_advisory_xact_lock(hashtext('toolguard.install'));

CREATE OR REPLACE FUNCTION toolguard_enter(
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
    WHERE i.status <> 'applied'
    RETURNING i.* INTO v;
    IF NOT FOUND THEN  -- applied already: locked by the upsert above, not written
        SELECT * INTO v FROM toolguard_intent i WHERE i.idempotency_key = p_idempotency_key;
    END IF;
    IF v.tool IS DISTINCT FROM p_tool OR v.args_hash IS DISTINCT FROM p_args_hash THEN
        RAISE EXCEPTION USING ERRCODE = 'TG004',
            MESSAGE = format('idempotency key %s was already used for %s with other arguments',
                             p_idempotency_key, v.tool),
            DETAIL = json_build_object('idempotency_key', p_idempotency_key)::text;
    END IF;
    RETURN QUERY SELECT v.status = 'applied', v.result;
END;
$$;

INSERT INTO toolguard_schema_version (version, name) VALUES (6, '006_replay_keeps_intent')
ON CONFLICT (version) DO NOTHING;
