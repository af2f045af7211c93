-- A routed document's retry_count counts the attempts that failed, as the
-- sink's does: a delivery committed at its first attempt left it at 1.
CREATE OR REPLACE FUNCTION idpool_settle_routed(ids BIGINT[]) RETURNS void LANGUAGE sql AS $$
    UPDATE id_outbox o SET
        status = s.status,
        retry_count = s.failed,
        last_error = s.last_error,
        processed_at = CASE WHEN s.status = 'pending' THEN NULL
                            ELSE coalesce(o.processed_at, clock_timestamp()) END
    FROM (SELECT d.outbox_id,
                 CASE WHEN bool_or(d.status = 'pending') THEN 'pending'
                      WHEN bool_or(d.status = 'dead_letter') THEN 'dead_letter'
                      WHEN bool_or(d.status = 'committed') THEN 'committed'
                      ELSE 'abandoned' END AS status,
                 -- The attempt that delivered is the one that did not fail.
                 max(GREATEST(d.attempts - CASE WHEN d.status = 'committed' THEN 1 ELSE 0 END, 0)) AS failed,
                 max(d.last_error) FILTER (WHERE d.status <> 'committed') AS last_error
            FROM endpoint_deliveries d
           WHERE d.outbox_id = ANY (ids)
           GROUP BY d.outbox_id) s
    WHERE o.id = s.outbox_id
      AND (o.status, o.retry_count, o.last_error) IS DISTINCT FROM (s.status, s.failed, s.last_error);
$$;
