-- toolguard guarded store, PostgreSQL schema version 5: a tamper-evident audit log.
--
-- Apply on top of version 3 (same rules: idempotent, one transaction):
--   psql -v ON_ERROR_STOP=1 --single-transaction -f 005_tamper_evident_audit.sql
-- It touches only the audit log's tables and functions, so it does not depend
-- on version 4 (another table) and version 4 does not depend on it: the
-- installer applies every file not yet recorded, in number order.
--
-- The append-only trigger stops UPDATE, DELETE and TRUNCATE, but the table's
-- owner can disable it. This version makes a change visible afterwards:
--
-- * every audit row gets `row_hash`, the SHA-256 of a canonical JSON array of
--   its stored values (id and time included), computed by a BEFORE INSERT
--   trigger from the values as stored, so every client gets the same hash;
-- * `policy_version`: the version (e.g. the hash) of the policy that decided,
--   NULL when the writer does not say;
-- * `toolguard_audit_seal`: a chain of seals. A sealer (`toolguard audit seal`)
--   closes ranges of ids: a seal lists each row's id and hash, and the hash of
--   the previous seal; inserts never touch it, so concurrent writers never wait
--   for one another. `toolguard audit verify` recomputes every hash and reports
--   a changed, deleted or inserted row (and a changed or missing seal) by id;
-- * `toolguard_audit_retention` and `toolguard_audit_drop_exported`: old
--   sealed ranges can be exported to a file and dropped; what remains still
--   verifies, its first seal linking to the dropped range's final hash.
--
-- The canonical text of a row (the same expression is in toolguard/store/chain.py,
-- which the verifier uses, so a replaced function here cannot hide a change):
--   json_build_array('toolguard.audit.1', id, at as UTC text with microseconds,
--     agent, tool, intent_id, idempotency_key, workflow, decision, reason,
--     keys (a JSON array), tokens, args (as jsonb prints them: keys sorted), detail,
--     duration_ms as the hex of its IEEE 754 bits (float8send), node_attempt,
--     policy_version)::text
-- Only built-in functions whose output does not depend on session settings.
-- Rows written before this version have no row hash; the first seal covers them
-- with the hash of their content at that time.

SELECT pg_advisory_xact_lock(hashtext('toolguard.install'));

ALTER TABLE toolguard_audit ADD COLUMN IF NOT EXISTS policy_version text;
ALTER TABLE toolguard_audit ADD COLUMN IF NOT EXISTS row_hash bytea;

-- The canonical text of an audit row, for people and other clients checking rows by
-- hand: SELECT id, row_hash = sha256(convert_to(toolguard_audit_canonical(a), 'UTF8'))
--      FROM toolguard_audit a;
CREATE OR REPLACE FUNCTION toolguard_audit_canonical(a toolguard_audit) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT pg_catalog.json_build_array('toolguard.audit.1'::text, a.id,
        pg_catalog.to_char(a.at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
        a.agent, a.tool, a.intent_id, a.idempotency_key, a.workflow, a.decision, a.reason,
        a.keys, a.tokens, a.args, a.detail,
        pg_catalog.encode(pg_catalog.float8send(a.duration_ms), 'hex'),
        a.node_attempt, a.policy_version)::text
$$;

-- The row hash, set on every insert whatever the client sent (the expression is inlined,
-- not a call of the function above: a plpgsql expression costs less than a SQL function call).
CREATE OR REPLACE FUNCTION toolguard_audit_row_hash() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.row_hash := pg_catalog.sha256(pg_catalog.convert_to(
        pg_catalog.json_build_array('toolguard.audit.1'::text, NEW.id,
            pg_catalog.to_char(NEW.at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
            NEW.agent, NEW.tool, NEW.intent_id, NEW.idempotency_key, NEW.workflow,
            NEW.decision, NEW.reason, NEW.keys, NEW.tokens, NEW.args,
            NEW.detail, pg_catalog.encode(pg_catalog.float8send(NEW.duration_ms), 'hex'),
            NEW.node_attempt, NEW.policy_version)::text, 'UTF8'));
    RETURN NEW;
END;
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgname = 'toolguard_audit_row_hash'
                     AND tgrelid = 'toolguard_audit'::regclass) THEN
        CREATE TRIGGER toolguard_audit_row_hash
            BEFORE INSERT ON toolguard_audit
            FOR EACH ROW EXECUTE FUNCTION toolguard_audit_row_hash();
    END IF;
END;
$$;

-- One seal: the ids (after_id, last_id], each row's id (8 bytes, big-endian) and row
-- hash (32 bytes) in id order in `rows`, and the hash of the previous seal (64 zeros
-- for the first, or the final hash of a dropped range). seal_hash is the SHA-256 (hex) of
--   'toolguard.audit.seal.1' \n seq \n after_id \n last_id \n row_count \n
--   hex(sha256(rows)) \n prev_hash \n sealed_at (UTC, YYYY-MM-DDTHH:MM:SS.ffffffZ)
-- The sealer computes it; the verifier recomputes it.
CREATE TABLE IF NOT EXISTS toolguard_audit_seal (
    seq        bigint PRIMARY KEY CHECK (seq > 0),
    after_id   bigint NOT NULL UNIQUE CHECK (after_id >= 0),
    last_id    bigint NOT NULL,
    row_count  integer NOT NULL CHECK (row_count > 0),
    rows       bytea NOT NULL,
    prev_hash  text NOT NULL CHECK (prev_hash ~ '^[0-9a-f]{64}$'),
    seal_hash  text NOT NULL UNIQUE CHECK (seal_hash ~ '^[0-9a-f]{64}$'),
    sealed_at  timestamptz NOT NULL,
    CHECK (last_id > after_id),
    CHECK (length(rows) = 40 * row_count)
);

-- One row per exported range that was dropped: everything through seal `through_seq`
-- (ids <= through_id). The next seal links to `final_hash`; the export file records it too.
CREATE TABLE IF NOT EXISTS toolguard_audit_retention (
    through_seq bigint PRIMARY KEY CHECK (through_seq > 0),
    through_id  bigint NOT NULL,
    final_hash  text NOT NULL CHECK (final_hash ~ '^[0-9a-f]{64}$'),
    rows        bigint NOT NULL,
    seals       bigint NOT NULL,
    file_sha256 text,
    dropped_at  timestamptz NOT NULL DEFAULT now(),
    dropped_by  text NOT NULL DEFAULT current_user
);

-- Append-only, like the log itself (SQLSTATE TG005).
CREATE OR REPLACE FUNCTION toolguard_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = 'TG005',
        MESSAGE = format('%s is append-only: %s is not allowed', TG_TABLE_NAME, TG_OP),
        HINT = 'rows can only be inserted (toolguard_audit_drop_exported drops exported ranges)';
END;
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgname = 'toolguard_audit_seal_append_only'
                     AND tgrelid = 'toolguard_audit_seal'::regclass) THEN
        CREATE TRIGGER toolguard_audit_seal_append_only
            BEFORE UPDATE OR DELETE OR TRUNCATE ON toolguard_audit_seal
            FOR EACH STATEMENT EXECUTE FUNCTION toolguard_append_only();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgname = 'toolguard_audit_retention_append_only'
                     AND tgrelid = 'toolguard_audit_retention'::regclass) THEN
        CREATE TRIGGER toolguard_audit_retention_append_only
            BEFORE UPDATE OR DELETE OR TRUNCATE ON toolguard_audit_retention
            FOR EACH STATEMENT EXECUTE FUNCTION toolguard_append_only();
    END IF;
