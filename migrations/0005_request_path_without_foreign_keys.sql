-- Tables written on the request path lose their foreign key to sequences.
-- Each checked row takes a KEY SHARE lock on its sequence's row, so every
-- concurrent transaction writing one sequence (batches of documents, the
-- shared ledger commits) piles a MultiXact onto that one hot row. Sequences
-- are never deleted, and rows here are only ever written with the id of a
-- sequence read first, so the keys guarded against nothing that can happen.
ALTER TABLE issuance_ledger DROP CONSTRAINT issuance_ledger_sequence_id_fkey;
ALTER TABLE blocks DROP CONSTRAINT blocks_sequence_id_fkey;
ALTER TABLE pool_discards DROP CONSTRAINT pool_discards_sequence_id_fkey;
ALTER TABLE id_outbox DROP CONSTRAINT id_outbox_sequence_id_fkey;
