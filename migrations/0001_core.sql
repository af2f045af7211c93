-- Sequences, the counter of record, its blocks, and the issuance ledger.
-- Number ranges are half-open int8range values: [first, last + 1).

CREATE EXTENSION IF NOT EXISTS btree_gist;

CREATE TABLE sequences (
    id          BIGSERIAL PRIMARY KEY,
    project     TEXT NOT NULL,
    doc_type    TEXT NOT NULL,
    format      TEXT NOT NULL,
    layout      TEXT NOT NULL CHECK (layout IN ('text', 'int64')),
    epoch       TIMESTAMPTZ,
    start_seq   BIGINT NOT NULL,
    max_seq     BIGINT,
    reset       TEXT NOT NULL CHECK (reset IN ('never', 'daily', 'monthly', 'yearly')),
    timezone    TEXT NOT NULL,
    pool_size   INTEGER NOT NULL,
    refill_at   DOUBLE PRECISION NOT NULL,
    -- Bumped by every PUT, so clients and caches can tell definitions apart.
    version     INTEGER NOT NULL DEFAULT 1,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    UNIQUE (project, doc_type)
);

-- One counter per sequence period; next_seq only ever grows.
CREATE TABLE counters (
    sequence_id BIGINT NOT NULL REFERENCES sequences (id),
    period      TEXT NOT NULL,
    next_seq    BIGINT NOT NULL,
    -- Size of the latest reservation, so one UPDATE ... RETURNING can tell
    -- where a block that was cut short by max began.
    last_grant  BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (sequence_id, period)
);

-- Every reservation from a counter. 'pool' blocks went to a Redis pool
-- (pushed_at set once they are in it); 'direct' blocks went straight to one
-- caller, who records them in the ledger next.
CREATE TABLE blocks (
    id               BIGSERIAL PRIMARY KEY,
    sequence_id      BIGINT NOT NULL REFERENCES sequences (id),
    period           TEXT NOT NULL,
    seqs             INT8RANGE NOT NULL,
    purpose          TEXT NOT NULL CHECK (purpose IN ('pool', 'direct')),
    instance_id      TEXT NOT NULL,
    lock_acquired_at TIMESTAMPTZ,
    reserved_at      TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    pushed_at        TIMESTAMPTZ
);
CREATE INDEX blocks_by_period ON blocks (sequence_id, period, lower(seqs));

-- Every number handed to a caller, by POST /ids or POST /documents. The
-- exclusion constraint makes a second issue of any number impossible, even
-- when Redis hands back a stale list.
CREATE TABLE issuance_ledger (
    sequence_id BIGINT NOT NULL REFERENCES sequences (id),
    period      TEXT NOT NULL,
    seqs        INT8RANGE NOT NULL CHECK (NOT isempty(seqs)),
    via         TEXT NOT NULL CHECK (via IN ('ids', 'document')),
    issued_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT issuance_ledger_issued_once
        EXCLUDE USING gist (sequence_id WITH =, period WITH =, seqs WITH &&)
);
-- Position order within a period: the last issued number, scans from a checkpoint.
CREATE INDEX issuance_ledger_by_position ON issuance_ledger (sequence_id, period, lower(seqs));

-- Numbers taken out of a pool without being issued: a pool invalidated after
-- a Redis reconnect, a stale list, a block that lost its refill lock.
CREATE TABLE pool_discards (
    id           BIGSERIAL PRIMARY KEY,
    sequence_id  BIGINT NOT NULL REFERENCES sequences (id),
    period       TEXT NOT NULL,
    seqs         INT8RANGE NOT NULL,
    cause        TEXT NOT NULL,
    discarded_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX pool_discards_by_period ON pool_discards (sequence_id, period, lower(seqs));
