-- The due time a delivery's claim set, kept beside the due time itself:
-- while the two are equal and still ahead, an attempt is under way (a
-- failure or a release sets a new due time, a delivery a new status), and
-- an operator's abandon is refused rather than answered while the target
-- may be taking the document.
ALTER TABLE id_outbox ADD COLUMN claimed_until TIMESTAMPTZ;
ALTER TABLE endpoint_deliveries ADD COLUMN claimed_until TIMESTAMPTZ;
