-- The numbers in open gaps, per reason, kept as gaps are written rather
-- than summed over every open gap at each run (the gauge
-- idpool_gaps_open): an installation where 100,000 sequences each left a
-- number without a document summed 100,000 rows a run.
CREATE TABLE gap_totals (
    reason  TEXT PRIMARY KEY,
    numbers BIGINT NOT NULL
);
INSERT INTO gap_totals (reason, numbers)
SELECT reason, sum(to_seq - from_seq + 1) FROM id_gaps WHERE resolved_at IS NULL GROUP BY reason;

-- One statement's change of the open gaps, per reason: what its new rows
-- hold open less what its old rows did.
CREATE FUNCTION idpool_gap_totals_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO gap_totals (reason, numbers)
        SELECT reason, sum(to_seq - from_seq + 1) FROM new_rows
        WHERE resolved_at IS NULL GROUP BY reason
        ON CONFLICT (reason) DO UPDATE SET numbers = gap_totals.numbers + EXCLUDED.numbers;
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO gap_totals (reason, numbers)
        SELECT reason, sum(n) FROM (
            SELECT reason, to_seq - from_seq + 1 AS n FROM new_rows WHERE resolved_at IS NULL
            UNION ALL
            SELECT reason, -(to_seq - from_seq + 1) FROM old_rows WHERE resolved_at IS NULL
        ) AS d GROUP BY reason
        ON CONFLICT (reason) DO UPDATE SET numbers = gap_totals.numbers + EXCLUDED.numbers;
    ELSE
        INSERT INTO gap_totals (reason, numbers)
        SELECT reason, -sum(to_seq - from_seq + 1) FROM old_rows
        WHERE resolved_at IS NULL GROUP BY reason
        ON CONFLICT (reason) DO UPDATE SET numbers = gap_totals.numbers + EXCLUDED.numbers;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER id_gaps_counted_in AFTER INSERT ON id_gaps
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION idpool_gap_totals_changed();
CREATE TRIGGER id_gaps_counted_again AFTER UPDATE ON id_gaps
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION idpool_gap_totals_changed();
CREATE TRIGGER id_gaps_counted_out AFTER DELETE ON id_gaps
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION idpool_gap_totals_changed();
