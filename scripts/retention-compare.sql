-- Retention by DELETE beside retention by DROP of a partition: what each costs to remove the same rows.
-- Run with: psql -v rows=600000 -f scripts/retention-compare.sql DATABASE_URL   (a scratch database: it creates and
-- drops its own tables). Decision record 0066 quotes its output. Timings are psql's \timing; the WAL figure is the
-- difference of pg_current_wal_lsn() around each removal; the dead tuples are what vacuum must then clean.
\set ON_ERROR_STOP on
\timing on
DROP TABLE IF EXISTS rc_plain, rc_parted;
-- The outbox's shape: the same columns that matter for row width, a primary key and the claim index.
CREATE TABLE rc_plain (
    id bigserial PRIMARY KEY, topic text NOT NULL, partition_key text, payload jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(), available_at timestamptz NOT NULL DEFAULT now(),
    dispatched_at timestamptz, delivered_at timestamptz, locked_until timestamptz, attempts int NOT NULL DEFAULT 0);
CREATE INDEX ON rc_plain (available_at, id) WHERE dispatched_at IS NULL;
CREATE INDEX ON rc_plain USING brin (dispatched_at);
CREATE TABLE rc_parted (
    id bigserial, topic text NOT NULL, partition_key text, payload jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(), available_at timestamptz NOT NULL DEFAULT now(),
    dispatched_at timestamptz, delivered_at timestamptz, locked_until timestamptz, attempts int NOT NULL DEFAULT 0,
    PRIMARY KEY (id, created_at)) PARTITION BY RANGE (created_at);
CREATE INDEX ON rc_parted (available_at, id) WHERE dispatched_at IS NULL;
CREATE TABLE rc_parted_old PARTITION OF rc_parted FOR VALUES FROM ('2000-01-01') TO ('2001-01-01');
CREATE TABLE rc_parted_now PARTITION OF rc_parted FOR VALUES FROM ('2001-01-01') TO (MAXVALUE);
-- :rows done events in each, as the soak's payloads (about 40 bytes of JSON).
INSERT INTO rc_plain (topic, partition_key, payload, created_at, dispatched_at, delivered_at)
SELECT 'soak_unordered', 'u' || (g % 10000), jsonb_build_object('n', g, 'poison', false),
       '2000-06-01'::timestamptz, '2000-06-01'::timestamptz, '2000-06-01'::timestamptz
FROM generate_series(1, :rows) g;
INSERT INTO rc_parted (topic, partition_key, payload, created_at, dispatched_at, delivered_at)
SELECT 'soak_unordered', 'u' || (g % 10000), jsonb_build_object('n', g, 'poison', false),
       '2000-06-01'::timestamptz, '2000-06-01'::timestamptz, '2000-06-01'::timestamptz
FROM generate_series(1, :rows) g;
CHECKPOINT;
VACUUM ANALYZE rc_plain, rc_parted;
SELECT pg_size_pretty(pg_total_relation_size('rc_plain')) AS plain_size,
       pg_size_pretty(pg_total_relation_size('rc_parted_old')) AS partition_size;

-- 1. DELETE in the housekeeping's batches of 1,000 (one statement per batch, as prune_outbox_batch runs them).
SELECT pg_current_wal_lsn() AS lsn0 \gset
DO $$
DECLARE n int;
BEGIN
  LOOP
    DELETE FROM rc_plain WHERE id IN (
      SELECT id FROM rc_plain WHERE dispatched_at < now() - interval '1 hour' AND delivered_at IS NOT NULL
      LIMIT 1000 FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS n = ROW_COUNT;
    COMMIT;
    EXIT WHEN n < 1000;
  END LOOP;
END $$;
SELECT pg_size_pretty(pg_current_wal_lsn() - :'lsn0') AS delete_wal,
       (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'rc_plain') AS delete_dead_tuples,
       pg_size_pretty(pg_total_relation_size('rc_plain')) AS size_after_delete;
-- Then what autovacuum has to do about it.
SELECT pg_current_wal_lsn() AS lsn1 \gset
VACUUM rc_plain;
SELECT pg_size_pretty(pg_current_wal_lsn() - :'lsn1') AS vacuum_wal,
       pg_size_pretty(pg_total_relation_size('rc_plain')) AS size_after_vacuum;

-- 2. The same rows as a partition: detach it and drop it.
SELECT pg_current_wal_lsn() AS lsn2 \gset
ALTER TABLE rc_parted DETACH PARTITION rc_parted_old;
DROP TABLE rc_parted_old;
SELECT pg_size_pretty(pg_current_wal_lsn() - :'lsn2') AS drop_wal,
       pg_size_pretty(pg_total_relation_size('rc_parted')) AS parted_size_after_drop;
DROP TABLE rc_plain, rc_parted;
