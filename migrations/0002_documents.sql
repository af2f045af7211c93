-- Documents: the transactional outbox (the seed's id_outbox), the default
-- target store, and idempotency records.

CREATE TABLE id_outbox (
    id              BIGSERIAL PRIMARY KEY,
    document_id     VARCHAR(64) NOT NULL UNIQUE,
    tenant_code     VARCHAR(32) NOT NULL,
    entity_type_id  VARCHAR(32) NOT NULL,
    payload         JSONB       NOT NULL,
    status          VARCHAR(16) NOT NULL DEFAULT 'pending'
        CHECK (status IN ('pending', 'committed', 'dead_letter', 'abandoned')),
    retry_count     INT         NOT NULL DEFAULT 0,
    next_retry_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    processed_at    TIMESTAMPTZ,
    last_error      TEXT,
    -- The number the document carries: one document per number, ever.
    sequence_id     BIGINT      NOT NULL REFERENCES sequences (id),
    period          TEXT        NOT NULL,
    seq             BIGINT      NOT NULL,
    -- The number as clients saw it in `seq` (the whole value for int64).
    seq_number      BIGINT      NOT NULL,
    UNIQUE (sequence_id, period, seq)
);
-- Only due pending rows are scanned by the processor.
CREATE INDEX idx_outbox_pending ON id_outbox (next_retry_at) WHERE status = 'pending';
CREATE INDEX idx_outbox_by_status ON id_outbox (status, id);

-- New rows wake the processors at once (one notification per statement).
CREATE FUNCTION idpool_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idpool_outbox', '');
    RETURN NULL;
END $$;
CREATE TRIGGER id_outbox_inserted AFTER INSERT ON id_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION idpool_outbox_notify();

-- The default target store (IDPOOL_SINK=postgres).
CREATE TABLE documents (
    document_id  VARCHAR(64) PRIMARY KEY,
    project      VARCHAR(32) NOT NULL,
    doc_type     VARCHAR(32) NOT NULL,
    seq          BIGINT      NOT NULL,
    metadata     JSONB       NOT NULL,
    created_at   TIMESTAMPTZ NOT NULL,
    delivered_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Idempotency-Key records, per caller; kept 24 h. A request holds its
-- row's lock from insert to commit, so a concurrent twin waits on it.
CREATE TABLE idempotency_keys (
    caller        TEXT        NOT NULL,
    key           TEXT        NOT NULL,
    request_hash  BYTEA       NOT NULL,
    status_code   SMALLINT    NOT NULL,
    response      JSONB       NOT NULL,
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (caller, key)
);
CREATE INDEX idempotency_keys_by_age ON idempotency_keys (created_at);
