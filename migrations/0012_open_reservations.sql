-- A gapless sequence holds at most MAX_OPEN_RESERVATIONS reservations
-- neither confirmed nor voided; counting them reads this index only.
CREATE INDEX gapless_reservations_open_by_sequence ON gapless_reservations (sequence_id)
    WHERE status = 'reserved';
