-- The PostgreSQL lock schema as toolguard installed it before lock schema 3 (mark
-- 'toolguard lock schema 2'), kept verbatim for the upgrade tests.
CREATE TABLE IF NOT EXISTS toolguard_lock_fence (
    key   text PRIMARY KEY,
    token bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS toolguard_lock_holder (
    key        text PRIMARY KEY,
    owner      text NOT NULL,
    token      bigint NOT NULL,
    expires_at timestamptz NOT NULL
);
-- ttl_ms: how long a hand-off to this waiter lasts until its first renewal.
CREATE TABLE IF NOT EXISTS toolguard_lock_waiter (
    key           text NOT NULL,
    owner         text NOT NULL,
    arrival       bigint GENERATED ALWAYS AS IDENTITY,
    ttl_ms        integer NOT NULL,
    channel       text NOT NULL,
    present_until timestamptz NOT NULL,
    PRIMARY KEY (key, owner)
);
CREATE INDEX IF NOT EXISTS toolguard_lock_waiter_line ON toolguard_lock_waiter (key, arrival);

-- Mint p_key's next token and make p_owner its holder for p_ttl_ms (the caller holds
-- the fence row lock). Returns the token.
CREATE OR REPLACE FUNCTION toolguard_lock_grant(p_key text, p_owner text, p_ttl_ms integer)
RETURNS bigint LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_token bigint;
BEGIN
    UPDATE toolguard_lock_fence
       SET token = greatest(token + 1, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)
     WHERE key = p_key
    RETURNING token INTO v_token;
    INSERT INTO toolguard_lock_holder (key, owner, token, expires_at)
    VALUES (p_key, p_owner, v_token, clock_timestamp() + p_ttl_ms * interval '1 millisecond')
    ON CONFLICT (key) DO UPDATE
       SET owner = excluded.owner, token = excluded.token, expires_at = excluded.expires_at;
    DELETE FROM toolguard_lock_waiter WHERE key = p_key AND owner = p_owner;
    RETURN v_token;
END $$;

-- Give the free p_key to its first live waiter, if any, for that waiter's hand-off TTL,
-- and NOTIFY that waiter's process with 'owner token key' (the caller holds the fence
-- row lock).
CREATE OR REPLACE FUNCTION toolguard_lock_pass(p_key text)
RETURNS void LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_next toolguard_lock_waiter%ROWTYPE;
BEGIN
    DELETE FROM toolguard_lock_waiter WHERE key = p_key AND present_until < clock_timestamp();
    SELECT * INTO v_next FROM toolguard_lock_waiter WHERE key = p_key ORDER BY arrival LIMIT 1;
    IF FOUND THEN
        PERFORM pg_notify(v_next.channel, v_next.owner || ' '
                          || toolguard_lock_grant(p_key, v_next.owner, v_next.ttl_ms)
                          || ' ' || p_key);
    END IF;
END $$;

-- Grant p_key to p_owner for p_ttl_ms if it is free and p_owner is first in line; if
-- p_owner holds it already (a hand-off that raced with the end of a wait, a retry after
-- a lost reply), extend it to p_ttl_ms from now. Else queue p_owner (or refresh its
-- presence), to be handed the lock for p_handoff_ms. A free key whose first waiter is
-- someone else is handed to that waiter on the way.
-- Returns (token, 0, token) on a grant, (NULL, ms left on the holder's lease, the key's
-- last token) when queued: a hand-off to p_owner with a token at or below that one is
-- over already.
CREATE OR REPLACE FUNCTION toolguard_lock_acquire(
    p_key text, p_owner text, p_ttl_ms integer, p_handoff_ms integer, p_presence_ms integer,
    p_channel text, OUT token bigint, OUT retry_ms integer, OUT last_token bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_holder toolguard_lock_holder%ROWTYPE;
    v_first text;
BEGIN
    INSERT INTO toolguard_lock_fence (key, token) VALUES (p_key, 0)
    ON CONFLICT (key) DO NOTHING;
    PERFORM 1 FROM toolguard_lock_fence WHERE key = p_key FOR UPDATE;
    DELETE FROM toolguard_lock_holder WHERE key = p_key AND expires_at <= clock_timestamp();
    SELECT * INTO v_holder FROM toolguard_lock_holder WHERE key = p_key;
    IF NOT FOUND THEN
        DELETE FROM toolguard_lock_waiter
         WHERE key = p_key AND present_until < clock_timestamp();
        SELECT owner INTO v_first FROM toolguard_lock_waiter WHERE key = p_key
         ORDER BY arrival LIMIT 1;
        IF v_first IS NULL OR v_first = p_owner THEN
            token := toolguard_lock_grant(p_key, p_owner, p_ttl_ms);
            retry_ms := 0;
            last_token := token;
            RETURN;
        END IF;
        PERFORM toolguard_lock_pass(p_key);
        SELECT * INTO v_holder FROM toolguard_lock_holder WHERE key = p_key;
    ELSIF v_holder.owner = p_owner THEN
        UPDATE toolguard_lock_holder
           SET expires_at = clock_timestamp() + p_ttl_ms * interval '1 millisecond'
         WHERE key = p_key;
        token := v_holder.token;
        retry_ms := 0;
        last_token := token;
        RETURN;
    END IF;
    INSERT INTO toolguard_lock_waiter (key, owner, ttl_ms, channel, present_until)
    VALUES (p_key, p_owner, p_handoff_ms, p_channel,
            clock_timestamp() + p_presence_ms * interval '1 millisecond')
    ON CONFLICT (key, owner) DO UPDATE
       SET present_until = excluded.present_until, channel = excluded.channel,
           ttl_ms = excluded.ttl_ms;
    token := NULL;
    retry_ms := greatest(1, ceil(extract(epoch FROM v_holder.expires_at - clock_timestamp()) * 1000));
    SELECT f.token INTO last_token FROM toolguard_lock_fence f WHERE f.key = p_key;
END $$;

-- Release p_key if p_owner holds it (then pass it to the first live waiter), and
-- leave its line either way. Returns true if p_owner held an unexpired lease.
CREATE OR REPLACE FUNCTION toolguard_lock_release(p_key text, p_owner text)
RETURNS boolean LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_expires timestamptz;
BEGIN
    PERFORM 1 FROM toolguard_lock_fence WHERE key = p_key FOR UPDATE;
    DELETE FROM toolguard_lock_waiter WHERE key = p_key AND owner = p_owner;
    DELETE FROM toolguard_lock_holder WHERE key = p_key AND owner = p_owner
    RETURNING expires_at INTO v_expires;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM toolguard_lock_pass(p_key);
    RETURN v_expires > clock_timestamp();
END $$;

COMMENT ON FUNCTION toolguard_lock_acquire(text,text,integer,integer,integer,text) IS 'toolguard lock schema 2';
