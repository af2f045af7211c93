-- Delivering a document (pending -> committed) is the outbox's most common
-- write; it should touch as little as it can.

-- Listing by status serves operators looking for unfinished documents;
-- committed ones are listed by the primary key. Rows leave this index when
-- they are delivered instead of gaining an entry.
DROP INDEX idx_outbox_by_status;
CREATE INDEX idx_outbox_unfinished ON id_outbox (status, id) WHERE status <> 'committed';

-- Reconciliation re-judges numbers whose document changed in a way that
-- can change a gap. pending -> committed cannot (both are attached); a
-- committed document that left a dead letter or an abandon was stamped when
-- it went back to pending.
CREATE OR REPLACE FUNCTION idpool_outbox_status_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status IS DISTINCT FROM OLD.status
       AND NOT (OLD.status = 'pending' AND NEW.status = 'committed') THEN
        NEW.status_changed_at := clock_timestamp();
    END IF;
    RETURN NEW;
END $$;
