-- Gap reconciliation: every number of every sequence period accounted for.

-- When a document's status last changed: reconciliation re-judges numbers
-- whose document changed since its last run.
ALTER TABLE id_outbox ADD COLUMN status_changed_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp();
CREATE INDEX id_outbox_status_changed ON id_outbox (status_changed_at);
CREATE FUNCTION idpool_outbox_status_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status IS DISTINCT FROM OLD.status THEN
        NEW.status_changed_at := clock_timestamp();
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER id_outbox_status_changed BEFORE UPDATE OF status ON id_outbox
    FOR EACH ROW EXECUTE FUNCTION idpool_outbox_status_changed();

-- Late ledger records and discards are found by time, ranges by overlap.
CREATE INDEX issuance_ledger_by_time ON issuance_ledger (issued_at);
CREATE INDEX pool_discards_by_time ON pool_discards (discarded_at);
DROP INDEX pool_discards_by_period;
CREATE INDEX pool_discards_ranges ON pool_discards USING gist (sequence_id, period, seqs);
DROP INDEX blocks_by_period;
CREATE INDEX blocks_ranges ON blocks USING gist (sequence_id, period, seqs);

-- Open rows are the current gaps; resolved rows are history.
CREATE TABLE id_gaps (
    id          BIGSERIAL PRIMARY KEY,
    sequence_id BIGINT NOT NULL REFERENCES sequences (id),
    period      TEXT NOT NULL,
    from_seq    BIGINT NOT NULL,
    to_seq      BIGINT NOT NULL CHECK (to_seq >= from_seq),
    from_id     TEXT NOT NULL,
    to_id       TEXT NOT NULL,
    reason      TEXT NOT NULL CHECK (reason IN
                    ('issued_unattached', 'outbox_dlq', 'abandoned', 'pool_discarded', 'untracked_loss')),
    detected_at TIMESTAMPTZ NOT NULL,
    resolved_at TIMESTAMPTZ
);
CREATE INDEX id_gaps_open_by_position ON id_gaps (sequence_id, period, from_seq) WHERE resolved_at IS NULL;
CREATE INDEX id_gaps_open_ranges ON id_gaps
    USING gist (sequence_id, period, int8range(from_seq, to_seq, '[]')) WHERE resolved_at IS NULL;

-- Per period: numbers below `checkpoint` are judged. An ended period's pool
-- is discarded once (`pool_closed_at`).
CREATE TABLE reconcile_periods (
    sequence_id    BIGINT NOT NULL REFERENCES sequences (id),
    period         TEXT NOT NULL,
    checkpoint     BIGINT NOT NULL,
    pool_closed_at TIMESTAMPTZ,
    PRIMARY KEY (sequence_id, period)
);

-- What each run saw: every number below `bound` had left the counter and
-- the pool by `observed_at`. A mark older than the settle time makes those
-- numbers judgeable: no request can still be carrying them.
CREATE TABLE reconcile_marks (
    sequence_id BIGINT NOT NULL REFERENCES sequences (id),
    period      TEXT NOT NULL,
    observed_at TIMESTAMPTZ NOT NULL,
    bound       BIGINT NOT NULL,
    PRIMARY KEY (sequence_id, period, observed_at)
);

CREATE TABLE reconcile_runs (
    id          BIGSERIAL PRIMARY KEY,
    instance_id TEXT NOT NULL,
    started_at  TIMESTAMPTZ NOT NULL,
    finished_at TIMESTAMPTZ,
    summary     JSONB
);
