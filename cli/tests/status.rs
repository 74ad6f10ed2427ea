//! `outbox status` against a hand-built state: every figure (the three status queries, blocked keys,
//! evidence, dead letters by topic and source) must match what was built, in the library, the JSON and the table.

mod common;

use outbox::ops::{DeadLetterCounts, status};
use outbox_cli::status::{StatusArgs, run};
use outbox_testkit::db::{dead_letter, event, key_state};
use outbox_testkit::text;
use sqlx::PgPool;

use common::db;

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn status_figures_match_a_hand_built_state(pool: PgPool) {
    // (1) Pending: four unordered rows (3 attempts is not yet flapping: the threshold is "more than 3") and two ordered rows queued behind a blocked head.
    let _u1 = event(
        &pool,
        "audit",
        "a",
        None,
        "created_at = now() - interval '10 minutes'",
    )
    .await;
    let u2 = event(
        &pool,
        "audit",
        "b",
        None,
        "created_at = now() - interval '5 minutes', attempts = 5",
    )
    .await;
    let u3 = event(
        &pool,
        "audit",
        "c",
        None,
        "created_at = now() - interval '1 minute', attempts = 4, locked_until = now() - interval '30 seconds', \
         lease_token = 7",
    )
    .await;
    let _u4 = event(
        &pool,
        "audit",
        "d",
        None,
        "created_at = now() - interval '2 minutes', attempts = 3, locked_until = now() + interval '1 minute', \
         available_at = now() + interval '1 minute', lease_token = 8",
    )
    .await;
    let o1 = event(
        &pool,
        "orders",
        "k1",
        Some(1),
        "attempts = 2, dead_lettered_at = now() - interval '3 minutes'",
    )
    .await;
    for seq in [2, 3] {
        event(
            &pool,
            "orders",
            "k1",
            Some(seq),
            "created_at = now() - interval '1 minute'",
        )
        .await;
    }
    key_state(
        &pool,
        "orders",
        "k1",
        3,
        0,
        &format!("blocked_at = now() - interval '3 minutes', blocked_id = {o1}, blocked_reason = 'boom reason'"),
    )
    .await;
    // Dead, not pending.
    let dead_audit = event(&pool, "audit", "e", None, "dead_lettered_at = now()").await;

    // (2) Dispatched: 5 (+1 ordered head) two minutes ago, 3 thirty minutes ago, 7 two hours ago (outside).
    let m2: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT date_trunc('minute', now()) - interval '2 minutes'")
            .fetch_one(&pool)
            .await
            .unwrap();
    let m30 = m2 - chrono::TimeDelta::minutes(28);
    // Every row below is placed relative to this one reading of the clock: each `event` is a statement of its own,
    // and a minute boundary passing between two of them must not move rows to another bucket.
    let at_m2 = format!("'{}'::timestamptz + interval '10 seconds'", m2.to_rfc3339());
    let at_m30 = format!(
        "'{}'::timestamptz + interval '10 seconds'",
        m30.to_rfc3339()
    );
    for _ in 0..5 {
        event(
            &pool,
            "audit",
            "x",
            None,
            &format!("dispatched_at = {at_m2}"),
        )
        .await;
    }
    for _ in 0..3 {
        event(
            &pool,
            "audit",
            "y",
            None,
            &format!("dispatched_at = {at_m30}"),
        )
        .await;
    }
    for _ in 0..7 {
        event(
            &pool,
            "audit",
            "z",
            None,
            "dispatched_at = now() - interval '2 hours'",
        )
        .await;
    }
    // An ordered head accepted by QStash, waiting for its delivery callback.
    let k2 = event(
        &pool,
        "orders",
        "k2",
        Some(1),
        &format!("dispatched_at = {at_m2}"),
    )
    .await;
    key_state(
        &pool,
        "orders",
        "k2",
        1,
        0,
        &format!("inflight_id = {k2}, inflight_since = now() - interval '20 seconds'"),
    )
    .await;

    // Dead letters: orders/qstash 1 unresolved + 1 redriven, orders/relay 1 resolved, audit/relay 1 unresolved,
    // an unparseable callback (no topic) 1 unresolved, audit/qstash 1 applied.
    let _dl0 = dead_letter(
        &pool,
        "qstash",
        Some(o1),
        "redriven_at = now() - interval '1 hour'",
    )
    .await;
    let dl1 = dead_letter(&pool, "qstash", Some(o1), "").await;
    dead_letter(
        &pool,
        "relay",
        None,
        "topic = 'orders', resolved_at = now()",
    )
    .await;
    dead_letter(&pool, "relay", Some(dead_audit), "").await;
    // QStash gave up on an event the consumer had applied (every response lost): counted apart, not unresolved.
    dead_letter(
        &pool,
        "qstash",
        None,
        "topic = 'audit', resolved_at = now(), resolution = 'applied'",
    )
    .await;
    dead_letter(
        &pool,
        "qstash",
        None,
        "raw_callback = '\\x00'::bytea, parse_error = 'not JSON'",
    )
    .await;

    let s = status(&pool).await.unwrap();
    assert_eq!(s.backlog.pending, 6);
    assert!(
        (600.0..660.0).contains(&s.backlog.oldest_pending_age_secs),
        "{}",
        s.backlog.oldest_pending_age_secs
    );
    assert_eq!(s.backlog.flapping, 2);
    assert_eq!(
        s.backlog
            .flapping_rows
            .iter()
            .map(|e| e.id)
            .collect::<Vec<_>>(),
        vec![u2, u3],
        "most attempts first"
    );
    assert_eq!(s.throughput.last_hour, 9);
    assert_eq!(s.throughput.per_minute.len(), 60);
    let bucket = |m| {
        s.throughput
            .per_minute
            .iter()
            .find(|b| b.minute == m)
            .map(|b| b.dispatched)
    };
    assert_eq!(bucket(m2), Some(6));
    assert_eq!(bucket(m30), Some(3));
    assert_eq!(
        s.throughput
            .per_minute
            .iter()
            .filter(|b| b.dispatched > 0)
            .count(),
        2
    );
    assert_eq!(s.stuck_leases.count, 1);
    assert_eq!(
        s.stuck_leases
            .oldest
            .iter()
            .map(|e| e.id)
            .collect::<Vec<_>>(),
        vec![u3]
    );
    assert_eq!(s.blocked_keys.count, 1);
    let b = &s.blocked_keys.keys[0];
    assert_eq!(
        (b.topic.as_str(), b.partition_key.as_str()),
        ("orders", "k1")
    );
    assert_eq!(b.blocking_event.map(outbox::OutboxId::get), Some(o1));
    assert_eq!(
        b.dead_letter_id,
        Some(dl1),
        "the unhandled dead letter to redrive"
    );
    assert_eq!(b.waiting, Some(2));
    assert_eq!(b.reason.as_deref(), Some("boom reason"));
    assert_eq!(s.awaiting_evidence.count, 1);
    assert!((20.0..60.0).contains(&s.awaiting_evidence.oldest_secs));
    let row = |topic: Option<&str>, source: &str, unresolved, redriven, resolved, applied| {
        DeadLetterCounts {
            topic: topic.map(str::to_owned),
            source: source.into(),
            unresolved,
            redriven,
            resolved,
            applied,
            oldest_unresolved: None,
        }
    };
    let mut counts = s.dead_letters.clone();
    for c in &mut counts {
        assert_eq!(c.oldest_unresolved.is_some(), c.unresolved > 0, "{c:?}");
        c.oldest_unresolved = None;
    }
    assert_eq!(
        counts,
        vec![
            row(Some("audit"), "relay", 1, 0, 0, 0),
            row(Some("orders"), "qstash", 1, 1, 0, 0),
            row(None, "qstash", 1, 0, 0, 0),
            row(Some("audit"), "qstash", 0, 0, 0, 1),
            row(Some("orders"), "relay", 0, 0, 1, 0),
        ]
    );
    assert_eq!(s.unresolved_dead_letters(), 3);

    // The CLI: --json carries the same figures; the table shows them with what to do next.
    let db = db(&pool);
    let mut out = Vec::new();
    run(
        StatusArgs {
            db: db.clone(),
            json: true,
            warn_age_secs: 300,
        },
        &mut out,
    )
    .await
    .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["backlog"]["pending"], 6);
    assert_eq!(v["backlog"]["flapping"], 2);
    assert_eq!(v["throughput"]["last_hour"], 9);
    assert_eq!(v["stuck_leases"]["count"], 1);
    assert_eq!(v["stuck_leases"]["oldest"][0]["id"], u3);
    assert_eq!(v["blocked_keys"]["keys"][0]["dead_letter_id"], dl1);
    assert_eq!(v["awaiting_evidence"]["count"], 1);
    assert_eq!(v["dead_letters"].as_array().unwrap().len(), 5);
    let tables: Vec<&str> = v["database"]["tables"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["table"].as_str().unwrap())
        .collect();
    assert_eq!(
        tables,
        [
            "outbox",
            "processed_messages",
            "outbox_keys",
            "dead_letters"
        ]
    );
    assert!(v["database"]["horizon"]["oldest_transaction_age_secs"].is_number());
    assert_eq!(v["database"]["horizon"]["sees_all_sessions"], true);

    let mut out = Vec::new();
    run(
        StatusArgs {
            db,
            json: false,
            warn_age_secs: 300,
        },
        &mut out,
    )
    .await
    .unwrap();
    let t = text(&out);
    for needle in [
        "pending                6",
        "flapping (>3 attempts) 2",
        &format!("event #{u2} audit/b  5 attempts"),
        "total 9 ",
        "count                  1",
        "orders/k1  since 3m",
        &format!("by event #{o1} (dead letter #{dl1}), 2 waiting behind it: boom reason"),
        "awaiting delivery evidence 1",
        "audit                    relay            1         0         0        0",
        "(unknown)                qstash           1         0         0        0",
        "audit                    qstash           0         0         0        1",
        "is a relay running?",
        "outbox dead-letters redrive <dead letter id>",
        "3 unresolved dead letter(s)",
        "Database (what vacuum may clean",
        "oldest transaction     ",
        "xmin horizon           ",
    ] {
        assert!(t.contains(needle), "table lacks {needle:?}:\n{t}");
    }
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn status_of_an_empty_outbox(pool: PgPool) {
    let s = status(&pool).await.unwrap();
    assert_eq!(s.backlog.pending, 0);
    assert_eq!(s.backlog.oldest_pending_age_secs, 0.0);
    assert_eq!(s.throughput.last_hour, 0);
    assert!(s.dead_letters.is_empty());
    let mut out = Vec::new();
    run(
        StatusArgs {
            db: db(&pool),
            json: false,
            warn_age_secs: 300,
        },
        &mut out,
    )
    .await
    .unwrap();
    let t = text(&out);
    assert!(t.contains("Dead letters\n  none"), "{t}");
    assert!(!t.contains("What to do next"), "{t}");
}
