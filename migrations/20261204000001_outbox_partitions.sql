-- The outbox becomes a table partitioned by ranges of its id (decision record 0067): retention drops a whole
-- partition once every row in it is done, instead of deleting row by row, so a long transaction that pinned the
-- xmin horizon leaves no bloat behind once the partitions it saw are past retention.
--
-- Range of `id`, not of time: `id` stays the primary key (the partition key must be part of it), and dead
-- letters, ordered keys and the consumer's dedupe rows keep referring to events by `id`. The relay's housekeeping
-- creates partitions ahead of the id sequence and drops old ones (shared/src/relay/partitions.rs); a DEFAULT
-- partition takes whatever no range partition covers, so an insert never fails for want of a partition.
--
-- An existing outbox becomes the first partition as it is (FROM MINVALUE up to the next id): no copy. The
-- migration holds an exclusive lock on `outbox` while it checks that partition's bound (one scan of the rows the
-- retention window keeps) and builds the one index that changes (below): producers and relays wait for that long,
-- nothing fails.

LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE;

ALTER TABLE outbox RENAME TO outbox_legacy;
ALTER INDEX outbox_pkey RENAME TO outbox_legacy_pkey;
ALTER INDEX outbox_claim_idx RENAME TO outbox_legacy_claim_idx;
ALTER INDEX outbox_pending_created_idx RENAME TO outbox_legacy_pending_created_idx;
ALTER INDEX outbox_dispatched_brin RENAME TO outbox_legacy_dispatched_brin;
ALTER INDEX outbox_inflight_idx RENAME TO outbox_legacy_inflight_idx;
-- A unique index on a partitioned table must contain the partition key, so (topic, partition_key, seq) is no
-- longer unique by constraint across partitions. It never was the mechanism: `outbox_sequences` hands out each
-- number once (its row lock, held to the producer's commit); the index stays, for finding an ordered key's head.
ALTER INDEX outbox_key_seq_idx RENAME TO outbox_legacy_key_seq_unique;

CREATE TABLE outbox (LIKE outbox_legacy INCLUDING DEFAULTS INCLUDING CONSTRAINTS) PARTITION BY RANGE (id);
ALTER TABLE outbox ADD PRIMARY KEY (id);
CREATE INDEX outbox_claim_idx ON outbox (available_at, id)
    WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL AND seq IS NULL;
CREATE INDEX outbox_key_seq_idx ON outbox (topic, partition_key, seq) WHERE seq IS NOT NULL;
CREATE INDEX outbox_pending_created_idx ON outbox (created_at)
    WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL;
CREATE INDEX outbox_dispatched_brin ON outbox USING brin (dispatched_at);
CREATE INDEX outbox_inflight_idx ON outbox (dispatched_at, id)
    WHERE dispatched_at IS NOT NULL AND delivered_at IS NULL AND dead_lettered_at IS NULL;

-- The id sequence moves from the old table to the partitioned one, continuing where it was.
DO $$
DECLARE
    next_id bigint;
BEGIN
    SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('outbox_legacy', 'id')::regclass), 0) + 1
      INTO next_id;
    ALTER TABLE outbox_legacy ALTER COLUMN id DROP IDENTITY;
    EXECUTE format('ALTER TABLE outbox ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (START WITH %s)', next_id);
    EXECUTE format('ALTER TABLE outbox ATTACH PARTITION outbox_legacy FOR VALUES FROM (MINVALUE) TO (%s)', next_id);
END
$$;
-- The matching indexes above were attached as they are; the unique one is not needed once the non-unique one
-- was built beside it.
DROP INDEX outbox_legacy_key_seq_unique;

CREATE TABLE outbox_default PARTITION OF outbox DEFAULT WITH (fillfactor = 85);

-- Dead-lettered events, so that a partition's drop finds every row it must keep through an index (pending and in
-- flight ones have theirs above): the drop holds the outbox's lock while it reads them. Dead rows are few.
CREATE INDEX outbox_dead_idx ON outbox (id) WHERE dead_lettered_at IS NOT NULL;
