-- API keys: a secret shown once at creation, kept only as its SHA-256.
-- A key acts inside its projects, or everywhere if it is an admin key.
CREATE TABLE api_keys (
    id           TEXT PRIMARY KEY,
    name         TEXT,
    secret_hash  BYTEA NOT NULL CHECK (length(secret_hash) = 32),
    admin        BOOLEAN NOT NULL,
    projects     TEXT[] NOT NULL,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    revoked_at   TIMESTAMPTZ,
    last_used_at TIMESTAMPTZ,
    CHECK (admin OR cardinality(projects) > 0)
);

-- Idempotency records written before keys existed belong to no key.
UPDATE idempotency_keys SET caller = 'legacy:' || caller WHERE caller NOT LIKE 'key:%';
