-- toolguard guarded store, PostgreSQL schema version 1.
--
-- Usable from any language. Install into the current schema (search_path) with
--   psql -v ON_ERROR_STOP=1 --single-transaction -f 001_initial.sql
-- Running it twice changes nothing. The Python installer (`toolguard db init`)
-- applies each numbered file above the installed version in one transaction.
--
-- Errors raised here use the custom SQLSTATE class 'TG':
--   TG001  stale fencing token: the store has seen a greater token for the key
--          (DETAIL is JSON: {"key": ..., "token": ..., "current": ...})
--   TG002  invalid fencing token or key (NULL, not positive, empty key, arrays of
--          different lengths)
--   TG003  record not found: a fenced mutation named a row that does not exist
--   TG004  idempotency conflict: the key was used for another tool or other args
--          (DETAIL is JSON: {"idempotency_key": ...})
--   TG005  the audit log is append-only

-- Two installers must not interleave: the Python installer takes the same lock
-- first (a transaction-level advisory lock is re-entrant within a session).
SELECT pg_advisory_xact_lock(hashtext('toolguard.install'));

CREATE TABLE IF NOT EXISTS toolguard_schema_version (
    version      integer PRIMARY KEY,
    name         text NOT NULL,
    installed_at timestamptz NOT NULL DEFAULT now()
);

-- The data tier's memory of fencing tokens: the greatest token accepted per lock
-- key. It only moves forward, and it is what a lock server that lost its data
-- is re-seeded from.
CREATE TABLE IF NOT EXISTS toolguard_high_water (
    key        text PRIMARY KEY CHECK (key <> ''),
    token      bigint NOT NULL CHECK (token > 0),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- One row per idempotency key: what was asked, and once applied, what it gave.
-- 'applied' is written in the same transaction as the tool's mutation, so any
-- other status means the mutation certainly did not happen.
CREATE TABLE IF NOT EXISTS toolguard_intent (
    idempotency_key text PRIMARY KEY CHECK (idempotency_key <> ''),
    tool            text NOT NULL,
    agent           text,
    workflow        text,
    keys            text[] NOT NULL DEFAULT '{}',
    args_hash       text NOT NULL,
    status          text NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'applied', 'failed', 'unknown')),
    tokens          jsonb,
    result          jsonb,
    attempts        integer NOT NULL DEFAULT 1 CHECK (attempts >= 0),
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    applied_at      timestamptz
);
-- "has tool T been applied on resource R?" (ordering rules)
CREATE INDEX IF NOT EXISTS toolguard_intent_applied_keys
    ON toolguard_intent USING gin (keys) WHERE status = 'applied';

-- Every decision, accepted or not. Append-only (trigger below). `id` is
-- insertion order, which is commit order only among writes on the same lock key.
CREATE TABLE IF NOT EXISTS toolguard_audit (
    id              bigserial PRIMARY KEY,
    at              timestamptz NOT NULL DEFAULT clock_timestamp(),
    agent           text,
    tool            text,
    intent_id       text,
    idempotency_key text,
    workflow        text,
    decision        text NOT NULL CHECK (decision <> ''),
    reason          text NOT NULL CHECK (reason <> ''),
    keys            text[] NOT NULL DEFAULT '{}',
    tokens          jsonb NOT NULL DEFAULT '{}',
    args            jsonb,
    detail          text,
    duration_ms     double precision,
    node_attempt    integer
);
CREATE INDEX IF NOT EXISTS toolguard_audit_at ON toolguard_audit (at);
CREATE INDEX IF NOT EXISTS toolguard_audit_tool_at ON toolguard_audit (tool, at);
CREATE INDEX IF NOT EXISTS toolguard_audit_idempotency_key ON toolguard_audit (idempotency_key);
CREATE INDEX IF NOT EXISTS toolguard_audit_intent_id ON toolguard_audit (intent_id);
CREATE INDEX IF NOT EXISTS toolguard_audit_keys ON toolguard_audit USING gin (keys);

-- The audit log is append-only in the database itself, whoever connects.
-- (A superuser can still disable triggers or drop the table: also REVOKE
-- UPDATE, DELETE, TRUNCATE from the application role.)
CREATE OR REPLACE FUNCTION toolguard_audit_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = 'TG005',
        MESSAGE = format('toolguard_audit is append-only: %s is not allowed', TG_OP),
        HINT = 'audit rows can only be inserted';
END;
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgname = 'toolguard_audit_append_only'
                     AND tgrelid = 'toolguard_audit'::regclass) THEN
        CREATE TRIGGER toolguard_audit_append_only
            BEFORE UPDATE OR DELETE OR TRUNCATE ON toolguard_audit
            FOR EACH STATEMENT EXECUTE FUNCTION toolguard_audit_append_only();
    END IF;
END;
$$;

