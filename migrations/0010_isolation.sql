-- Isolation: what one tenant asks costs in proportion to its own answer.

-- Every filter the outbox list accepts is served by an index that starts
-- with the tenant, so a key's page is read from its own rows only. A
-- project's documents are listed by type, then in the order they came;
-- delivered ones from the first index, the others (pending, dead letters,
-- abandoned) from the second, merged. A row is in one of them at a time,
-- so accepting a document adds one entry and delivering it one more.
CREATE INDEX id_outbox_committed_by_tenant ON id_outbox (tenant_code, entity_type_id, id)
    WHERE status = 'committed';
CREATE INDEX id_outbox_unfinished_by_tenant ON id_outbox (tenant_code, status, entity_type_id, id)
    WHERE status <> 'committed';

-- The outbox processor shares each batch among the tenants with pending
-- rows: it skips through this index from tenant to tenant, and claims each
-- tenant's due rows in due order. It replaces the index of pending rows in
-- due order, which let a claim walk every tenant's rows.
CREATE INDEX id_outbox_pending_by_tenant ON id_outbox (tenant_code, next_retry_at)
    WHERE status = 'pending';
DROP INDEX idx_outbox_pending;

-- A notification of new rows names their tenants, so processors learn of
-- a tenant with pending rows without looking for it.
CREATE OR REPLACE FUNCTION idpool_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idpool_outbox',
        coalesce((SELECT string_agg(DISTINCT tenant_code, ',') FROM inserted), ''));
    RETURN NULL;
END $$;
DROP TRIGGER id_outbox_inserted ON id_outbox;
CREATE TRIGGER id_outbox_inserted AFTER INSERT ON id_outbox
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION idpool_outbox_notify();

-- A document's legacy id (`idpool import`, the batch API's `source_id`):
-- one document per source id of a project and type, for ever, whichever
-- key sent it and however often.
ALTER TABLE id_outbox ADD COLUMN source_id TEXT;
CREATE UNIQUE INDEX id_outbox_source ON id_outbox (tenant_code, entity_type_id, source_id)
    WHERE source_id IS NOT NULL;

-- Keys created since an instance loaded them are found by creation time.
CREATE INDEX api_keys_by_creation ON api_keys (created_at);
