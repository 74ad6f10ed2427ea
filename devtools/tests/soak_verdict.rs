//! The soak's verdict (`outbox_devtools::soak::verdict`) on database states built by hand, each with one known
//! defect — an event lost, one applied twice, one applied out of order, one left leased, a poison dead letter, a
//! non-poison dead letter — and a clean state: every figure is what the state holds, nothing more. Then the
//! judgement: a must-be-zero figure, or an unexpected dead letter outside its bound, fails the run.

use outbox_devtools::soak::{self, SoakReport};
use sqlx::PgPool;

/// An event of the soak (`n` its number, `seq` on the ordered topic), dispatched as the relay leaves it.
async fn event(pool: &PgPool, seq: Option<i64>, key: &str, poison: bool) -> i64 {
    let topic = if seq.is_some() {
        soak::ORDERED
    } else {
        soak::UNORDERED
    };
    sqlx::query_scalar(
        "INSERT INTO outbox (topic, partition_key, seq, payload, dispatched_at) \
         VALUES ($1, $2, $3, jsonb_build_object('n', 1, 'poison', $4::boolean), now()) RETURNING id",
    )
    .bind(topic.name())
    .bind(key)
    .bind(seq)
    .bind(poison)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The soak consumer applied event `id` (one more row: no unique constraint).
async fn apply(pool: &PgPool, id: i64) {
    sqlx::query(
        "INSERT INTO soak_applied (outbox_id, topic, partition_key, seq, n) \
         SELECT id, topic, partition_key, seq, 1 FROM outbox WHERE id = $1",
    )
    .bind(id)
    .execute(pool)
    .await
    .unwrap();
}

/// QStash gave up on event `id`: its dead letter, the event marked dead.
async fn dead_letter(pool: &PgPool, id: i64, error: &str, status: i32) {
    outbox_testkit::db::dead_letter(
        pool,
        "qstash",
        Some(id),
        &format!("error = '{error}', status = {status}"),
    )
    .await;
    sqlx::query("UPDATE outbox SET dead_lettered_at = now() WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
}

/// A clean soak: three ordered events of one key applied in order, two unordered ones applied once.
async fn clean(pool: &PgPool) -> Vec<i64> {
    soak::create_table(pool).await.unwrap();
    let mut ids = Vec::new();
    for seq in 1..=3 {
        ids.push(event(pool, Some(seq), "k1", false).await);
    }
    for _ in 0..2 {
        ids.push(event(pool, None, "k2", false).await);
    }
    for id in &ids {
        apply(pool, *id).await;
    }
    ids
}

/// The figures the database holds, in one comparable value.
#[derive(Debug, Default, PartialEq, Eq)]
struct Figures {
    enqueued: i64,
    poison: i64,
    applied_once: i64,
    applied_twice: i64,
    poison_applied: i64,
    dead_poison: i64,
    dead_other: i64,
    unexpected: Vec<i64>,
    lost: i64,
    order_violations: i64,
    left_leased: i64,
}

fn figures(r: &SoakReport) -> Figures {
    Figures {
        enqueued: r.enqueued,
        poison: r.poison,
        applied_once: r.applied_once,
        applied_twice: r.applied_twice,
        poison_applied: r.poison_applied,
        dead_poison: r.dead_lettered_poison,
        dead_other: r.dead_lettered_other,
        unexpected: r.unexpected_dead_letters.clone(),
        lost: r.lost,
        order_violations: r.order_violations,
        left_leased: r.left_leased,
    }
}

/// What [`clean`] holds, plus `extra` events.
fn clean_figures(extra: i64) -> Figures {
    Figures {
        enqueued: 5 + extra,
        applied_once: 5,
        ..Figures::default()
    }
}

async fn judged(pool: &PgPool) -> SoakReport {
    let mut r = soak::verdict(pool).await.unwrap();
    r.drained = true;
    r.retries_exhaustible = true;
    r.judge();
    r
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_clean_soak_counts_every_event_applied_once_and_passes(pool: PgPool) {
    clean(&pool).await;
    let r = judged(&pool).await;
    assert_eq!(figures(&r), clean_figures(0), "{}", r.line());
    assert!(r.dead_letter_reasons.is_empty());
    assert!(r.ok, "{}", r.line());
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_event_neither_applied_nor_dead_lettered_is_lost(pool: PgPool) {
    clean(&pool).await;
    event(&pool, None, "k3", false).await;
    let r = judged(&pool).await;
    assert_eq!(
        figures(&r),
        Figures {
            lost: 1,
            ..clean_figures(1)
        }
    );
    assert!(!r.ok, "{}", r.line());
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_event_applied_twice_is_counted_once_as_twice(pool: PgPool) {
    let ids = clean(&pool).await;
    apply(&pool, ids[4]).await;
    let r = judged(&pool).await;
    assert_eq!(
        figures(&r),
        Figures {
            applied_once: 4,
            applied_twice: 1,
            ..clean_figures(0)
        }
    );
    assert!(!r.ok, "{}", r.line());
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_sequence_applied_after_a_later_one_is_an_order_violation(pool: PgPool) {
    clean(&pool).await;
    // Key k9: seq 2 applied before seq 1.
    let first = event(&pool, Some(1), "k9", false).await;
    let second = event(&pool, Some(2), "k9", false).await;
    apply(&pool, second).await;
    apply(&pool, first).await;
    let r = judged(&pool).await;
    assert_eq!(
        figures(&r),
        Figures {
            applied_once: 7,
            order_violations: 1,
            ..clean_figures(2)
        }
    );
    assert!(!r.ok, "{}", r.line());
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_key_still_leased_or_an_event_still_pending_is_left_leased(pool: PgPool) {
    clean(&pool).await;
    let ordered = soak::ORDERED;
    outbox_testkit::db::key_state(
        &pool,
        ordered.name(),
        "k1",
        3,
        3,
        "locked_until = now() + interval '1 minute'",
    )
    .await;
    let r = judged(&pool).await;
    assert_eq!(
        figures(&r),
        Figures {
            left_leased: 1,
            ..clean_figures(0)
        }
    );
    assert!(!r.ok, "{}", r.line());
    // An applied event the relay still holds as pending counts too.
    sqlx::query("UPDATE outbox_keys SET locked_until = NULL")
        .execute(&pool)
        .await
        .unwrap();
    let pending = event(&pool, None, "k4", false).await;
    sqlx::query("UPDATE outbox SET dispatched_at = NULL WHERE id = $1")
        .bind(pending)
        .execute(&pool)
        .await
        .unwrap();
    apply(&pool, pending).await;
    let r = judged(&pool).await;
    assert_eq!(
        figures(&r),
        Figures {
            applied_once: 6,
            left_leased: 1,
            ..clean_figures(1)
        }
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_poison_dead_letter_is_expected_and_passes(pool: PgPool) {
    clean(&pool).await;
    let poison = event(&pool, None, "k5", true).await;
    dead_letter(
        &pool,
        poison,
        "QStash gave up after 1 attempt(s); last status 489; the consumer said about this event: soak poison event",
        489,
    )
    .await;
    let r = judged(&pool).await;
    assert_eq!(
        figures(&r),
        Figures {
            poison: 1,
            dead_poison: 1,
            ..clean_figures(1)
        }
    );
    assert_eq!(r.dead_letter_reasons.len(), 1);
    assert!(r.dead_letter_reasons[0].poison);
    assert!(r.ok, "{}", r.line());
    // A poison event applied is a failure.
    apply(&pool, poison).await;
    let r = judged(&pool).await;
    assert_eq!(
        figures(&r),
        Figures {
            poison: 1,
            applied_once: 6,
            poison_applied: 1,
            ..clean_figures(1)
        }
    );
    assert!(!r.ok, "{}", r.line());
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_non_poison_dead_letter_passes_only_when_the_dev_servers_dlq_explains_it(pool: PgPool) {
    clean(&pool).await;
    let other = event(&pool, None, "k6", false).await;
    dead_letter(
        &pool,
        other,
        "QStash gave up after 4 attempt(s); no response (network errors or timeouts)",
        0,
    )
    .await;
    // Redriven, it died again: two dead letters of one event count it once.
    sqlx::query("UPDATE dead_letters SET redriven_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    dead_letter(
        &pool,
        other,
        "QStash gave up after 4 attempt(s); no response (network errors or timeouts)",
        0,
    )
    .await;
    let mut r = judged(&pool).await;
    assert_eq!(
        figures(&r),
        Figures {
            dead_other: 1,
            unexpected: vec![other],
            ..clean_figures(1)
        }
    );
    assert_eq!(r.dead_letter_reasons.len(), 1);
    assert_eq!(r.dead_letter_reasons[0].count, 1);
    assert!(!r.dead_letter_reasons[0].poison);
    assert!(!r.ok, "unexplained: {}", r.line());
    r.explained_dead_letters = vec![other];
    r.judge();
    assert!(r.ok, "explained by the dev server: {}", r.line());
    r.retries_exhaustible = false;
    r.judge();
    assert!(
        !r.ok,
        "nothing could exhaust QStash's retries: none allowed: {}",
        r.line()
    );
}
