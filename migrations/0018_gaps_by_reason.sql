-- A page of gaps of one reason is one walk of an index in list order from
-- the cursor (SPEC: a list costs in proportion to its page): without it, a
-- sequence's one discarded pool after 20,000 gaps of another reason was
-- found by reading all 20,000.
CREATE INDEX id_gaps_open_by_reason ON id_gaps (sequence_id, reason, period, from_seq)
    WHERE resolved_at IS NULL;
