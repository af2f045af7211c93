-- Delivery endpoints per project: a project's documents go to its own
-- endpoints (one delivery per document and endpoint) instead of the
-- installation's sink.

CREATE TABLE endpoints (
    id                   TEXT        PRIMARY KEY,
    project              VARCHAR(32) NOT NULL,
    url                  TEXT        NOT NULL,
    description          TEXT        NOT NULL DEFAULT '',
    -- The document types it takes; NULL: every type.
    types                TEXT[],
    disabled             BOOLEAN     NOT NULL DEFAULT false,
    -- 'manual' (PATCH) or 'failing' (every attempt failed for the stated time).
    disabled_reason      TEXT,
    -- HMAC keys: the secret signs; during a rotation the previous one signs
    -- too, until previous_expires_at. Kept as given: a signer needs them.
    secret               TEXT        NOT NULL,
    previous_secret      TEXT,
    previous_expires_at  TIMESTAMPTZ,
    -- Health: since when every attempt failed (NULL after a success), the
    -- failures in a row, and until when the circuit stays open (no attempt).
    failing_since        TIMESTAMPTZ,
    consecutive_failures INT         NOT NULL DEFAULT 0,
    circuit_open_until   TIMESTAMPTZ,
    created_at           TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at           TIMESTAMPTZ NOT NULL DEFAULT now()
);
-- A project's endpoints, listed in the order they were made.
CREATE INDEX endpoints_by_project ON endpoints (project, created_at, id);

-- One row per document and endpoint. No foreign key to the endpoint: a
-- deleted endpoint's undelivered documents stay, abandoned, and say why.
CREATE TABLE endpoint_deliveries (
    outbox_id       BIGINT      NOT NULL,
    endpoint_id     TEXT        NOT NULL,
    status          VARCHAR(16) NOT NULL DEFAULT 'pending'
        CHECK (status IN ('pending', 'committed', 'dead_letter', 'abandoned')),
    attempts        INT         NOT NULL DEFAULT 0,
    -- When it is due; while an attempt is under way, the end of its claim
    -- (a dispatcher that dies lets it fall due again then).
    next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_error      TEXT,
    last_attempt_at TIMESTAMPTZ,
    delivered_at    TIMESTAMPTZ,
    PRIMARY KEY (outbox_id, endpoint_id)
);
-- Due deliveries, endpoint by endpoint: a dispatcher skips from endpoint
-- to endpoint and claims each one's rows in due order.
CREATE INDEX endpoint_deliveries_due ON endpoint_deliveries (endpoint_id, next_attempt_at)
    WHERE status = 'pending';

-- A project's dead letters per endpoint (retried, abandoned or swept
-- endpoint by endpoint).
CREATE INDEX endpoint_deliveries_dead ON endpoint_deliveries (endpoint_id)
    WHERE status = 'dead_letter';

-- Endpoints deleted whose deliveries and attempts are still to be swept:
-- a delete is one row here, the sweep runs in bounded steps afterwards.
CREATE TABLE endpoints_deleted (
    id         TEXT        PRIMARY KEY,
    deleted_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Every attempt: what the tenant reads back (status code or error class,
-- duration), never the target's answer.
CREATE TABLE delivery_attempts (
    endpoint_id  TEXT        NOT NULL,
    document_id  VARCHAR(64) NOT NULL,
    attempted_at TIMESTAMPTZ NOT NULL,
    status_code  INT,
    error        TEXT,
    duration_ms  INT         NOT NULL
);
-- Listed newest first per endpoint; the cursor is (time, document).
CREATE INDEX delivery_attempts_by_endpoint
    ON delivery_attempts (endpoint_id, attempted_at DESC, document_id DESC);

-- Documents routed to endpoints stay `pending` in the outbox until their
-- deliveries end, but are never due for the installation's sink: the
-- insert writes them `routed`, due at infinity, when their project has an
-- enabled endpoint for their type (one probe of `endpoints` per row).
ALTER TABLE id_outbox ADD COLUMN routed BOOLEAN NOT NULL DEFAULT false;

-- New rows wake the sink's processors (naming their tenants), and routed
-- rows get their deliveries, in the statement that inserts them. Should an
-- endpoint have been disabled between the insert and this trigger, a
-- routed row left with no delivery goes back to the sink.
CREATE OR REPLACE FUNCTION idpool_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM inserted WHERE routed) THEN
        INSERT INTO endpoint_deliveries (outbox_id, endpoint_id)
        SELECT i.id, e.id FROM inserted i
          JOIN endpoints e ON e.project = i.tenant_code
         WHERE i.routed AND NOT e.disabled
           AND (e.types IS NULL OR i.entity_type_id = ANY (e.types));
        UPDATE id_outbox o SET routed = false, next_retry_at = now()
          FROM inserted i
         WHERE o.id = i.id AND i.routed
           AND NOT EXISTS (SELECT 1 FROM endpoint_deliveries d WHERE d.outbox_id = i.id);
        PERFORM pg_notify('idpool_deliveries', '');
    END IF;
    IF EXISTS (SELECT 1 FROM inserted WHERE NOT routed) THEN
        PERFORM pg_notify('idpool_outbox',
            (SELECT string_agg(DISTINCT tenant_code, ',') FROM inserted WHERE NOT routed));
    END IF;
    RETURN NULL;
END $$;

-- A routed document's status follows its deliveries: pending while any
-- is; else a dead letter while any is; else committed when any endpoint
-- took it; else abandoned. Its retry count and last error are its
-- deliveries' (the most attempts, a failing one's error).
CREATE FUNCTION idpool_settle_routed(ids BIGINT[]) RETURNS void LANGUAGE sql AS $$
    UPDATE id_outbox o SET
        status = s.status,
        retry_count = s.attempts,
        last_error = s.last_error,
        processed_at = CASE WHEN s.status = 'pending' THEN NULL
                            ELSE coalesce(o.processed_at, clock_timestamp()) END
    FROM (SELECT d.outbox_id,
                 CASE WHEN bool_or(d.status = 'pending') THEN 'pending'
                      WHEN bool_or(d.status = 'dead_letter') THEN 'dead_letter'
                      WHEN bool_or(d.status = 'committed') THEN 'committed'
                      ELSE 'abandoned' END AS status,
                 max(d.attempts) AS attempts,
                 max(d.last_error) FILTER (WHERE d.status <> 'committed') AS last_error
            FROM endpoint_deliveries d
           WHERE d.outbox_id = ANY (ids)
           GROUP BY d.outbox_id) s
    WHERE o.id = s.outbox_id
      AND (o.status, o.retry_count, o.last_error) IS DISTINCT FROM (s.status, s.attempts, s.last_error);
$$;
