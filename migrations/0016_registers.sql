-- Registers an auditor can verify (SPEC "Registers an auditor can
-- verify"): every event of a register's number appends one hash-chained
-- entry in the commit of the event, and each project's entries are the
-- leaves of an RFC 6962 Merkle tree whose checkpoints are signed.
--
-- The appends happen here, in triggers, so every path that writes a
-- document or a void (POST /documents, the batch, `idpool import`, the
-- expiry sweep) chains it in the same commit without knowing about it.

ALTER TABLE sequences ADD COLUMN register TEXT
    CHECK (register IN ('chain', 'verifactu'));
ALTER TABLE sequences ADD COLUMN register_issuer TEXT;
ALTER TABLE sequences ADD CONSTRAINT sequences_register_gapless
    CHECK (register IS NULL OR numbering = 'gapless');
ALTER TABLE sequences ADD CONSTRAINT sequences_register_issuer
    CHECK ((register IS NOT DISTINCT FROM 'verifactu') = (register_issuer IS NOT NULL));
-- The insert trigger asks "is there any register at all" first: this
-- index answers it without reading the table.
CREATE INDEX sequences_registers ON sequences (id) WHERE register IS NOT NULL;

-- The invoice fields of a VERI*FACTU document, exactly as sent.
ALTER TABLE id_outbox ADD COLUMN invoice JSONB;

-- One row per project with registers: the log's size and its frontier
-- (frontier[l + 1] is the root of the perfect subtree of 2^l leaves that
-- bit l of the size stands for). Appends lock it: a project's entries
-- take their indexes in commit order.
CREATE TABLE register_logs (
    project  TEXT PRIMARY KEY,
    size     BIGINT NOT NULL DEFAULT 0,
    frontier BYTEA[] NOT NULL DEFAULT '{}'
);

-- The entries, never changed or removed. `chain` names the chain the entry
-- links into: `s:<sequence id>` (chain) or `v:<issuer>` (verifactu);
-- `seq` is the entry's position in it (1, 2, ...), `number` the number of
-- the sequence the event is about.
CREATE TABLE register_entries (
    project     TEXT NOT NULL,
    log_index   BIGINT NOT NULL,
    chain       TEXT NOT NULL,
    seq         BIGINT NOT NULL,
    sequence_id BIGINT NOT NULL,
    period      TEXT NOT NULL,
    number      BIGINT NOT NULL,
    id          TEXT NOT NULL,
    event       TEXT NOT NULL
        CHECK (event IN ('attached', 'voided', 'expired', 'annulled')),
    body        TEXT NOT NULL,
    prev_hash   TEXT NOT NULL,
    hash        TEXT NOT NULL,
    at          TIMESTAMPTZ NOT NULL,
    -- A void's reason (also inside a chain entry's body; VERI*FACTU's
    -- anulación text has no field for it).
    note        TEXT,
    PRIMARY KEY (project, log_index)
);
-- A chain's head and its pages (no uniqueness: a tampered table must
-- still be readable, so verification can name what is wrong with it).
CREATE INDEX register_entries_chain ON register_entries (project, chain, seq);
-- A document's entries (its alta's huella, its annulment).
CREATE INDEX register_entries_by_id ON register_entries (sequence_id, id);
-- A VERI*FACTU number is annulled at most once.
CREATE UNIQUE INDEX register_entries_annulled ON register_entries (sequence_id, period, number)
    WHERE event = 'annulled';

-- Every perfect subtree of 2 or more leaves of each project's tree (a
-- leaf's hash is its entry's body's). A proof reads O(log² n) of them.
CREATE TABLE register_nodes (
    project TEXT NOT NULL,
    level   SMALLINT NOT NULL,
    idx     BIGINT NOT NULL,
    hash    BYTEA NOT NULL,
    PRIMARY KEY (project, level, idx)
);

-- Signed checkpoints, in the C2SP signed-note format.
CREATE TABLE register_checkpoints (
    project   TEXT NOT NULL,
    size      BIGINT NOT NULL,
    root      BYTEA NOT NULL,
    note      TEXT NOT NULL,
    key_name  TEXT NOT NULL,
    signed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (project, size)
);

