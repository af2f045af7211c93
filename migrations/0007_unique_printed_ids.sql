-- A printed ID is never printed twice: not by two sequences of a project,
-- not by a sequence before and after a forced change of its definition.

-- Bumped by every change of how IDs read (format, layout, reset, timezone).
-- Counter reservations name the version they were placed under, so an
-- instance still holding the old definition cannot take numbers for it.
ALTER TABLE sequences ADD COLUMN identity_version INTEGER NOT NULL DEFAULT 1;

-- After a forced change of `reset`, counters of the periods that began
-- before `floor_until` start at `counter_floor`, above every number taken
-- under the old definition: the same format would otherwise print the old
-- IDs again from a counter that starts over.
ALTER TABLE sequences ADD COLUMN counter_floor BIGINT;
ALTER TABLE sequences ADD COLUMN floor_until TIMESTAMPTZ;

-- Formats a sequence printed IDs with before a forced change. A new format
-- must not be able to print what any of them printed.
CREATE TABLE sequence_formats (
    sequence_id BIGINT NOT NULL REFERENCES sequences (id),
    layout      TEXT NOT NULL,
    format      TEXT NOT NULL,
    retired_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (sequence_id, layout, format)
);
