-- Every event accounted for (decision record 0015): an event QStash accepted stays "in flight" until its outcome
-- is recorded (delivery evidence, the consumer's dedupe row, or a dead letter). The relay's reconciler closes what
-- callbacks leave open, and an event has at most one unresolved dead letter.

-- How often the reconciler republished the event because QStash had no record of it (part of the QStash
-- deduplication id, like redrive_count), and when it last found QStash still retrying it.
ALTER TABLE outbox ADD COLUMN republish_count integer NOT NULL DEFAULT 0;
ALTER TABLE outbox ADD COLUMN reconciled_at timestamptz;

-- In flight: accepted by QStash, no outcome yet. Small in a healthy pipeline (the relay marks applied events
-- delivered within a minute); `outbox status` and the reconciler read only this index.
CREATE INDEX outbox_inflight_idx ON outbox (dispatched_at, id)
    WHERE dispatched_at IS NOT NULL AND delivered_at IS NULL AND dead_lettered_at IS NULL;

-- Later failures of an event merge into its one unresolved dead letter: their natural ids (so a retried callback
-- or the reconciler's lookup of the same DLQ entry stays idempotent) and how many merged.
ALTER TABLE dead_letters ADD COLUMN merged_ids text[] NOT NULL DEFAULT '{}';
ALTER TABLE dead_letters ADD COLUMN merged_count integer NOT NULL DEFAULT 0;

-- What the reconciler did, summed over every relay invocation (one row; `outbox status` shows it).
CREATE TABLE outbox_accounting (
    id                 boolean     PRIMARY KEY DEFAULT true CHECK (id),
    swept_applied      bigint      NOT NULL DEFAULT 0,  -- in-flight events found applied by their dedupe row
    recorded_from_dlq  bigint      NOT NULL DEFAULT 0,  -- dead letters recorded from QStash's DLQ
    republished        bigint      NOT NULL DEFAULT 0,  -- events unknown to QStash, published again
    still_retrying     bigint      NOT NULL DEFAULT 0,  -- lookups that found QStash still retrying
    unaccounted_dead   bigint      NOT NULL DEFAULT 0,  -- events dead-lettered because nothing could account for them
    lookup_failures    bigint      NOT NULL DEFAULT 0,  -- management API calls that failed (incl. 429)
    last_run_at        timestamptz,
    last_error         text
);
INSERT INTO outbox_accounting (id) VALUES (true);
