-- toolguard guarded store, PostgreSQL schema version 3: stale blockers are ended, results are exact.
--
-- Apply on top of 002_fast_path.sql (same rules: idempotent, one transaction):
--   psql -v ON_ERROR_STOP=1 --single-transaction -f 003_stale_blockers_exact_results.sql
--
-- 1. A holder paused inside its fenced transaction no longer blocks everyone.
--
--    A fenced transaction holds the row lock of each key's high-water row until
--    it ends. A holder whose process is stopped (SIGSTOP, a VM pause, a debugger)
--    keeps that lock for the whole pause, and the next holder, with a newer and
--    valid token, used to wait for it. Now toolguard_fence
--      * publishes each token it fences with while its transaction is open: a
--        transaction-scoped *shared* advisory lock on toolguard_token_lock(token)
--        (visible in pg_locks with the holder's pid; shared locks never conflict
--        with each other);
--      * takes the row lock without waiting when it is free (the common case: no
--        subtransaction, no extra round trip);
--      * otherwise waits for it in steps (lock_timeout 100 ms, doubling up to twice
--        deadlock_timeout, 2 s by default, inside an EXCEPTION block: a long wait
--        still gets PostgreSQL's deadlock check). After each step it looks at the blocker (the
--        row's xmax -> the pg_locks transactionid lock -> its pid): if every token
--        that blocker published is below this transaction's token for the key,
--        the lock server has granted the key again since the blocker's grant, so
--        the blocker's lease is gone, and it is ended with pg_terminate_backend.
--        Otherwise (a newer or equal token, nothing published, a blocker that
--        cannot be identified) it keeps waiting;
--      * creates a key's first row the same way, announced by two more shared
--        advisory locks (toolguard_key_lock: 2 x 53 bits of the key's MD5), since
--        a row nobody else can see yet has no xmax to follow: a second creator
--        whose insert waits ends the announced creators whose tokens are all
--        below its own.
--    The bound is tied to the lease's loss, not to a duration: nobody else can
--    hold a newer token for a key while the holder's lease on it is valid, so a
--    live holder (a long tool body whose lease the heartbeat keeps renewing) is
--    never cut. The ended holder finds its connection gone when it wakes; its
--    transaction was rolled back, and the client reports and audits the attempt.
--
--    Permissions: pg_terminate_backend needs the blocker's role (the same role
--    for every toolguard client) or membership in pg_signal_backend, and only a
--    superuser may end a superuser's session. Without the permission the waiter
--    keeps waiting (fail safe) and says so in the server log.
--
--    Limits, plainly: a multi-key blocker is ended only if every token it
--    published is below the waiter's (tokens of other keys are compared too, which
--    may keep a waiter waiting, never the other way round). The row's xmax is
--    trusted to name a plain transaction: do not lock high-water rows yourself
--    (FOR SHARE, foreign keys to the table), which could make it a MultiXact.
--    Only toolguard_fence publishes tokens: a transaction that locked a row some
--    other way is waited for, never ended. pg_terminate_backend names a pid: a
--    stale blocker that commits in the microseconds between the check and the
--    signal loses its connection after its own commit (the next statement on it
--    fails; nothing wrong is written). Advisory lock keys from 679 * 2^53 to
--    682 * 2^53 - 1 are toolguard's: do not use them for your own advisory locks.
--    The session's own lock_timeout, if set, still bounds the whole wait
--    (SQLSTATE 55P03).
--
-- 2. Results are stored exactly as recorded.
--
--    toolguard_intent.result becomes `json` (the text as given) instead of
--    `jsonb`: jsonb refused strings with NUL (\u0000), reordered object keys and
--    turned 1e16 into 10000000000000000. The new toolguard_record(key, result
--    json, tokens jsonb) records it; toolguard_apply(key, result jsonb, tokens
--    jsonb) stays for older clients (their results go through jsonb as before).
--    toolguard_enter and toolguard_begin_intent now return `result json`: the
--    same values to any JSON parser.
--
-- Old clients keep working: toolguard_enter, toolguard_fence, toolguard_fence_all
-- and toolguard_apply keep their signatures. A client of this version needs this
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

-- --- stale blockers ------------------------------------------------------------------------------

