-- The seed article's fenced account mutation, done right. Self-contained: it
-- keeps its own token per row (lock key "account:<uuid>") and uses toolguard's
-- SQLSTATEs, so any language can call it and map the errors:
--   TG001  stale fencing token (DETAIL is JSON {"key", "token", "current"})
--   TG002  NULL or non-positive token, NULL account or delta
--   TG003  the account does not exist
-- Differences from the article: an equal token is accepted (a second write
-- under the same lease), only a lower one is rejected; a missing account is an
-- error instead of a silent no-op; the function returns the new balance.
--
--   psql -v ON_ERROR_STOP=1 --single-transaction -f customer_account.sql

CREATE TABLE IF NOT EXISTS customer_account (
    account_id         uuid PRIMARY KEY,
    balance            numeric(12, 2) NOT NULL,
    last_fencing_token bigint NOT NULL DEFAULT 0 CHECK (last_fencing_token >= 0)
);

CREATE OR REPLACE FUNCTION mutate_account_balance(
    p_account_id uuid,
    p_amount_delta numeric,
    p_fencing_token bigint
) RETURNS numeric
LANGUAGE plpgsql AS $$
DECLARE
    v_current bigint;
    v_balance numeric;
BEGIN
    IF p_fencing_token IS NULL OR p_fencing_token <= 0 THEN
        RAISE EXCEPTION USING ERRCODE = 'TG002',
            MESSAGE = format('fencing token must be a positive integer, got %s',
                             coalesce(p_fencing_token::text, 'NULL'));
    END IF;
    IF p_account_id IS NULL OR p_amount_delta IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'TG002',
            MESSAGE = 'account id and amount delta are required';
    END IF;

    -- Row lock first: the check, the mutation and the token advance are one step.
    SELECT last_fencing_token INTO v_current
    FROM customer_account WHERE account_id = p_account_id
    FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'TG003',
            MESSAGE = format('customer_account %s does not exist', p_account_id);
    END IF;

    -- Strictly lower is stale; equal is the same lease writing again.
    IF p_fencing_token < v_current THEN
        RAISE EXCEPTION USING ERRCODE = 'TG001',
            MESSAGE = format('stale fencing token %s for account %s: the account has already seen %s',
                             p_fencing_token, p_account_id, v_current),
            DETAIL = json_build_object('key', 'account:' || p_account_id,
                                       'token', p_fencing_token, 'current', v_current)::text;
    END IF;

    UPDATE customer_account
    SET balance = balance + p_amount_delta,
        last_fencing_token = p_fencing_token
    WHERE account_id = p_account_id
    RETURNING balance INTO v_balance;
    RETURN v_balance;
END;
$$;
