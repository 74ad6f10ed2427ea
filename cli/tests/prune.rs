//! `outbox prune` against real Postgres: it removes exactly what is past retention — dispatched (and, for ordered
//! topics, delivered) outbox rows, consumer dedupe and sequence rows, handled dead letters, dead outbox rows that
//! nothing refers to and that block no key, idle keys — in bounded batches with a progress line per batch, and
//! nothing else: pending rows, young rows, unhandled dead letters and the dead rows they need stay.

mod common;

use outbox_cli::prune::{PruneArgs, PruneReport, run};
use outbox_testkit::db::{dead_letter, event, key_state};
use outbox_testkit::text;
use sqlx::PgPool;

use common::db;

async fn ids(pool: &PgPool, sql: &'static str) -> Vec<i64> {
    sqlx::query_scalar(sql).fetch_all(pool).await.unwrap()
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn prune_removes_only_what_is_past_retention(pool: PgPool) {
    // Outbox (retention 24 h; dead rows 30 days).
    let mut gone = Vec::new();
    let mut kept = Vec::new();
    for _ in 0..3 {
        gone.push(
            event(
                &pool,
                "audit",
                "old",
                None,
                "dispatched_at = now() - interval '30 hours', delivered_at = now() - interval '30 hours'",
            )
            .await,
        );
    }
    // Dispatched long ago but without an outcome (in flight: not applied, not dead): kept until it is accounted
    // for (decision 0015).
    kept.push(
        event(
            &pool,
            "audit",
            "in-flight",
            None,
            "dispatched_at = now() - interval '30 hours'",
        )
        .await,
    );
    kept.push(
        event(
            &pool,
            "audit",
            "young",
            None,
            "dispatched_at = now() - interval '1 hour'",
        )
        .await,
    );
    kept.push(
        event(
            &pool,
            "audit",
            "pending",
            None,
            "created_at = now() - interval '30 hours'",
        )
        .await,
    );
    // Ordered: delivered long ago goes; dispatched without delivery evidence stays (its key still waits on it).
    gone.push(
        event(&pool, "orders", "o", Some(1), "dispatched_at = now() - interval '30 hours', delivered_at = now() - interval '30 hours'")
            .await,
    );
    kept.push(
        event(
            &pool,
            "orders",
            "o",
            Some(2),
            "dispatched_at = now() - interval '30 hours'",
        )
        .await,
    );
    // Dead rows: kept while an unhandled dead letter needs them, while they are young, while they hold a key.
    let dead_unhandled = event(
        &pool,
        "audit",
        "d1",
        None,
        "dead_lettered_at = now() - interval '40 days'",
    )
    .await;
    dead_letter(
        &pool,
        "relay",
        Some(dead_unhandled),
        "created_at = now() - interval '40 days'",
    )
    .await;
    kept.push(dead_unhandled);
    gone.push(
        event(
            &pool,
            "audit",
            "d2",
            None,
            "dead_lettered_at = now() - interval '40 days'",
        )
        .await,
    ); // letter purged
    kept.push(
        event(
            &pool,
            "audit",
            "d3",
            None,
            "dead_lettered_at = now() - interval '10 days'",
        )
        .await,
    );
    let blocking = event(
        &pool,
        "orders",
        "b",
        Some(1),
        "dead_lettered_at = now() - interval '40 days'",
    )
    .await;
    key_state(
        &pool,
        "orders",
        "b",
        1,
        0,
        &format!("blocked_at = now(), blocked_id = {blocking}"),
    )
    .await;
    kept.push(blocking);
    let skipped = event(
        &pool,
        "orders",
        "s",
        Some(1),
        "dead_lettered_at = now() - interval '40 days'",
    )
    .await;
    key_state(&pool, "orders", "s", 2, 1, "").await; // skipped past: nothing refers to it
    let dl_skipped_handled = dead_letter(
        &pool,
        "qstash",
        Some(skipped),
        "created_at = now() - interval '40 days', resolved_at = now()",
    )
    .await;
    gone.push(skipped);
    kept.push(event(&pool, "orders", "s", Some(2), "").await);
    // An idle ordered key (everything done, nothing blocked or in flight) is released.
    key_state(&pool, "orders", "idle", 4, 4, "").await;

    // Dead letters (30 days): handled and old go; unhandled stays at any age; handled but young stays.
    let dl_redriven_old = dead_letter(
        &pool,
        "relay",
        None,
        "created_at = now() - interval '40 days', redriven_at = now()",
    )
    .await;
    let dl_resolved_old = dead_letter(
        &pool,
        "qstash",
        None,
        "created_at = now() - interval '40 days', resolved_at = now()",
    )
    .await;
    let dl_unhandled_old = dead_letter(
        &pool,
        "qstash",
        None,
        "created_at = now() - interval '400 days'",
    )
    .await;
    let dl_redriven_young = dead_letter(
        &pool,
        "relay",
        None,
        "created_at = now() - interval '10 days', redriven_at = now()",
    )
    .await;

    // Consumer rows (168 h).
    for (id, age) in [("p-old-1", 200), ("p-old-2", 170), ("p-young", 100)] {
        sqlx::query("INSERT INTO processed_messages (consumer, message_id, processed_at) VALUES ('c', $1, now() - make_interval(hours => $2))")
            .bind(id)
            .bind(age)
            .execute(&pool)
            .await
            .unwrap();
    }
    for (key, age) in [("old", 200), ("young", 1)] {
        sqlx::query("INSERT INTO consumer_sequences (consumer, topic, partition_key, last_seq, updated_at) VALUES ('c', 'orders', $1, 3, now() - make_interval(hours => $2))")
            .bind(key)
            .bind(age)
            .execute(&pool)
            .await
            .unwrap();
    }

    let mut out = Vec::new();
    let report = run(
        PruneArgs {
            db: db(&pool),
            outbox_hours: Some(24.0),
            processed_hours: Some(168.0),
            dead_letters_days: 30.0,
            batch: 2,
            json: false,
        },
        &mut out,
    )
    .await
    .unwrap();
    let t = text(&out);
    assert_eq!(
        report,
        PruneReport {
            // The first partition of a new database, empty; the events above are in DEFAULT (no partition was
            // made ahead of them), deleted row by row.
            outbox_partitions: 1,
            outbox: 4,
            processed_messages: 2,
            consumer_sequences: 1,
            dead_letters: 3,
            dead_events: 2,
            idle_keys: 1,
        },
        "{t}"
    );
    // Bounded batches with progress: 4 dispatched rows in batches of 2 = lines for batch 1, 2 (and the empty 3rd).
    assert!(
        t.contains("dispatched outbox rows older than 24h: batch 1 deleted 2 (total 2"),
        "{t}"
    );
    assert!(
        t.contains("dispatched outbox rows older than 24h: batch 2 deleted 2 (total 4"),
        "{t}"
    );
    assert!(
        t.contains("handled dead letters older than 30d: batch 2 deleted 1 (total 3"),
        "{t}"
    );
    assert!(t.contains("unhandled dead letters are never pruned"), "{t}");

    let mut remaining = ids(&pool, "SELECT id FROM outbox ORDER BY id").await;
    remaining.sort_unstable();
    kept.sort_unstable();
    assert_eq!(remaining, kept, "gone: {gone:?}");
    let dls = ids(&pool, "SELECT id FROM dead_letters ORDER BY id").await;
    assert!(
        !dls.contains(&dl_redriven_old)
            && !dls.contains(&dl_resolved_old)
            && !dls.contains(&dl_skipped_handled)
    );
    assert!(dls.contains(&dl_unhandled_old) && dls.contains(&dl_redriven_young));
    let processed: Vec<String> =
        sqlx::query_scalar("SELECT message_id FROM processed_messages ORDER BY 1")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(processed, vec!["p-young"]);
    let seqs: Vec<String> = sqlx::query_scalar("SELECT partition_key FROM consumer_sequences")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(seqs, vec!["young"]);
    let keys: Vec<String> = sqlx::query_scalar("SELECT partition_key FROM outbox_keys ORDER BY 1")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(
        keys,
        vec!["b", "s"],
        "the idle key is released; the blocked one and the busy one stay"
    );

    // A second run finds nothing more.
    let mut out = Vec::new();
    let again = run(
        PruneArgs {
            db: db(&pool),
            outbox_hours: Some(24.0),
            processed_hours: Some(168.0),
            dead_letters_days: 30.0,
            batch: 1000,
            json: true,
        },
        &mut out,
    )
    .await
    .unwrap();
    assert_eq!(again, PruneReport::default());
    let last = text(&out).lines().last().unwrap().to_owned();
    let v: serde_json::Value = serde_json::from_str(&last).unwrap();
    assert_eq!(v["totals"]["outbox"], 0);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn prune_refuses_nonsense_retention(pool: PgPool) {
    let e = run(
        PruneArgs {
            db: db(&pool),
            outbox_hours: Some(0.0),
            processed_hours: Some(168.0),
            dead_letters_days: 30.0,
            batch: 10,
            json: false,
        },
        &mut Vec::new(),
    )
    .await
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("--outbox-hours must be a positive number"),
        "{e}"
    );
}