-- The advisory lock key that publishes a fencing token: toolguard's tag 679 in the
-- top bits, the token (saturated at 2^53 - 1) below. A saturated token is never
-- taken as proof of anything.
CREATE OR REPLACE FUNCTION toolguard_token_lock(p_token bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (679::bigint << 53) | least(greatest(p_token, 0), 9007199254740991)
$$;

-- The advisory lock keys that announce "this transaction creates p_key's high-water
-- row" (a row nobody else can see before it commits): tags 680 and 681, each over 53
-- bits of the key's MD5. A creator holds both, shared, until its transaction ends.
CREATE OR REPLACE FUNCTION toolguard_key_lock(p_key text, p_part integer) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT ((679 + p_part)::bigint << 53)
           | (('x' || substr(md5(p_key), 16 * p_part - 15, 16))::bit(64)::bigint
              & 9007199254740991)
$$;

-- End every other transaction that announced it creates p_key's row, if every token it
-- published is below p_token. Used when this transaction's own insert of the row waited:
-- the row is not visible yet, so its creator cannot be found through the row itself.
-- Both announcements must match (a wrong match needs a 106-bit MD5 collision between two
-- keys created at the same moment), and a creator that is itself waiting for a lock is
-- another waiter, not the blocker: left alone. Returns how many were signalled.
CREATE OR REPLACE FUNCTION toolguard_end_stale_creators(p_key text, p_token bigint)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    r record;
    v_ended integer := 0;
BEGIN
    FOR r IN
        WITH all_locks AS MATERIALIZED (
            SELECT pid, locktype, database, classid, objid, objsubid, mode, granted
            FROM pg_locks WHERE pid IS NOT NULL AND pid <> pg_backend_pid()
        ), l AS (
            SELECT pid, ((classid::bigint << 32) | objid::bigint) AS k
            FROM all_locks
            WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND mode = 'ShareLock'
              AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
        )
        SELECT c.pid,
               (SELECT array_agg(t.k & 9007199254740991) FROM l t
                WHERE t.pid = c.pid AND t.k >> 53 = 679) AS tokens
        FROM l c
        WHERE c.k = toolguard_key_lock(p_key, 1)
          AND EXISTS (SELECT 1 FROM l d WHERE d.pid = c.pid AND d.k = toolguard_key_lock(p_key, 2))
          AND NOT EXISTS (SELECT 1 FROM all_locks w WHERE w.pid = c.pid AND NOT w.granted)
    LOOP
        IF toolguard_end_if_stale(r.pid, r.tokens, p_key, p_token) THEN
            v_ended := v_ended + 1;
        END IF;
    END LOOP;
    RETURN v_ended;
END;
$$;

-- The tokens that the transaction holding p_key's high-water row published, and its
-- pid, read from one snapshot of pg_locks. No row: the row is not locked, or its
-- locker cannot be identified (gone already, a prepared transaction, a MultiXact).
CREATE OR REPLACE FUNCTION toolguard_fence_blocker(p_key text)
RETURNS TABLE (pid integer, tokens bigint[])
LANGUAGE sql STABLE AS $$
    WITH row_lock AS (
        SELECT xmax FROM toolguard_high_water WHERE key = p_key AND xmax <> '0'::xid
    ), l AS MATERIALIZED (
        SELECT locktype, database, transactionid, classid, objid, objsubid, pid, mode, granted
        FROM pg_locks
    )
    SELECT t.pid,
           array_agg(((a.classid::bigint << 32) | a.objid::bigint) & 9007199254740991)
               FILTER (WHERE a.pid IS NOT NULL)
    FROM row_lock r
    JOIN l t ON t.locktype = 'transactionid' AND t.transactionid = r.xmax AND t.granted
                AND t.mode = 'ExclusiveLock' AND t.pid IS NOT NULL
    LEFT JOIN l a ON a.pid = t.pid AND a.locktype = 'advisory' AND a.objsubid = 1
                AND a.granted AND a.mode = 'ShareLock'
                AND a.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                AND ((a.classid::bigint << 32) | a.objid::bigint) >> 53 = 679
    GROUP BY t.pid
$$;

-- End the transaction of p_pid, which blocks this one on p_key, if its lease on the key
-- is gone: it published tokens (p_tokens), and every one of them is below p_token (this
-- transaction's token for p_key). True if it was signalled.
CREATE OR REPLACE FUNCTION toolguard_end_if_stale(p_pid integer, p_tokens bigint[], p_key text,
                                                  p_token bigint)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_newest bigint;
BEGIN
    IF p_pid IS NULL OR p_pid = pg_backend_pid() OR coalesce(cardinality(p_tokens), 0) = 0 THEN
        RETURN false;  -- unknown, or nothing published (not a toolguard fence): keep waiting
    END IF;
    SELECT max(t) INTO v_newest FROM unnest(p_tokens) t;
    IF v_newest >= p_token OR v_newest >= 9007199254740991 THEN
        RETURN false;  -- it may still hold a valid lease: keep waiting
    END IF;
    BEGIN
        IF pg_terminate_backend(p_pid) THEN
            RAISE LOG 'toolguard: ended the transaction of pid % on fence key % (its tokens %, '
                      'below %): its lease is gone', p_pid, p_key, p_tokens, p_token;
            RETURN true;
        END IF;
    EXCEPTION WHEN insufficient_privilege THEN
        RAISE LOG 'toolguard: not permitted to end pid % blocking fence key % (grant '
                  'pg_signal_backend, or use one role for every client): waiting', p_pid, p_key;
    END;
    RETURN false;
END;
$$;

-- End the transaction that holds p_key's high-water row if its lease on the key is gone.
CREATE OR REPLACE FUNCTION toolguard_end_stale_blocker(p_key text, p_token bigint)
RETURNS boolean
LANGUAGE sql AS $$
    SELECT coalesce((SELECT toolguard_end_if_stale(b.pid, b.tokens, p_key, p_token)
                     FROM toolguard_fence_blocker(p_key) b), false)
$$;

-- Check and advance the fence of one key, under the row lock. A token lower than
-- the stored one is rejected (TG001); an equal one is accepted (several writes
-- under one lease). Returns the token. A blocker whose lease is gone is ended
-- (see above); the session's lock_timeout, if any, bounds the whole wait.
CREATE OR REPLACE FUNCTION toolguard_fence(p_key text, p_token bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_current bigint;
    v_step_ms integer := 100;
    v_cap_ms integer;
    v_saved text;
    v_limit interval;
    v_deadline timestamptz;
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
    -- Publish the token for as long as this transaction lasts (before taking the row).
    PERFORM pg_advisory_xact_lock_shared(toolguard_token_lock(p_token));
    LOOP
        -- Taken at the top level, so that the row's xmax names this transaction.
        SELECT token INTO v_current FROM toolguard_high_water WHERE key = p_key
        FOR UPDATE SKIP LOCKED;
        EXIT WHEN FOUND;
        IF v_limit IS NULL THEN
            v_saved := current_setting('lock_timeout');
            v_limit := v_saved::interval;
            -- Steps grow past deadlock_timeout, so that a wait that lasts still runs
            -- PostgreSQL's deadlock check (it needs one uninterrupted wait that long).
            v_cap_ms := greatest(1000, 2 * (extract(epoch FROM
                            current_setting('deadlock_timeout')::interval) * 1000)::integer);
            IF v_limit > interval '0' THEN
                v_deadline := clock_timestamp() + v_limit;
            END IF;
        END IF;
        IF v_deadline IS NOT NULL AND clock_timestamp() >= v_deadline THEN
            RAISE EXCEPTION USING ERRCODE = 'lock_not_available',
                MESSAGE = format('could not lock the fence of key %s within lock_timeout %s',
                                 p_key, v_limit);
        END IF;
        IF NOT EXISTS (SELECT 1 FROM toolguard_high_water WHERE key = p_key) THEN
            -- A new key: create its row, waiting one step at a time for another creator
            -- of the same key. Only the creator announces itself, once its insert went
            -- through (nobody can see the row before the commit): a transaction still
            -- waiting to create it is another waiter, never a blocker to be ended.
            BEGIN
                PERFORM set_config('lock_timeout', v_step_ms || 'ms', true);
                INSERT INTO toolguard_high_water (key, token) VALUES (p_key, p_token)
                ON CONFLICT (key) DO NOTHING;
                IF FOUND THEN
                    PERFORM set_config('lock_timeout', v_saved, true);  -- as it was
                    PERFORM pg_advisory_xact_lock_shared(toolguard_key_lock(p_key, 1)),
                            pg_advisory_xact_lock_shared(toolguard_key_lock(p_key, 2));
                    RETURN p_token;
                END IF;
                RAISE EXCEPTION USING ERRCODE = 'TG090';  -- created by someone else meanwhile
            EXCEPTION
                WHEN lock_not_available THEN
                    PERFORM toolguard_end_stale_creators(p_key, p_token);
                    v_step_ms := least(v_step_ms * 2, v_cap_ms);
                WHEN SQLSTATE 'TG090' THEN
                    NULL;
            END;
            CONTINUE;
        END IF;
        -- Held by another transaction: wait one step for it, then give the row back
        -- (the subtransaction is rolled back) and take it above, or judge the blocker.
        BEGIN
            PERFORM set_config('lock_timeout', v_step_ms || 'ms', true);
            PERFORM 1 FROM toolguard_high_water WHERE key = p_key FOR UPDATE;
            RAISE EXCEPTION USING ERRCODE = 'TG090';  -- free now: undo this lock, loop
        EXCEPTION
            WHEN lock_not_available THEN
                PERFORM toolguard_end_stale_blocker(p_key, p_token);
                v_step_ms := least(v_step_ms * 2, v_cap_ms);
            WHEN SQLSTATE 'TG090' THEN
                NULL;
        END;
    END LOOP;
    IF v_current > p_token THEN
        RAISE EXCEPTION USING ERRCODE = 'TG001',
            MESSAGE = format('stale fencing token %s for key %s: the store has already seen %s',
                             p_token, p_key, v_current),
            DETAIL = json_build_object('key', p_key, 'token', p_token, 'current', v_current)::text,
            HINT = 'the lock was lost and taken by a newer holder; do not retry with this token';
    END IF;
    IF v_current < p_token THEN
        UPDATE toolguard_high_water SET token = p_token, updated_at = now() WHERE key = p_key;
    END IF;
    RETURN p_token;
END;
$$;

INSERT INTO toolguard_schema_version (version, name) VALUES (3, '003_stale_blockers_exact_results')
ON CONFLICT (version) DO NOTHING;
