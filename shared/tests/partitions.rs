//! Retention by partition (`outbox::internals::partitions`, decision record 0067): partitions are made ahead of the id
//! sequence, a partition whose rows are done is dropped whole, and every row that is not done (pending, leased, in
//! flight, dead-lettered, within the window) survives the drop unchanged. A transaction holding the outbox makes
//! maintenance wait for the next pass, never the producers.

use std::time::{Duration, Instant};

use outbox::db::{Db, Statements};
use outbox::internals::partitions::{self, PartitionSettings};
use outbox::subscribers::{self, Start};
use sqlx::PgPool;

fn settings(min_rows: i64) -> PartitionSettings {
    PartitionSettings {
        min_rows,
        max_rows: min_rows,
        ..PartitionSettings::new(Duration::from_secs(3600), Duration::from_secs(60))
    }
}

async fn partitions_of(pool: &PgPool) -> Vec<partitions::Partition> {
    let mut c = pool.acquire().await.unwrap();
    partitions::list(&mut c).await.unwrap()
}

/// Every row, as JSON, by id.
async fn rows(pool: &PgPool) -> Vec<(i64, serde_json::Value)> {
    sqlx::query_as("SELECT id, to_jsonb(o) FROM outbox o ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn insert_audit(pool: &PgPool, n: i64) {
    sqlx::query(
        "INSERT INTO outbox (topic, partition_key, payload) \
         SELECT 'audit', 'k' || (g % 10), jsonb_build_object('n', g) FROM generate_series(1, $1) g",
    )
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

/// Every event written two hours ago, dispatched and delivered then.
async fn all_done_two_hours_ago(pool: &PgPool) {
    sqlx::query(
        "UPDATE outbox SET created_at = now() - interval '2 hours', \
                dispatched_at = now() - interval '2 hours', delivered_at = now() - interval '2 hours'",
    )
    .execute(pool)
    .await
    .unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn partitions_are_made_ahead_of_the_id_sequence_and_new_events_land_in_them(pool: PgPool) {
    let db = Db::new(pool.clone(), Statements::Prepared);
    let before = partitions_of(&pool).await;
    assert_eq!(
        before.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
        ["outbox_legacy", "outbox_default"]
    );
    let r = partitions::maintain(&db, settings(1000)).await;
    assert_eq!(r.error, None);
    assert!(r.created >= 1, "{r:?}");
    insert_audit(&pool, 800).await;
    let r = partitions::maintain(&db, settings(1000)).await;
    assert_eq!(r.error, None);
    insert_audit(&pool, 800).await;
    // Ahead again: the ranges now reach past the last id by at least one partition.
    let r = partitions::maintain(&db, settings(1000)).await;
    assert_eq!(r.error, None);
    let parts = partitions_of(&pool).await;
    let covered = parts.iter().filter_map(|p| p.hi).max().unwrap();
    assert!(covered > 1600 + 1000, "{parts:?}");
    let in_default: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_default")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(in_default, 0, "new events went to DEFAULT: {parts:?}");
    // A second maintenance with nothing to do changes nothing.
    let again = partitions::maintain(&db, settings(1000)).await;
    assert_eq!((again.created, again.dropped), (0, 0), "{again:?}");
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_done_partition_is_dropped_and_every_row_not_done_survives_it_unchanged(pool: PgPool) {
    let db = Db::new(pool.clone(), Statements::Prepared);
    // Three partitions' worth, each made ahead before its events come.
    for _ in 0..3 {
        partitions::maintain(&db, settings(1000)).await;
        insert_audit(&pool, 1000).await;
    }
    // Everything two hours old, dispatched and delivered; then the rows that must stay.
    all_done_two_hours_ago(&pool).await;
    sqlx::raw_sql(
        "UPDATE outbox SET dispatched_at = NULL, delivered_at = NULL WHERE id IN (10, 1500);  \
         UPDATE outbox SET dispatched_at = NULL, delivered_at = NULL, attempts = 2, lease_token = 77, \
                locked_until = now() + interval '1 minute', available_at = now() + interval '1 minute' WHERE id = 20; \
         UPDATE outbox SET delivered_at = NULL, qstash_message_id = 'msg_inflight' WHERE id IN (30, 2500); \
         UPDATE outbox SET dead_lettered_at = now() - interval '2 hours', last_error = 'poison' WHERE id = 40; \
         UPDATE outbox SET dispatched_at = now(), delivered_at = now() WHERE id = 50",
    )
    .execute(&pool)
    .await
    .unwrap();
    let kept = [10i64, 20, 30, 40, 50, 1500, 2500];
    let before: Vec<_> = rows(&pool)
        .await
        .into_iter()
        .filter(|(id, _)| kept.contains(id))
        .collect();
    assert_eq!(before.len(), kept.len());
    let parts_before = partitions_of(&pool).await;
    assert!(
        parts_before.iter().filter(|p| p.lo.is_some()).count() >= 3,
        "{parts_before:?}"
    );
    // The sequence moves past the last of them (a producer's later events), so all three are full.
    let mut r = partitions::maintain(&db, settings(1000)).await;
    insert_audit(&pool, 10).await;
    r.add(&partitions::maintain(&db, settings(1000)).await);
    assert_eq!(r.error, None);
    assert!(r.dropped >= 3, "{r:?} {parts_before:?}");
    assert_eq!(r.survivors_moved, kept.len() as u64, "{r:?}");
    let in_default: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_default")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(in_default, kept.len() as i64);
    let after = rows(&pool).await;
    let survivors: Vec<_> = after
        .iter()
        .filter(|(id, _)| *id <= 3000)
        .cloned()
        .collect();
    assert_eq!(
        survivors, before,
        "the rows not done are exactly what is left, column for column"
    );
    let homes: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT tableoid::regclass::text FROM outbox WHERE id <= 3000")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(homes, ["outbox_default"]);
    // The relay's fenced writes still find a survivor where it now lives.
    let n =
        sqlx::query("UPDATE outbox SET dispatched_at = now() WHERE id = 20 AND lease_token = 77")
            .execute(&pool)
            .await
            .unwrap()
            .rows_affected();
    assert_eq!(n, 1);
    // The 10 later events are untouched.
    assert_eq!(after.iter().filter(|(id, _)| *id > 3000).count(), 10);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_partition_is_kept_while_its_newest_event_is_within_retention_or_too_much_is_not_done(
    pool: PgPool,
) {
    let db = Db::new(pool.clone(), Statements::Prepared);
    partitions::maintain(&db, settings(1000)).await;
    insert_audit(&pool, 2000).await;
    all_done_two_hours_ago(&pool).await;
    // The first partition's newest event is recent; the second one's events are mostly pending.
    let parts = partitions_of(&pool).await;
    let first = parts.iter().find(|p| p.lo.is_some()).unwrap().clone();
    sqlx::query("UPDATE outbox SET created_at = now() WHERE id = $1")
        .bind(first.hi.unwrap() - 1)
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE outbox SET dispatched_at = NULL, delivered_at = NULL WHERE id >= $1 AND id % 2 = 0",
    )
    .bind(first.hi.unwrap())
    .execute(&pool)
    .await
    .unwrap();
    partitions::maintain(&db, settings(1000)).await;
    insert_audit(&pool, 10).await;
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    let r = partitions::maintain(
        &db,
        PartitionSettings {
            max_survivors: 100,
            ..settings(1000)
        },
    )
    .await;
    assert_eq!((r.dropped, r.error.as_deref()), (0, None), "{r:?}");
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(after, total);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_transaction_holding_the_outbox_makes_maintenance_wait_not_the_producers(pool: PgPool) {
    let db = Db::new(pool.clone(), Statements::Prepared);
    partitions::maintain(&db, settings(1000)).await;
    insert_audit(&pool, 2500).await;
    all_done_two_hours_ago(&pool).await;
    // A report that read the outbox and stays open.
    let mut reader = pool.begin().await.unwrap();
    sqlx::query("SELECT count(*) FROM outbox")
        .execute(&mut *reader)
        .await
        .unwrap();
    let started = Instant::now();
    let r = partitions::maintain(&db, settings(1000)).await;
    assert_eq!(
        (r.dropped, r.error.as_deref()),
        (0, None),
        "{r:?} {:?}",
        partitions_of(&pool).await
    );
    assert!(r.busy >= 1, "{r:?}");
    // Producers were never queued behind the DDL for more than the lock timeout.
    insert_audit(&pool, 1).await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    reader.rollback().await.unwrap();
    let r = partitions::maintain(&db, settings(1000)).await;
    assert_eq!(r.error, None);
    assert!(r.dropped >= 1, "{r:?}");
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_bloated_default_partition_is_recycled_keeping_what_is_not_done(pool: PgPool) {
    let db = Db::new(pool.clone(), Statements::Prepared);
    // No range partitions yet: everything is in DEFAULT.
    sqlx::query(
        "INSERT INTO outbox (topic, partition_key, payload, created_at, dispatched_at, delivered_at) \
         SELECT 'audit', 'k', '{}'::jsonb, now() - interval '2 hours', now() - interval '2 hours', \
                now() - interval '2 hours' FROM generate_series(1, 5000)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("UPDATE outbox SET delivered_at = NULL WHERE id = 7")
        .execute(&pool)
        .await
        .unwrap();
    let old: i64 = sqlx::query_scalar("SELECT 'outbox_default'::regclass::oid::int8")
        .fetch_one(&pool)
        .await
        .unwrap();
    let kept = rows(&pool).await.into_iter().find(|(id, _)| *id == 7);
    let r = partitions::maintain(
        &db,
        PartitionSettings {
            default_recycle_bytes: 1,
            ..settings(1000)
        },
    )
    .await;
    assert_eq!(r.error, None);
    // (The first partition, empty on a new database, goes too.)
    assert_eq!(r.survivors_moved, 1, "{r:?}");
    let new: i64 = sqlx::query_scalar("SELECT 'outbox_default'::regclass::oid::int8")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_ne!(old, new, "DEFAULT was not replaced");
    assert_eq!(rows(&pool).await.into_iter().next(), kept);
}

/// Row addresses (`ctid`) repeat from one partition to the next: a claim that found its rows by address would
/// lease rows of another partition that it never selected (dispatched ones, ordered heads).
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn claims_take_exactly_the_rows_they_selected_across_partitions(pool: PgPool) {
    use outbox::config::DeliveryBatching;
    use outbox::internals::claim::ClaimStatements;
    let db = Db::new(pool.clone(), Statements::Prepared);
    let made = partitions::maintain(&db, settings(1000)).await;
    assert_eq!((made.created, made.error), (1, None));
    // DEFAULT holds 50 done events and 50 ordered ones (5 keys × 10) whose keys are not due yet (ids past the
    // range partition's, as after an incident).
    sqlx::query(
        "INSERT INTO outbox (id, topic, partition_key, payload, dispatched_at, delivered_at) OVERRIDING SYSTEM VALUE \
         SELECT 100000 + g, 'audit', 'd', '{}'::jsonb, now(), now() FROM generate_series(1, 50) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO outbox (id, topic, partition_key, seq, payload) OVERRIDING SYSTEM VALUE \
         SELECT 100100 + k * 10 + s, 'orders', 'c' || k, s, '{}'::jsonb \
         FROM generate_series(1, 5) k, generate_series(1, 10) s",
    )
    .execute(&pool)
    .await
    .unwrap();
    // The range partition holds 20 pending unordered events and 3 ordered keys' events, at the same addresses.
    sqlx::query(
        "INSERT INTO outbox (topic, partition_key, payload) \
         SELECT 'audit', 'p', '{}'::jsonb FROM generate_series(1, 20)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO outbox (topic, partition_key, seq, payload) \
         SELECT 'orders', 'r' || k, s, '{}'::jsonb FROM generate_series(1, 3) k, generate_series(1, 4) s",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO outbox_keys (topic, partition_key, done_seq) \
         SELECT 'orders', 'r' || k, 0 FROM generate_series(1, 3) k",
    )
    .execute(&pool)
    .await
    .unwrap();
    let shared_addresses: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_default d JOIN outbox o ON o.ctid = d.ctid AND o.tableoid <> d.tableoid",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(shared_addresses >= 20, "{shared_addresses}");

    let mut conn = pool.acquire().await.unwrap();
    let claims = ClaimStatements::new(500, Statements::Prepared);
    let unordered = claims.claim_unordered(&mut conn, 60.0).await.unwrap();
    assert_eq!(unordered.len(), 20);
    assert!(unordered.iter().all(|e| e.partition_key.as_str() == "p"));
    let runs =
        ClaimStatements::new(500, Statements::Prepared).with_delivery_batching(&DeliveryBatching {
            default_n: 1,
            topics: vec![("orders".into(), 4)],
            max_message_bytes: 1_000_000,
        });
    let ordered = runs.claim_ordered(&mut conn, 60.0).await.unwrap();
    assert_eq!(ordered.len(), 12, "{ordered:?}");
    assert!(
        ordered
            .iter()
            .all(|e| e.partition_key.as_str().starts_with('r'))
    );
    let touched: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_default WHERE attempts > 0")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        touched, 0,
        "rows in DEFAULT were leased by a claim that never selected them"
    );
}

/// An existing database upgrades in place: the outbox as it was becomes the first partition (no copy), every row
/// in every state keeps its id and columns, the ids go on from where they were, and the relay's statements work on
/// rows from before and after.
#[sqlx::test(migrations = false)]
async fn an_existing_outbox_with_events_in_flight_becomes_the_first_partition_unchanged(
    pool: PgPool,
) {
    const PARTITIONED: i64 = 20261204000001;
    let before = outbox_testkit::db::library_migrations(|v| v < PARTITIONED);
    before.run(&pool).await.unwrap();
    let relkind: String =
        sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE relname = 'outbox'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(relkind, "r", "the previous schema");
    // Events in every state: pending, leased, in flight, delivered, dead-lettered, an ordered key mid-way.
    insert_audit(&pool, 200).await;
    sqlx::raw_sql(
        "UPDATE outbox SET dispatched_at = now(), delivered_at = now() WHERE id <= 100; \
         UPDATE outbox SET dispatched_at = now(), qstash_message_id = 'msg_' || id WHERE id BETWEEN 101 AND 120; \
         UPDATE outbox SET attempts = 1, lease_token = 5, locked_until = now() + interval '1 minute', \
                available_at = now() + interval '1 minute' WHERE id BETWEEN 121 AND 130; \
         UPDATE outbox SET dead_lettered_at = now(), last_error = 'poison' WHERE id = 131; \
         INSERT INTO outbox (topic, partition_key, seq, payload) \
           SELECT 'orders', 'c1', s, '{}'::jsonb FROM generate_series(1, 5) s; \
         INSERT INTO outbox_sequences (topic, partition_key, last_seq) VALUES ('orders', 'c1', 5); \
         INSERT INTO outbox_keys (topic, partition_key, done_seq, inflight_id, inflight_since) \
           SELECT 'orders', 'c1', 2, id, now() FROM outbox WHERE topic = 'orders' AND seq = 3;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let old_rows = rows(&pool).await;

    let partitioned = outbox_testkit::db::library_migrations(|v| v <= PARTITIONED);
    partitioned.run(&pool).await.unwrap();
    let relkind: String =
        sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE relname = 'outbox'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(relkind, "p");
    assert_eq!(rows(&pool).await, old_rows, "every row as it was");
    let homes: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT tableoid::regclass::text FROM outbox")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(homes, ["outbox_legacy"]);
    // The later migrations (fan-out: subscriber columns) on top, for the current relay's statements below.
    outbox::MIGRATOR.run(&pool).await.unwrap();

    // Ids go on; the relay's claim takes the pending events of before and after, the fenced settle finds a leased
    // one, and housekeeping makes partitions (the legacy one stays until its rows are past retention).
    let next: i64 = sqlx::query_scalar(
        "INSERT INTO outbox (topic, partition_key, payload) VALUES ('audit', 'new', '{}') RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(next, old_rows.last().unwrap().0 + 1);
    let mut conn = pool.acquire().await.unwrap();
    let claimed = outbox::internals::claim::ClaimStatements::new(500, Statements::Prepared)
        .claim_unordered(&mut conn, 60.0)
        .await
        .unwrap();
    let mut ids: Vec<i64> = claimed.iter().map(|e| e.id.get()).collect();
    ids.sort();
    let expected: Vec<i64> = (132..=200).chain([next]).collect();
    assert_eq!(ids, expected);
    let n =
        sqlx::query("UPDATE outbox SET dispatched_at = now() WHERE id = 125 AND lease_token = 5")
            .execute(&pool)
            .await
            .unwrap()
            .rows_affected();
    assert_eq!(n, 1);
    let db = Db::new(pool.clone(), Statements::Prepared);
    let r = partitions::maintain(&db, settings(1000)).await;
    assert_eq!((r.created, r.dropped, r.error), (1, 0, None));
}

/// The survivors of a drop are written as four branches (so that indexes serve them); together they must be
/// exactly the rows row retention keeps, each once.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn survivors_are_exactly_the_rows_row_retention_would_keep(pool: PgPool) {
    // Every combination of dispatched (never, long ago, just now), delivered and dead-lettered.
    sqlx::query(
        "INSERT INTO outbox (topic, partition_key, payload, dispatched_at, delivered_at, dead_lettered_at) \
         SELECT 'audit', 'k', '{}'::jsonb, d, CASE WHEN v THEN now() END, CASE WHEN x THEN now() END \
         FROM unnest(ARRAY[NULL, now() - interval '2 hours', now()]::timestamptz[]) d, \
              unnest(ARRAY[false, true]) v, unnest(ARRAY[false, true]) x",
    )
    .execute(&pool)
    .await
    .unwrap();
    let done: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM outbox WHERE {} ORDER BY id",
        partitions::DONE
    )))
    .bind(3600.0f64)
    .fetch_all(&pool)
    .await
    .unwrap();
    let kept: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM ({}) s ORDER BY id",
        partitions::survivors_sql("outbox")
    )))
    .bind(3600.0f64)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        done.len(),
        1,
        "only dispatched long ago, delivered, not dead is done"
    );
    let mut all: Vec<i64> = done.iter().chain(&kept).copied().collect();
    all.sort();
    assert_eq!(
        all,
        (1..=12).collect::<Vec<_>>(),
        "done {done:?} kept {kept:?}"
    );
}

