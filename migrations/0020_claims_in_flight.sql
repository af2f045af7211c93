-- The due time a delivery's claim set, kept beside the due time itself:
-- while the two are equal and still ahead, an attempt is under way (a
-- failure or a release sets a new due time, a delivery a new status), and
-- an operator's abandon is refused rather than answered while the target
-- may be taking the document.
ALTER TABLE id_outbox ADD COLUMN claimed_until TIMESTAMPTZ;
ALTER TABLE endpoint_deliveries ADD COLUMN claimed_until TIMESTAMPTZ;

-- The one rule for both tables: when the attempt under way ends, or NULL
-- when none is.
CREATE FUNCTION idpool_attempt_ends(claimed_until TIMESTAMPTZ, due TIMESTAMPTZ)
    RETURNS TIMESTAMPTZ LANGUAGE sql VOLATILE AS $$
    SELECT CASE WHEN claimed_until = due AND due > clock_timestamp() THEN due END;
$$;
