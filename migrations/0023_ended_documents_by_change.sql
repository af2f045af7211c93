-- Reconciliation looks for documents dead-lettered or abandoned since its
-- last run (less the lookback) without the gap that says so. Through the
-- index of every status change, a run read every document that changed
-- within the lookback, an import's hundreds of thousands among them; this
-- one holds only the ended documents, few by nature. A document inserted
-- or delivered costs the predicate's check, no entry.
CREATE INDEX id_outbox_ended_by_change ON id_outbox (status_changed_at)
    WHERE status IN ('dead_letter', 'abandoned');
