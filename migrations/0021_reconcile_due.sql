-- Reconciliation in proportion to what happened, not to every sequence
-- there is (issue #45). A pooled period is due while numbers taken from
-- its counter wait to be judged: every statement that takes numbers from
-- a pooled counter (a refill's block, a direct reservation, a fence) puts
-- its period here in its own transaction, and reconciliation takes it out
-- once everything below the counter is judged. Rows exist only for
-- periods with something to judge, so a quiet sequence costs a run
-- nothing. No foreign key: the reservation's statement stays one index
-- probe longer, no more.
CREATE TABLE reconcile_due (
    sequence_id BIGINT NOT NULL,
    period      TEXT NOT NULL,
    PRIMARY KEY (sequence_id, period)
);

-- What earlier runs had left to do (they looked at every period whose
-- checkpoint was behind its counter, or whose pool was never closed).
INSERT INTO reconcile_due (sequence_id, period)
SELECT c.sequence_id, c.period
FROM counters c
JOIN sequences s ON s.id = c.sequence_id AND s.numbering = 'pooled'
LEFT JOIN reconcile_periods r USING (sequence_id, period)
WHERE r.checkpoint IS NULL OR r.checkpoint < c.next_seq OR r.pool_closed_at IS NULL;

-- A run's other reads of all sequences, by index: the gapless ones it
-- checks, and those with a max it counts when near it.
CREATE INDEX sequences_gapless ON sequences (id) WHERE numbering = 'gapless';
CREATE INDEX sequences_with_max ON sequences (id) WHERE max_seq IS NOT NULL;