/// A quiet outbox: the partition in use gets few events, so its ids are never used up. Once no event came for a
/// whole retention window it goes anyway (a partition made ahead and not used yet stays), so events never outlive
/// retention waiting for a partition to fill.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_quiet_partition_in_use_goes_once_its_newest_event_is_past_retention(pool: PgPool) {
    let db = Db::new(pool.clone(), Statements::Prepared);
    partitions::maintain(&db, settings(1000)).await;
    insert_audit(&pool, 20).await;
    all_done_two_hours_ago(&pool).await;
    let before = partitions_of(&pool).await;
    let in_use = before
        .iter()
        .find(|p| p.lo.is_some_and(|lo| lo <= 20))
        .unwrap()
        .name
        .clone();
    let r = partitions::maintain(&db, settings(1000)).await;
    assert_eq!(r.error, None);
    assert_eq!(r.dropped, 1, "{r:?} {before:?}");
    let after = partitions_of(&pool).await;
    assert!(after.iter().all(|p| p.name != in_use), "{after:?}");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
    // New events still find a home: DEFAULT (pruned row by row) until their ids reach the partition made ahead.
    insert_audit(&pool, 5).await;
    let homes: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT tableoid::regclass::text FROM outbox")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(homes, ["outbox_default"]);
    let r = partitions::maintain(&db, settings(1000)).await;
    assert_eq!((r.dropped, r.error.as_deref()), (0, None), "{r:?}");
}

