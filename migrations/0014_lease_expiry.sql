-- Leased answers without a commit each: an instance hands out numbers of a
-- lease from memory and records which ones went to callers in the
-- background (lease_handouts, a few milliseconds later). So that an ID it
-- answered is attachable even if it is killed before that record lands, a
-- lease row says until when its holder may hand out its numbers
-- (lease_expires_at, on Postgres' clock; the holder stops earlier by its
-- own). Past that, an attach of one of its numbers not recorded as handed
-- out ends the lease (lease_ended_at): its holder then gives none of its
-- numbers back to the pool, and each is attachable once (what was not
-- answered is lease_lost). Rows written before this have neither and keep
-- the old rule: a handout record is the only proof.
ALTER TABLE issuance_ledger ADD COLUMN lease_expires_at TIMESTAMPTZ;
ALTER TABLE issuance_ledger ADD COLUMN lease_ended_at TIMESTAMPTZ;