-- Check and advance the fence of one key in one statement, under the row lock.
-- A token lower than the stored one is rejected (TG001); an equal one is
-- accepted (several writes under one lease). Returns the token.
CREATE OR REPLACE FUNCTION toolguard_fence(p_key text, p_token bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_current bigint;
BEGIN
    IF p_key IS NULL OR p_key = '' THEN
        RAISE EXCEPTION USING ERRCODE = 'TG002',
            MESSAGE = 'fencing key must be a non-empty string';
    END IF;
    IF p_token IS NULL OR p_token <= 0 THEN
        RAISE EXCEPTION USING ERRCODE = 'TG002',
            MESSAGE = format('fencing token for key %s must be a positive integer, got %s',
                             p_key, coalesce(p_token::text, 'NULL'));
    END IF;
    INSERT INTO toolguard_high_water AS hw (key, token) VALUES (p_key, p_token)
    ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token, updated_at = now()
        WHERE hw.token <= EXCLUDED.token
    RETURNING hw.token INTO v_current;
    IF NOT FOUND THEN
        -- ON CONFLICT locked the row even though it did not update it.
        SELECT token INTO v_current FROM toolguard_high_water WHERE key = p_key;
        RAISE EXCEPTION USING ERRCODE = 'TG001',
            MESSAGE = format('stale fencing token %s for key %s: the store has already seen %s',
                             p_token, p_key, v_current),
            DETAIL = json_build_object('key', p_key, 'token', p_token, 'current', v_current)::text,
            HINT = 'the lock was lost and taken by a newer holder; do not retry with this token';
    END IF;
    RETURN p_token;
END;
$$;

-- Fence several keys in one call, in one canonical (byte) order, so two
-- transactions fencing overlapping key sets cannot deadlock.
CREATE OR REPLACE FUNCTION toolguard_fence_all(p_keys text[], p_tokens bigint[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    IF p_keys IS NULL OR p_tokens IS NULL
       OR coalesce(cardinality(p_keys), 0) <> coalesce(cardinality(p_tokens), 0) THEN
        RAISE EXCEPTION USING ERRCODE = 'TG002',
            MESSAGE = 'toolguard_fence_all needs one token per key';
    END IF;
    FOR r IN SELECT k, t FROM unnest(p_keys, p_tokens) AS u(k, t) ORDER BY k COLLATE "C" LOOP
        PERFORM toolguard_fence(r.k, r.t);
    END LOOP;
END;
$$;

-- Reserve an idempotency key before running an intent (one statement, autocommit).
--   outcome 'begun':  run it (attempts counts tries; previous_status is NULL for a
--                     new key, else the status of the attempt being reconciled)
--   outcome 'replay': already applied; result is what it recorded
-- The same key for another tool or other arguments raises TG004.
CREATE OR REPLACE FUNCTION toolguard_begin_intent(
    p_idempotency_key text, p_tool text, p_agent text, p_workflow text,
    p_keys text[], p_args_hash text)
RETURNS TABLE (outcome text, previous_status text, attempts integer, result jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v toolguard_intent%ROWTYPE;
BEGIN
    INSERT INTO toolguard_intent (idempotency_key, tool, agent, workflow, keys, args_hash)
    VALUES (p_idempotency_key, p_tool, p_agent, p_workflow, coalesce(p_keys, '{}'), p_args_hash)
    ON CONFLICT (idempotency_key) DO NOTHING;
    IF FOUND THEN
        RETURN QUERY SELECT 'begun'::text, NULL::text, 1, NULL::jsonb;
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
    RETURN QUERY SELECT 'begun'::text, v.status, v.attempts + 1, NULL::jsonb;
END;
$$;

-- First statement of a fenced transaction: fence every key (sorted), then lock
-- the intent row (creating it if the caller skipped toolguard_begin_intent, with
-- p_intent_keys as its resource keys, default the fenced keys) and report
-- whether it is already applied, in which case the caller must roll back and
-- return `result` instead of running the mutation again.
CREATE OR REPLACE FUNCTION toolguard_enter(
    p_keys text[], p_tokens bigint[],
    p_idempotency_key text, p_tool text, p_agent text, p_workflow text, p_args_hash text,
    p_intent_keys text[] DEFAULT NULL)
RETURNS TABLE (applied boolean, result jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v toolguard_intent%ROWTYPE;
BEGIN
    PERFORM toolguard_fence_all(p_keys, p_tokens);
    IF p_idempotency_key IS NULL THEN
        RETURN QUERY SELECT false, NULL::jsonb;
        RETURN;
    END IF;
    INSERT INTO toolguard_intent AS i (idempotency_key, tool, agent, workflow, keys, args_hash)
    VALUES (p_idempotency_key, p_tool, p_agent, p_workflow,
            coalesce(nullif(p_intent_keys, '{}'), p_keys, '{}'), p_args_hash)
    ON CONFLICT (idempotency_key) DO UPDATE SET updated_at = now()
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

-- Last statement before COMMIT: record the intent's result and the tokens it
-- was applied under. The intent row is locked by toolguard_enter.
CREATE OR REPLACE FUNCTION toolguard_apply(p_idempotency_key text, p_result jsonb, p_tokens jsonb)
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

INSERT INTO toolguard_schema_version (version, name) VALUES (1, '001_initial')
ON CONFLICT (version) DO NOTHING;
