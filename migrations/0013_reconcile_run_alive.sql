-- A run under way says it is alive every few seconds: a run whose
-- instance died (or lost Postgres) holds up the next one for about a
-- minute, not for as long as a run may last.
ALTER TABLE reconcile_runs ADD COLUMN alive_at TIMESTAMPTZ;
