-- toolguard guarded store, PostgreSQL schema version 7: the text of every policy version
-- that decided.
--
-- Apply on top of the earlier files (same rules: idempotent, one transaction):
--   psql -v ON_ERROR_STOP=1 --single-transaction -f 007_policy_versions.sql
--
-- Every audit row names the policy that decided (toolguard_audit.policy_version,
-- the SHA-256 of the policy's canonical content). A guard writes that content here
-- when it first decides under a version, with the YAML files it was loaded from,
-- so that the review page and `toolguard audit show` show the rule of the version
-- that decided, whatever the files on disk say now. The content must hash to its
-- digest (a CHECK): a row here cannot name a policy it does not hold. Append-only,
-- like the log; needs 005 (toolguard_append_only).

SELECT pg_advisory_xact_lock(hashtext('toolguard.install'));

CREATE TABLE IF NOT EXISTS toolguard_policy_version (
    digest    text PRIMARY KEY CHECK (digest ~ '^[0-9a-f]{64}$'),
    -- the canonical JSON the digest covers (what the policy means)
    content   text NOT NULL,
    -- [{"file": ..., "text": ...}]: the YAML as the guard loaded it (NULL: built in code,
    -- or the files changed since they were loaded)
    sources   jsonb,
    first_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    CHECK (pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(content, 'UTF8')), 'hex')
           = digest),
    CHECK (sources IS NULL OR pg_catalog.jsonb_typeof(sources) = 'array')
);

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger
                   WHERE tgname = 'toolguard_policy_version_append_only'
                     AND tgrelid = 'toolguard_policy_version'::regclass) THEN
        CREATE TRIGGER toolguard_policy_version_append_only
            BEFORE UPDATE OR DELETE OR TRUNCATE ON toolguard_policy_version
            FOR EACH STATEMENT EXECUTE FUNCTION toolguard_append_only();
    END IF;
END;
$$;

INSERT INTO toolguard_schema_version (version, name) VALUES (7, '007_policy_versions')
ON CONFLICT (version) DO NOTHING;