/// Ordered history of `orders` (key `k`, sequences 1..=30) dispatched and delivered two hours ago; returns the
/// first event's id.
async fn ordered_history(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO outbox (topic, partition_key, seq, payload, created_at, dispatched_at, delivered_at) \
         SELECT 'orders', 'k', g, jsonb_build_object('n', g), now() - interval '2 hours', \
                now() - interval '2 hours', now() - interval '2 hours' \
         FROM generate_series(1, 30) g RETURNING id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .min()
    .unwrap()
}

/// `billing` added to `orders` from event `first`, its replay interrupted after one chunk of 10 (an `add --from`
/// that stopped).
async fn add_billing_and_stop_its_replay_after_one_chunk(db: &Db, first: i64) {
    subscribers::add(
        db,
        "orders",
        "billing",
        Some("http://127.0.0.1:9"),
        Start::FromId(first),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let step = subscribers::replay_step(db, "orders", "billing", 10)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((step.copied, step.finished), (10, false), "{step:?}");
}

/// Resumes billing's replay to its end; returns the sequences billing has copies of, and its lane's done sequence
/// and whether the lane is open.
async fn resume_replay(pool: &PgPool, db: &Db) -> (Vec<i64>, i64, bool) {
    subscribers::replay(db, "orders", "billing", Duration::from_secs(5), |_| {})
        .await
        .unwrap();
    let seqs: Vec<i64> = sqlx::query_scalar(
        "SELECT seq FROM outbox WHERE topic = 'orders' AND subscriber = 'billing' ORDER BY seq",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let (done, open): (i64, bool) = sqlx::query_as(
        "SELECT done_seq, available_at < 'infinity' FROM outbox_keys \
         WHERE topic = 'orders' AND partition_key = 'k' AND subscriber = 'billing'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    (seqs, done, open)
}

/// An interrupted replay (the explorer's seed 109) holds the retained history it has still to read: row retention
/// keeps those rows however old, and resumed, the replay copies every event and its lane starts at the first.
/// Before, retention deleted the done events past the replay's cursor, the resumed replay copied around the gap and
/// the subscriber's lane waited forever for the first missing sequence.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn row_retention_keeps_what_an_interrupted_replay_has_still_to_read(pool: PgPool) {
    let db = Db::new(pool.clone(), Statements::Prepared);
    let first = ordered_history(&pool).await;
    add_billing_and_stop_its_replay_after_one_chunk(&db, first).await;
    let deleted =
        outbox::internals::housekeeping::prune_outbox_batch(&db, Duration::from_secs(3600), 1000)
            .await
            .unwrap();
    assert_eq!(deleted, 10, "only the events the replay has read go");
    let (seqs, done, open) = resume_replay(&pool, &db).await;
    assert_eq!(seqs, (1..=30).collect::<Vec<_>>());
    assert_eq!((done, open), (0, true));
    // Finished, the replay holds nothing: the other 20 default copies go too.
    let deleted =
        outbox::internals::housekeeping::prune_outbox_batch(&db, Duration::from_secs(3600), 1000)
            .await
            .unwrap();
    assert_eq!(deleted, 20);
}

/// The same for a partition drop: a done partition a replay has still to read is not dropped (counted as held), and
/// goes once the replay has read past it.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_partition_an_interrupted_replay_has_still_to_read_is_not_dropped(pool: PgPool) {
    let db = Db::new(pool.clone(), Statements::Prepared);
    partitions::maintain(&db, settings(1000)).await;
    let first = ordered_history(&pool).await;
    let home: String =
        sqlx::query_scalar("SELECT tableoid::regclass::text FROM outbox WHERE id = $1")
            .bind(first)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_ne!(home, "outbox_legacy", "the history is in a range partition");
    // Billing's copies land far past it (its newest row stays two hours old).
    sqlx::query("SELECT setval(pg_get_serial_sequence('outbox', 'id'), 100000)")
        .execute(&pool)
        .await
        .unwrap();
    add_billing_and_stop_its_replay_after_one_chunk(&db, first).await;
    let r = partitions::maintain(&db, settings(1000)).await;
    assert_eq!(
        (r.dropped, r.held, r.error.as_deref()),
        (0, 1, None),
        "{r:?}"
    );
    assert!(partitions_of(&pool).await.iter().any(|p| p.name == home));
    let (seqs, done, open) = resume_replay(&pool, &db).await;
    assert_eq!(seqs, (1..=30).collect::<Vec<_>>());
    assert_eq!((done, open), (0, true));
    let r = partitions::maintain(&db, settings(1000)).await;
    assert_eq!((r.held, r.error.as_deref()), (0, None), "{r:?}");
    assert!(r.dropped >= 1, "{r:?}");
    assert!(partitions_of(&pool).await.iter().all(|p| p.name != home));
}
