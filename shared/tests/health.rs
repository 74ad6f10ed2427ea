//! `outbox::internals::health`: the xmin horizon names the transaction that holds it and lets go when it ends; dead tuples
//! left by a retention-sized `DELETE` show as bloat until vacuum cleans them.

use std::time::{Duration, Instant};

use outbox::db::{Db, Statements};
use outbox::internals::health::{self, DEAD_PERCENT_FLOOR_ROWS, TableHealth, WATCHED_TABLES};
use sqlx::{Connection, PgConnection, PgPool};

fn db(pool: &PgPool) -> Db {
    Db::new(pool.clone(), Statements::Prepared)
}

/// A second session on the test's database, named so that `held_by` can be recognised.
async fn session(pool: &PgPool, name: &str) -> PgConnection {
    let opts = pool
        .connect_options()
        .as_ref()
        .clone()
        .application_name(name);
    PgConnection::connect_with(&opts).await.unwrap()
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_transaction_left_open_holds_the_horizon_until_it_ends(pool: PgPool) {
    let mut holder = session(&pool, "health-test-holder").await;
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    // A transaction id, as a writer that went idle in transaction would hold.
    sqlx::query("SELECT txid_current()")
        .execute(&mut holder)
        .await
        .unwrap();
    // Transactions begun after it: the horizon falls behind by at least these.
    for _ in 0..5 {
        sqlx::query("SELECT txid_current()")
            .execute(&pool)
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let h = health::read(&db(&pool)).await.unwrap().horizon;
    assert!(h.sees_all_sessions, "the tests run as a superuser: {h:?}");
    let held_by = h.held_by.clone().unwrap_or_default();
    assert!(
        held_by.contains("health-test-holder") && held_by.contains("idle in transaction"),
        "{h:?}"
    );
    assert!(h.horizon_age_xids >= 5, "{h:?}");
    assert!(h.oldest_transaction_age_secs >= 1.0, "{h:?}");

    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    let h = health::read(&db(&pool)).await.unwrap().horizon;
    assert!(
        !h.held_by
            .as_deref()
            .unwrap_or_default()
            .contains("health-test-holder"),
        "{h:?}"
    );
    assert!(h.oldest_transaction_age_secs < 1.0, "{h:?}");
}

/// `processed_messages`' figures once `done` holds of them, or as they are after 20 s (the statistics are
/// flushed asynchronously).
async fn processed_messages_until(
    pool: &PgPool,
    done: impl Fn(&TableHealth) -> bool,
) -> TableHealth {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let h = health::read(&db(pool)).await.unwrap();
        let t = h
            .tables
            .into_iter()
            .find(|t| t.table == "processed_messages")
            .unwrap();
        if done(&t) || Instant::now() > deadline {
            return t;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn rows_deleted_by_retention_are_dead_tuples_until_vacuum(pool: PgPool) {
    let rows = 2 * DEAD_PERCENT_FLOOR_ROWS;
    let before = health::read(&db(&pool)).await.unwrap();
    let names: Vec<&str> = before.tables.iter().map(|t| t.table.as_str()).collect();
    assert_eq!(names, WATCHED_TABLES, "every watched table, in order");
    assert!(before.max_dead_percent() < 1.0, "{before:?}");

    // Dedupe rows past their TTL, deleted as the relay's housekeeping deletes them, in one session whose
    // statistics are flushed at once.
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query(
        "INSERT INTO processed_messages (consumer, message_id, processed_at) \
         SELECT 'c1', 'm' || g, now() - interval '2 days' FROM generate_series(1, $1) g",
    )
    .bind(rows)
    .execute(&mut *conn)
    .await
    .unwrap();
    let deleted = outbox::internals::housekeeping::prune_processed_batch(
        &db(&pool),
        Duration::from_secs(3600),
        rows as u32,
    )
    .await
    .unwrap();
    assert_eq!(deleted, rows as u64);
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut *conn)
        .await
        .unwrap();
    drop(conn);

    let t = processed_messages_until(&pool, |t| t.dead_tuples >= rows).await;
    let h = health::read(&db(&pool)).await.unwrap();
    assert_eq!(t.dead_tuples, rows, "{t:?}");
    assert!(t.dead_percent() > 99.0, "{t:?}");
    assert!(h.max_dead_percent() > 99.0, "{h:?}");
    assert!(t.total_bytes > t.index_bytes && t.index_bytes > 0, "{t:?}");

    sqlx::query("VACUUM processed_messages")
        .execute(&pool)
        .await
        .unwrap();
    let t = processed_messages_until(&pool, |t| t.dead_tuples == 0).await;
    assert_eq!(t.dead_tuples, 0, "vacuum cleaned them: {t:?}");
    assert!(t.dead_percent() < 1.0, "{t:?}");
}

#[test]
fn a_small_table_with_a_few_dead_rows_is_not_bloated() {
    let t = TableHealth {
        table: "outbox_keys".into(),
        live_tuples: 10,
        dead_tuples: 20,
        total_bytes: 8192,
        index_bytes: 0,
        last_autovacuum: None,
        autovacuum_count: 0,
    };
    assert!(t.dead_percent() < 1.0);
    let big = TableHealth {
        live_tuples: 40_000,
        dead_tuples: 60_000,
        ..t
    };
    assert!((big.dead_percent() - 60.0).abs() < 1e-9);
}