END;
$$;

-- Drop an exported range: the rows and seals through seal p_through_seq, which must have
-- hash p_final_hash and hold exactly p_rows rows (else TG003 and nothing changes). Run it
-- after the export file is written and checked (`toolguard audit export --drop` does). It
-- disables the append-only triggers for its own transaction only, so it needs the tables'
-- owner, and it blocks writers of the log until it commits. Returns the rows dropped.
CREATE OR REPLACE FUNCTION toolguard_audit_drop_exported(
    p_through_seq bigint, p_final_hash text, p_rows bigint, p_file_sha256 text DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_seal toolguard_audit_seal%ROWTYPE;
    v_rows bigint;
    v_seals bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('toolguard.audit.seal'));
    SELECT * INTO v_seal FROM toolguard_audit_seal WHERE seq = p_through_seq;
    IF NOT FOUND OR v_seal.seal_hash IS DISTINCT FROM p_final_hash THEN
        RAISE EXCEPTION USING ERRCODE = 'TG003',
            MESSAGE = format('no seal #%s with hash %s to drop through', p_through_seq,
                             p_final_hash);
    END IF;
    ALTER TABLE toolguard_audit DISABLE TRIGGER toolguard_audit_append_only;
    ALTER TABLE toolguard_audit_seal DISABLE TRIGGER toolguard_audit_seal_append_only;
    DELETE FROM toolguard_audit WHERE id <= v_seal.last_id;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    DELETE FROM toolguard_audit_seal WHERE seq <= p_through_seq;
    GET DIAGNOSTICS v_seals = ROW_COUNT;
    ALTER TABLE toolguard_audit ENABLE TRIGGER toolguard_audit_append_only;
    ALTER TABLE toolguard_audit_seal ENABLE TRIGGER toolguard_audit_seal_append_only;
    IF p_rows IS NULL OR v_rows <> p_rows THEN
        RAISE EXCEPTION USING ERRCODE = 'TG003',
            MESSAGE = format('expected to drop %s exported rows through id %s, found %s: the '
                             'range changed since it was exported', p_rows, v_seal.last_id,
                             v_rows);
    END IF;
    INSERT INTO toolguard_audit_retention (through_seq, through_id, final_hash, rows, seals,
                                           file_sha256)
    VALUES (p_through_seq, v_seal.last_id, p_final_hash, v_rows, v_seals, p_file_sha256);
    RETURN v_rows;
END;
$$;

INSERT INTO toolguard_schema_version (version, name) VALUES (5, '005_tamper_evident_audit')
ON CONFLICT (version) DO NOTHING;
