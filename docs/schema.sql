-- idem schema version 1: what PostgresStore::ensure_schema() runs, in one transaction, one
-- statement at a time. Citus: PostgresStore::distribute() (docs/scale-out.md), or by hand
-- SELECT create_distributed_table('idem_keys', 'scope').
CREATE TABLE IF NOT EXISTS "idem_schema_version" (
    table_name  text PRIMARY KEY,
    version     integer NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS "idem_keys" (
    scope            text COLLATE "C" NOT NULL,   -- tenant/account/endpoint, part of the key
    key              text COLLATE "C" NOT NULL,   -- the client's Idempotency-Key, verbatim
    state            text NOT NULL CHECK (state IN ('in_progress', 'completed')),
    fingerprint      bytea NOT NULL,              -- digest of the request
    fingerprint_alg  smallint NOT NULL,           -- 1 = SHA-256, 2 = HMAC-SHA256 (fingerprint_secret)
    fence            bigint NOT NULL,             -- random token of the current claim
    attempt          integer NOT NULL DEFAULT 1,
    result           bytea,                       -- the stored response, byte for byte
    phase            text,                        -- last recovery point recorded by the effect
    phase_data       bytea,                       -- and its data (e.g. the provider's charge id)
    waiters          boolean NOT NULL DEFAULT false,  -- a caller LISTENs for this key's save
    created_at       timestamptz NOT NULL DEFAULT now(),
    lease_until      timestamptz NOT NULL,        -- the claimer owns the key until then
    completed_at     timestamptz,
    expires_at       timestamptz NOT NULL,        -- retention: created_at + retention
    PRIMARY KEY (scope, key),
    CHECK ((state = 'completed') = (result IS NOT NULL))
) WITH (fillfactor = 90);
-- For purging expired keys. No index on state, lease_until or phase: the completing UPDATE, the
-- heartbeat and recovery points stay HOT updates (no index entry written).
CREATE INDEX IF NOT EXISTS "idem_keys_expires_at_idx" ON "idem_keys" (expires_at);
INSERT INTO "idem_schema_version" (table_name, version) VALUES ('idem_keys', 1)
    ON CONFLICT (table_name) DO UPDATE SET version = EXCLUDED.version, applied_at = now()
    WHERE "idem_schema_version".version < EXCLUDED.version;