-- The installation's signing keys, newest last: the public half of every
-- key that ever signed (verifiers need them), and the private half of a
-- key the installation made itself (none when it comes from a file).
CREATE TABLE register_keys (
    key_name    TEXT PRIMARY KEY,
    verifier    TEXT NOT NULL,
    private_key TEXT,
    first_used  TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Appends the events (one per array position, in order) to their
-- projects' logs. The caller passes them sorted by project: logs are
-- locked in that order, so two appenders never wait on each other
-- crosswise.
CREATE FUNCTION idpool_register_append(
    projects TEXT[], sequence_ids BIGINT[], periods TEXT[], numbers BIGINT[],
    ids TEXT[], events TEXT[], reasons TEXT[]
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    n          INT := coalesce(array_length(projects, 1), 0);
    v_project  TEXT := NULL;
    v_size     BIGINT;
    v_frontier BYTEA[];
    v_seq      RECORD;
    v_seq_id   BIGINT := NULL;
    v_at_json  TEXT;
    v_tail     TEXT;
    v_bytes    BYTEA;
    v_chain    TEXT;
    head_chain TEXT := NULL;
    head_seq   BIGINT;
    head_hash  TEXT;
    v_at       TIMESTAMPTZ := clock_timestamp();
    v_body     TEXT;
    v_hash     TEXT;
    v_invoice  JSONB;
    v_local    TIMESTAMP;
    v_offset   TEXT;
    h          BYTEA;
    v_idx      BIGINT;
    v_level    INT;
    e_project TEXT[] := '{}'; e_index BIGINT[] := '{}'; e_chain TEXT[] := '{}';
    e_seq BIGINT[] := '{}'; e_sequence BIGINT[] := '{}'; e_period TEXT[] := '{}';
    e_number BIGINT[] := '{}'; e_id TEXT[] := '{}'; e_event TEXT[] := '{}';
    e_body TEXT[] := '{}'; e_prev TEXT[] := '{}'; e_hash TEXT[] := '{}'; e_note TEXT[] := '{}';
    n_project TEXT[] := '{}'; n_level SMALLINT[] := '{}'; n_idx BIGINT[] := '{}';
    n_hash BYTEA[] := '{}';
BEGIN
    v_at_json := to_json(to_char(v_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'))::text;
    FOR i IN 1..n LOOP
        IF v_project IS DISTINCT FROM projects[i] THEN
            IF v_project IS NOT NULL THEN
                UPDATE register_logs SET size = v_size, frontier = v_frontier
                 WHERE project = v_project;
            END IF;
            v_project := projects[i];
            SELECT l.size, l.frontier INTO v_size, v_frontier
              FROM register_logs l WHERE l.project = v_project FOR UPDATE;
            IF NOT FOUND THEN
                INSERT INTO register_logs (project) VALUES (v_project) ON CONFLICT DO NOTHING;
                SELECT l.size, l.frontier INTO v_size, v_frontier
                  FROM register_logs l WHERE l.project = v_project FOR UPDATE;
            END IF;
            head_chain := NULL;
        END IF;
        IF v_seq_id IS DISTINCT FROM sequence_ids[i] THEN
            SELECT s.project, s.doc_type, s.register, s.register_issuer, s.timezone
              INTO v_seq FROM sequences s WHERE s.id = sequence_ids[i];
            v_seq_id := sequence_ids[i];
            v_tail := ',"type":' || to_json(v_seq.doc_type::text)::text || '}';
        END IF;
        v_chain := CASE v_seq.register WHEN 'verifactu' THEN 'v:' || v_seq.register_issuer
                                       ELSE 's:' || sequence_ids[i] END;
        IF head_chain IS DISTINCT FROM v_chain THEN
            head_chain := v_chain;
            SELECT r.seq, r.hash INTO head_seq, head_hash FROM register_entries r
             WHERE r.project = v_project AND r.chain = v_chain
             ORDER BY r.seq DESC LIMIT 1;
            IF NOT FOUND THEN
                head_seq := 0;
                head_hash := '';
            END IF;
        END IF;
        IF v_seq.register = 'verifactu' THEN
            SELECT o.invoice INTO v_invoice FROM id_outbox o
             WHERE o.sequence_id = sequence_ids[i] AND o.period = periods[i]
               AND o.seq = numbers[i];
            v_local := v_at AT TIME ZONE v_seq.timezone;
            v_offset := CASE WHEN v_local < (v_at AT TIME ZONE 'UTC')
                             THEN '-' || to_char((v_at AT TIME ZONE 'UTC') - v_local, 'HH24:MI')
                             ELSE '+' || to_char(v_local - (v_at AT TIME ZONE 'UTC'), 'HH24:MI') END;
            IF events[i] = 'attached' THEN
                v_body := 'IDEmisorFactura=' || v_seq.register_issuer
                       || '&NumSerieFactura=' || ids[i]
                       || '&FechaExpedicionFactura=' || (v_invoice->>'date')
                       || '&TipoFactura=' || (v_invoice->>'type')
                       || '&CuotaTotal=' || (v_invoice->>'tax_total')
                       || '&ImporteTotal=' || (v_invoice->>'total')
                       || '&Huella=' || head_hash
                       || '&FechaHoraHusoGenRegistro='
                       || to_char(v_local, 'YYYY-MM-DD"T"HH24:MI:SS') || v_offset;
            ELSE
                v_body := 'IDEmisorFacturaAnulada=' || v_seq.register_issuer
                       || '&NumSerieFacturaAnulada=' || ids[i]
                       || '&FechaExpedicionFacturaAnulada=' || (v_invoice->>'date')
                       || '&Huella=' || head_hash
                       || '&FechaHoraHusoGenRegistro='
                       || to_char(v_local, 'YYYY-MM-DD"T"HH24:MI:SS') || v_offset;
            END IF;
            IF v_body IS NULL THEN
                RAISE EXCEPTION 'VERI*FACTU number % carries no invoice', ids[i];
            END IF;
            v_bytes := convert_to(v_body, 'UTF8');
            v_hash := upper(encode(sha256(v_bytes), 'hex'));
        ELSE
            -- RFC 8785: keys in order, no spaces, strings as to_json writes
            -- them (the escapes RFC 8785 asks for); the event and hashes are
            -- fixed words and hex.
            v_body := '{"at":' || v_at_json
                   || ',"event":"' || events[i]
                   || '","id":' || to_json(ids[i])::text
                   || ',"number":' || numbers[i]
                   || ',"period":' || to_json(periods[i])::text
                   || ',"prev":"' || head_hash
                   || '","project":' || to_json(v_seq.project::text)::text
                   || CASE WHEN reasons[i] IS NULL THEN ''
                           ELSE ',"reason":' || to_json(reasons[i])::text END
                   || ',"seq":' || (head_seq + 1)
                   || v_tail;
            v_bytes := convert_to(v_body, 'UTF8');
            v_hash := encode(sha256(v_bytes), 'hex');
        END IF;
        e_project := e_project || v_project; e_index := e_index || v_size;
        e_chain := e_chain || v_chain; e_seq := e_seq || (head_seq + 1);
        e_sequence := e_sequence || sequence_ids[i]; e_period := e_period || periods[i];
        e_number := e_number || numbers[i]; e_id := e_id || ids[i];
        e_event := e_event || events[i]; e_body := e_body || v_body;
        e_prev := e_prev || head_hash; e_hash := e_hash || v_hash; e_note := e_note || reasons[i];
        head_seq := head_seq + 1;
        head_hash := v_hash;
        -- RFC 6962: the leaf, then every perfect subtree it completes
        -- (leaves themselves are not stored: an entry's body is its leaf).
        h := sha256('\x00'::bytea || v_bytes);
        v_idx := v_size;
        v_level := 0;
        WHILE v_idx % 2 = 1 LOOP
            h := sha256('\x01'::bytea || v_frontier[v_level + 1] || h);
            v_frontier[v_level + 1] := NULL;
            v_idx := v_idx / 2;
            v_level := v_level + 1;
            n_project := n_project || v_project; n_level := n_level || v_level::smallint;
            n_idx := n_idx || v_idx; n_hash := n_hash || h;
        END LOOP;
        v_frontier[v_level + 1] := h;
        v_size := v_size + 1;
    END LOOP;
    IF v_project IS NULL THEN
        RETURN;
    END IF;
    UPDATE register_logs SET size = v_size, frontier = v_frontier WHERE project = v_project;
    INSERT INTO register_entries (project, log_index, chain, seq, sequence_id, period, number,
                                  id, event, body, prev_hash, hash, at, note)
    SELECT u.p, u.li, u.c, u.s, u.sq, u.pe, u.nu, u.id, u.ev, u.bo, u.pr, u.ha, v_at, u.no
      FROM UNNEST(e_project, e_index, e_chain, e_seq, e_sequence, e_period, e_number, e_id,
                  e_event, e_body, e_prev, e_hash, e_note)
           AS u(p, li, c, s, sq, pe, nu, id, ev, bo, pr, ha, no);
    INSERT INTO register_nodes (project, level, idx, hash)
    SELECT * FROM UNNEST(n_project, n_level, n_idx, n_hash);
END $$;

-- The outbox's insert trigger of 0015, with the registers' appends: a
-- register's documents, every number attached, in the insert's commit.
-- One trigger and one function call per insert statement, as before
-- registers; an installation without any register pays one index probe.
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
        PERFORM pg_notify('idpool_deliveries', '');
    END IF;
    IF EXISTS (SELECT 1 FROM inserted WHERE NOT routed) THEN
        PERFORM pg_notify('idpool_outbox',
            (SELECT string_agg(DISTINCT tenant_code, ',') FROM inserted WHERE NOT routed));
    END IF;
    RETURN NULL;
END $$;

-- A register's voids and expiries, in the commit that records them.
CREATE FUNCTION idpool_reservations_registered() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM sequences WHERE register IS NOT NULL) THEN
        RETURN NULL;
    END IF;
    PERFORM idpool_register_append(array_agg(r.project), array_agg(r.sequence_id),
                                   array_agg(r.period), array_agg(r.seq), array_agg(r.id),
                                   array_agg(r.event), array_agg(r.reason))
      FROM (SELECT s.project, n.sequence_id, n.period, n.seq, n.id,
                   CASE n.status WHEN 'voided' THEN 'voided' ELSE 'expired' END AS event,
                   CASE n.status WHEN 'voided' THEN n.reason END AS reason
              FROM new_rows n
              JOIN old_rows o USING (sequence_id, period, seq)
              JOIN sequences s ON s.id = n.sequence_id AND s.register IS NOT NULL
             WHERE o.status = 'reserved' AND n.status IN ('voided', 'reservation_expired')
             ORDER BY s.project, n.sequence_id, n.period, n.seq) r
    HAVING count(*) > 0;
    RETURN NULL;
END $$;
CREATE TRIGGER gapless_reservations_registered AFTER UPDATE ON gapless_reservations
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION idpool_reservations_registered();

-- A VERI*FACTU number's anulación (the document and its alta stay), with
-- the caller's reason kept beside it; its time. NULL when the number
-- carries no document of the sequence, or was annulled already.
CREATE FUNCTION idpool_register_annul(p_sequence_id BIGINT, p_id TEXT, p_reason TEXT)
RETURNS TIMESTAMPTZ LANGUAGE plpgsql AS $$
DECLARE
    v_doc RECORD;
    v_at  TIMESTAMPTZ;
BEGIN
    SELECT o.tenant_code, o.period, o.seq INTO v_doc FROM id_outbox o
     WHERE o.document_id = p_id AND o.sequence_id = p_sequence_id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- Under the log's lock: two annulments of one number at once find
    -- each other.
    PERFORM 1 FROM register_logs WHERE project = v_doc.tenant_code FOR UPDATE;
    IF EXISTS (SELECT 1 FROM register_entries r
                WHERE r.sequence_id = p_sequence_id AND r.period = v_doc.period
                  AND r.number = v_doc.seq AND r.event = 'annulled') THEN
        RETURN NULL;
    END IF;
    PERFORM idpool_register_append(ARRAY[v_doc.tenant_code], ARRAY[p_sequence_id],
        ARRAY[v_doc.period], ARRAY[v_doc.seq], ARRAY[p_id], ARRAY['annulled'], ARRAY[p_reason]);
    SELECT r.at INTO v_at FROM register_entries r
     WHERE r.sequence_id = p_sequence_id AND r.period = v_doc.period
       AND r.number = v_doc.seq AND r.event = 'annulled';
    RETURN v_at;
END $$;
