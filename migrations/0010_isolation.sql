-- Isolation: what one tenant asks costs in proportion to its own answer.

-- Every filter the outbox list accepts is served by an index that starts
-- with the tenant, so a key's page is read from its own rows only (the
-- list walks each of its projects and statuses in row order and merges).
CREATE INDEX id_outbox_by_tenant ON id_outbox (tenant_code, status, id);
CREATE INDEX id_outbox_by_tenant_type ON id_outbox (tenant_code, entity_type_id, status, id);

-- The outbox processor shares each batch among the tenants with pending
-- rows: it skips through this index from tenant to tenant, and claims each
-- tenant's due rows in due order.
CREATE INDEX id_outbox_pending_by_tenant ON id_outbox (tenant_code, next_retry_at)
    WHERE status = 'pending';

-- A document's legacy id (`idpool import`, the batch API's `source_id`):
-- one document per source id of a project and type, for ever, whichever
-- key sent it and however often.
ALTER TABLE id_outbox ADD COLUMN source_id TEXT;
CREATE UNIQUE INDEX id_outbox_source ON id_outbox (tenant_code, entity_type_id, source_id)
    WHERE source_id IS NOT NULL;

-- Keys created since an instance loaded them are found by creation time.
CREATE INDEX api_keys_by_creation ON api_keys (created_at);
