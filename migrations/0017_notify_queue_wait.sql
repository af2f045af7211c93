-- A notifying transaction's COMMIT queues on one lock per database
-- (Postgres keeps the notification queue in commit order), and that wait
-- counts against lock_timeout. The shared writers' 200 ms is meant for row
-- locks, where the request that waits is the one at fault; behind other
-- tenants' commits nobody is, and a small document failed beside another
-- tenant's large batches. A transaction that notifies from here on waits
-- up to 2 s, the requests' own lock bound, and only at its commit: these
-- are the trigger's last statements, and the outbox insert is the last
-- statement of every write.
CREATE FUNCTION idpool_notify_queue_wait() RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('lock_timeout') <> '0'
       AND current_setting('lock_timeout')::interval < interval '2 seconds' THEN
        PERFORM set_config('lock_timeout', '2s', true);
    END IF;
END $$;

CREATE OR REPLACE FUNCTION idpool_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM sequences WHERE register IS NOT NULL) THEN
        PERFORM idpool_register_append(array_agg(r.project), array_agg(r.sequence_id),
                                       array_agg(r.period), array_agg(r.seq),
                                       array_agg(r.document_id), array_agg('attached'::text),
                                       array_agg(NULL::text))
          FROM (SELECT s.project, i.sequence_id, i.period, i.seq, i.document_id
                  FROM inserted i
                  JOIN sequences s ON s.id = i.sequence_id AND s.register IS NOT NULL
                 ORDER BY s.project, i.sequence_id, i.period, i.seq) r
        HAVING count(*) > 0;
    END IF;
    IF EXISTS (SELECT 1 FROM inserted WHERE routed) THEN
        INSERT INTO endpoint_deliveries (outbox_id, endpoint_id)
        SELECT i.id, e.id FROM inserted i
          JOIN endpoints e ON e.project = i.tenant_code
         WHERE i.routed AND NOT e.disabled
           AND (e.types IS NULL OR i.entity_type_id = ANY (e.types));
        UPDATE id_outbox o SET routed = false, next_retry_at = now()
          FROM inserted i
         WHERE o.id = i.id AND i.routed
           AND NOT EXISTS (SELECT 1 FROM endpoint_deliveries d WHERE d.outbox_id = i.id);
        PERFORM idpool_notify_queue_wait();
        PERFORM pg_notify('idpool_deliveries', '');
    END IF;
    IF EXISTS (SELECT 1 FROM inserted WHERE NOT routed) THEN
        PERFORM idpool_notify_queue_wait();
        PERFORM pg_notify('idpool_outbox',
            (SELECT string_agg(DISTINCT tenant_code, ',') FROM inserted WHERE NOT routed));
    END IF;
    RETURN NULL;
END $$;
