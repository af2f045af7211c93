-- Leases: an instance records a run of numbers as leased to it (one ledger
-- row, via 'lease') before handing out any of them, serves requests from
-- memory, and reports in the background which numbers went to callers
-- (lease_handouts) and which it gave back (pool_discards, cause
-- 'lease_returned'). What a stopped instance never reported is 'lease_lost'.
ALTER TABLE issuance_ledger DROP CONSTRAINT issuance_ledger_via_check;
ALTER TABLE issuance_ledger ADD CONSTRAINT issuance_ledger_via_check
    CHECK (via IN ('ids', 'document', 'lease'));

-- Numbers of a lease handed to a caller by POST /ids.
CREATE TABLE lease_handouts (
    sequence_id BIGINT NOT NULL,
    period      TEXT NOT NULL,
    seqs        INT8RANGE NOT NULL CHECK (NOT isempty(seqs)),
    reported_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX lease_handouts_ranges ON lease_handouts USING gist (sequence_id, period, seqs);
CREATE INDEX lease_handouts_by_time ON lease_handouts (reported_at);

ALTER TABLE id_gaps DROP CONSTRAINT id_gaps_reason_check;
ALTER TABLE id_gaps ADD CONSTRAINT id_gaps_reason_check CHECK (reason IN
    ('issued_unattached', 'outbox_dlq', 'abandoned', 'pool_discarded', 'untracked_loss', 'lease_lost'));
