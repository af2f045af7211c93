-- Gapless sequences (SPEC "Gapless sequences"): numbers taken from the
-- counter inside the transaction that writes their documents; reservations
-- of POST /ids confirmed by a document or voided with a reason.

ALTER TABLE sequences ADD COLUMN numbering TEXT NOT NULL DEFAULT 'pooled'
    CHECK (numbering IN ('pooled', 'gapless'));

-- One row per number reserved by POST /ids on a gapless sequence, kept for
-- good: it is the record an auditor reads for every number that is not a
-- document (voided with the caller's reason, or expired).
CREATE TABLE gapless_reservations (
    sequence_id    BIGINT NOT NULL,
    period         TEXT NOT NULL,
    seq            BIGINT NOT NULL,
    id             TEXT NOT NULL,
    reserved_at    TIMESTAMPTZ NOT NULL,
    reserved_until TIMESTAMPTZ NOT NULL,
    status         TEXT NOT NULL DEFAULT 'reserved'
        CHECK (status IN ('reserved', 'confirmed', 'voided', 'reservation_expired')),
    reason         TEXT,
    voided_at      TIMESTAMPTZ,
    PRIMARY KEY (sequence_id, period, seq),
    CHECK ((status IN ('voided', 'reservation_expired')) = (voided_at IS NOT NULL))
);

-- The expiry sweep reads only reservations still open, by deadline.
CREATE INDEX gapless_reservations_open ON gapless_reservations (reserved_until)
    WHERE status = 'reserved';
-- A gapless sequence's gaps are its voids, listed in (period, number) order.
CREATE INDEX gapless_reservations_voids ON gapless_reservations (sequence_id, period, seq)
    WHERE status IN ('voided', 'reservation_expired');

-- How far reconciliation has checked each period of a gapless sequence
-- (every number below is a document or a reservation).
CREATE TABLE gapless_checkpoints (
    sequence_id   BIGINT NOT NULL,
    period        TEXT NOT NULL,
    checked_below BIGINT NOT NULL,
    PRIMARY KEY (sequence_id, period)
);
