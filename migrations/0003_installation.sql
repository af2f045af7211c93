-- Who this database is, so two databases sharing one Redis and key prefix
-- never take numbers from each other's pools.
CREATE TABLE installation (
    id         UUID PRIMARY KEY DEFAULT gen_random_uuid(),
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    only_one   BOOLEAN NOT NULL DEFAULT true UNIQUE CHECK (only_one)
);
INSERT INTO installation DEFAULT VALUES;
