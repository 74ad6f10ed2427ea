//! The relay's housekeeping keeps up with the write rate: beside the drain it runs pass after pass while rows past
//! retention remain, instead of one time-boxed pass per invocation (which deleted at most a budget's worth per
//! invocation, whatever the rate). Rows still needed are never touched.

use std::time::{Duration, Instant};

use outbox::db::{Db, Statements};
use outbox::internals::housekeeping::{self, Retention};
use sqlx::PgPool;

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn housekeeping_beside_the_drain_deletes_everything_past_retention_and_nothing_else(
    pool: PgPool,
) {
    // 3,000 events dispatched and delivered two hours ago, their dedupe rows as old.
    sqlx::query(
        "INSERT INTO outbox (topic, partition_key, payload, dispatched_at, delivered_at) \
         SELECT 'audit', 'k' || (g % 10), '{}'::jsonb, now() - interval '2 hours', now() - interval '2 hours' \
         FROM generate_series(1, 3000) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO processed_messages (consumer, message_id, processed_at) \
         SELECT 'c', 'm' || g, now() - interval '2 hours' FROM generate_series(1, 3000) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    // Kept: a pending event, one dispatched but not delivered yet, one delivered recently, a dead-lettered one
    // (old, and even with a delivery recorded), a recent dedupe row.
    sqlx::query(
        "INSERT INTO outbox (topic, partition_key, payload, dispatched_at, delivered_at, dead_lettered_at) VALUES \
         ('audit', 'p', '{}', NULL, NULL, NULL), \
         ('audit', 'q', '{}', now() - interval '2 hours', NULL, NULL), \
         ('audit', 'r', '{}', now(), now(), NULL), \
         ('audit', 's', '{}', now() - interval '2 hours', now() - interval '2 hours', now() - interval '2 hours')",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO processed_messages (consumer, message_id) VALUES ('c', 'recent')")
        .execute(&pool)
        .await
        .unwrap();

    let db = Db::new(pool.clone(), Statements::Prepared);
    // A budget far too small for the backlog: each pass deletes a little and says there is more.
    let retention = Retention {
        outbox: Duration::from_secs(3600),
        processed: Duration::from_secs(3600),
        batch: 100,
        time_budget: Duration::from_millis(20),
    };
    let first = housekeeping::run(&db, retention).await.unwrap();
    assert!(
        first.more,
        "one pass should not clear 3,000 rows in 20 ms: {first:?}"
    );
    assert!(first.outbox_deleted < 3000, "{first:?}");
    // One invocation's window is 8 s; on a loaded machine 20 ms passes may need more than one window to clear
    // 3,000 rows, as they would need more than one invocation. Windows follow one another (a bound of 120 s, far
    // past what the work needs) until a pass finds nothing more; each window must end by its deadline.
    let never = tokio::sync::Notify::new();
    let (mut outbox_deleted, mut processed_deleted) = (0, 0);
    let mut last = first;
    let overall = Instant::now() + Duration::from_secs(120);
    loop {
        let until = Instant::now() + Duration::from_secs(8);
        let window = housekeeping::keep_up(&db, retention, last, until, &never).await;
        assert!(
            Instant::now() <= until + Duration::from_secs(1),
            "keep_up overran its deadline"
        );
        outbox_deleted += window.outbox_deleted;
        processed_deleted += window.processed_deleted;
        if !window.more || Instant::now() > overall {
            last = window;
            break;
        }
        // The next window starts from a pass that found more; its counts are already in this window's total.
        last = housekeeping::run(&db, retention).await.unwrap();
    }
    assert_eq!(outbox_deleted, 3000, "{last:?}");
    assert_eq!(processed_deleted, 3000, "{last:?}");
    assert!(!last.more, "{last:?}");

    let left: Vec<String> =
        sqlx::query_scalar("SELECT partition_key FROM outbox ORDER BY partition_key")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(left, ["p", "q", "r", "s"]);
    let dedupe: Vec<String> = sqlx::query_scalar("SELECT message_id FROM processed_messages")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(dedupe, ["recent"]);
}

/// The drain's end stops housekeeping at once, even between passes and even when it came first.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn housekeeping_beside_the_drain_stops_when_the_drain_ends(pool: PgPool) {
    let db = Db::new(pool.clone(), Statements::Prepared);
    let retention = Retention {
        outbox: Duration::from_secs(3600),
        processed: Duration::from_secs(3600),
        batch: 100,
        time_budget: Duration::from_millis(200),
    };
    let stop = tokio::sync::Notify::new();
    stop.notify_one();
    let started = Instant::now();
    let until = started + Duration::from_secs(60);
    let total = housekeeping::keep_up(&db, retention, Default::default(), until, &stop).await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "kept going after the drain ended"
    );
    assert_eq!(total.outbox_deleted, 0);
}
