//! Every event accounted for (decision record 0015), tried on the whole system: the callback receiver down for
//! longer than QStash retries its callbacks, and QStash losing a message it accepted. The reconciler (run by every
//! relay invocation, against the dev server's DLQ and message API) must close both: exactly one dead letter per
//! poison event, and a lost event published again and applied once.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use orders_example::{AUDIT, AuditEntry, audit_event, demo::place_order};
use outbox::Producer;
use outbox::config::EvidenceMode;
use outbox_cli::dead_letters::{Confirm, DeadLettersCommand, FilterArgs, RedriveArgs};
use outbox_cli::util::DbArgs;
use outbox_testkit::db::url_of;
use outbox_testkit::stack::{LocalStack, StackOptions};
use qstash_dev::{AttemptKind, Faults};
use sqlx::PgPool;

/// The dev server's time scale: QStash's retry delays become milliseconds.
const TIME_SCALE: f64 = 0.001;
/// The stack's QStash retries per message (`StackOptions::qstash_retries`).
const RETRIES: u32 = 3;
/// One relay invocation.
const INVOCATION: Duration = Duration::from_secs(4);

/// How long after its dispatch QStash has given up on a poison message *and* on that message's failure callback
/// (QStash retries a callback with the message's retry settings): both retry schedules, QStash's documented
/// `min(86400, e^(2.5·n))` s before retry n, scaled by the dev server. Computed here from the test's own settings,
/// not by the library under test. For 3 retries: 2 × 1,968.6 s × 0.001 ≈ 3.9 s.
fn qstash_gives_up_after() -> Duration {
    let delays: f64 = (1..=RETRIES)
        .map(|n| (2.5 * f64::from(n)).exp().min(86_400.0))
        .sum();
    Duration::from_secs_f64(2.0 * delays * TIME_SCALE)
}

/// The reconciler's horizon: QStash's give-up time twice over, plus 4 s. It cannot race QStash by construction:
/// when QStash has given up on everything, the events are at most half-way to the horizon, and the margin (the
/// give-up time again, plus a whole invocation) is what a loaded machine may add to QStash's schedule before the
/// reconciler may act.
fn horizon() -> Duration {
    qstash_gives_up_after() * 2 + INVOCATION
}

/// Long enough for the reconciler to close an event once it passed the horizon: the horizon, two invocations
/// (the pass that finds it may start just before it crosses), and QStash's give-up time for its answers.
fn closes_within() -> Duration {
    horizon() + INVOCATION * 2 + qstash_gives_up_after() + Duration::from_secs(20)
}

/// A stack whose QStash gives up within seconds ([`qstash_gives_up_after`]) and whose reconciler looks events up
/// after [`horizon`].
fn options(pool: &PgPool, mode: EvidenceMode, batch: u32) -> StackOptions {
    let mut opts = StackOptions::new(&url_of(pool)).unwrap();
    opts.relay.ordered_evidence = mode;
    // The unordered outcome follows: dedupe rows with consumer evidence, delivery callbacks otherwise.
    opts.relay.batching.default_n = batch;
    opts.qstash_retries = RETRIES;
    opts.dev.time_scale = TIME_SCALE;
    opts.relay.lease = Duration::from_secs(2);
    opts.relay.poll_interval = Duration::from_millis(50);
    opts.invocation = INVOCATION;
    opts.relay.accounting.horizon = horizon();
    opts.relay.accounting.applied_grace = Duration::from_millis(500);
    opts.relay.accounting.lookup_interval = Duration::from_millis(20);
    // Longer than the test: the reconciler, not the evidence timeout, must settle the ordered poison head.
    opts.relay.evidence_timeout = Duration::from_secs(600);
    opts
}

async fn scalar(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Polls `check` every 200 ms until it is true or `timeout` passes.
async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The accounting part of the relay's last invocation summary, for failure messages.
fn last_invocation(stack: &LocalStack) -> String {
    stack
        .last_invocation()
        .map(|s| {
            format!(
                "accounting {:?}, error {:?}, backlog {:?}",
                s.accounting, s.accounting_error, s.backlog
            )
        })
        .unwrap_or_else(|| "none yet".into())
}

/// An unordered audit event its handler rejects for good (an empty actor).
async fn enqueue_poison_audit(pool: &PgPool, n: u32) -> i64 {
    let mut tx = pool.begin().await.unwrap();
    let e = audit_event(
        &format!("poison-{n}"),
        &AuditEntry {
            actor: String::new(),
            action: "poison".into(),
            details: serde_json::json!({"n": n}),
        },
    )
    .unwrap();
    let ids = Producer::default()
        .enqueue_batch(&mut tx, &[e])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let _ = AUDIT;
    ids[0].id.get()
}

async fn callback_receiver_down_then_up(pool: PgPool, mode: EvidenceMode, batch: u32) {
    let stack = LocalStack::start(options(&pool, mode, batch))
        .await
        .unwrap();
    stack.set_callbacks_down(true);

    // 12 orders, 3 of them poison (an ordered `orders` event each, on its own key), and 3 poison audit events
    // (unordered); every order also writes a healthy audit event.
    let mut poison: Vec<i64> = Vec::new();
    for n in 1..=12u64 {
        place_order(&stack.pool, n, n % 4 == 0, None).await.unwrap();
    }
    poison.extend(
        sqlx::query_scalar::<_, i64>(
            "SELECT id FROM outbox WHERE topic = 'orders' AND partition_key IN ('order-4', 'order-8', 'order-12')",
        )
        .fetch_all(&pool)
        .await
        .unwrap(),
    );
    assert_eq!(poison.len(), 3, "the example's poison orders");
    for n in 0..3 {
        poison.push(enqueue_poison_audit(&stack.pool, n).await);
    }
    poison.sort_unstable();

    // QStash gives up on every poison event's message, then on that message's failure callback (the receiver
    // answers 503), as the dev server's own DLQ shows.
    let dev = stack.dev.handle();
    let gave_up_on_callbacks = eventually(
        Duration::from_secs(60) + qstash_gives_up_after(),
        || async {
            let ids: Vec<Option<String>> =
                sqlx::query_scalar("SELECT qstash_message_id FROM outbox WHERE id = ANY ($1)")
                    .bind(&poison)
                    .fetch_all(&pool)
                    .await
                    .unwrap();
            let dlq = dev.dlq_entries();
            let failed: HashSet<&str> = dlq
                .iter()
                .filter(|e| e.kind == AttemptKind::Destination)
                .map(|e| e.message_id.as_str())
                .collect();
            let callbacks_failed: HashSet<String> = dlq
                .iter()
                .filter(|e| e.kind == AttemptKind::FailureCallback)
                .filter_map(|e| serde_json::from_slice::<serde_json::Value>(&e.body).ok())
                .filter_map(|b| b["sourceMessageId"].as_str().map(str::to_owned))
                .collect();
            ids.len() == poison.len()
                && ids.iter().all(|id| {
                    id.as_deref()
                        .is_some_and(|id| failed.contains(id) && callbacks_failed.contains(id))
                })
        },
    )
    .await;
    assert!(
        gave_up_on_callbacks,
        "QStash did not give up on every poison message's failure callback: {:?}",
        dev.dlq_entries()
            .iter()
            .map(|e| (e.kind, e.message_id.clone()))
            .collect::<Vec<_>>()
    );
    // Nothing recorded them: without the reconciler they would stay in flight forever. (Only the reconciler can
    // have recorded a dead letter by now, and only for an event past the horizon: none may be older.)
    let horizon = horizon();
    let early: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM dead_letters d JOIN outbox o ON o.id = d.outbox_id \
         WHERE d.created_at < o.dispatched_at + make_interval(secs => $1)",
    )
    .bind(horizon.as_secs_f64())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(early, 0, "dead letters recorded before the horizon");
    // Meanwhile `outbox status` shows them as unaccounted once they pass the horizon, and so does the relay's
    // invocation summary, whose `backlog.unaccounted` is the `UnaccountedEvents` metric the alarm reads. The status
    // is asked with half the horizon: at the relay's own, the reconciler may dead-letter them (at its next
    // invocation past the horizon) before a poll on a loaded machine sees the window.
    let (mut status_saw, mut metric_saw) = (false, false);
    let deadline = tokio::time::Instant::now() + closes_within();
    while !(status_saw && metric_saw) && tokio::time::Instant::now() < deadline {
        status_saw |= outbox::ops::status_with_horizon(&pool, horizon / 2)
            .await
            .unwrap()
            .in_flight
            .unaccounted
            > 0;
        metric_saw |= stack
            .last_invocation()
            .is_some_and(|s| s.backlog.unaccounted > 0);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        status_saw,
        "`outbox status` never showed the events unaccounted"
    );
    assert!(metric_saw, "the UnaccountedEvents metric never moved");

    stack.set_callbacks_down(false);
    // Within a horizon or two every poison event has exactly one dead letter, through the reconciler (QStash will
    // never call the failure callback again: it gave up on it).
    let settled = eventually(closes_within(), || async {
        scalar(
            &pool,
            "SELECT count(DISTINCT outbox_id) FROM dead_letters WHERE resolved_at IS NULL",
        )
        .await
            == poison.len() as i64
    })
    .await;
    let per_event: BTreeMap<i64, i64> = sqlx::query_as::<_, (i64, i64)>(
        "SELECT outbox_id, count(*) FROM dead_letters WHERE resolved_at IS NULL GROUP BY outbox_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert!(
        settled,
        "dead letters per event: {per_event:?}, poison events {poison:?}; last relay invocation: {}",
        last_invocation(&stack)
    );
    assert_eq!(
        per_event.keys().copied().collect::<Vec<_>>(),
        poison,
        "exactly the poison events have a dead letter"
    );
    assert!(
        per_event.values().all(|n| *n == 1),
        "one dead letter per event: {per_event:?}"
    );
    // The callback never came again (QStash gave up on it): every one of them was recorded by the reconciler (its
    // totals are written when its pass ends).
    let totals = || async {
        let mut c = pool.acquire().await.unwrap();
        outbox::accounting::totals(&mut c, outbox::db::Statements::Prepared)
            .await
            .unwrap()
    };
    let recorded = eventually(Duration::from_secs(30), || async {
        totals().await.recorded_from_dlq >= poison.len() as i64
    })
    .await;
    let sources: Vec<(String, String)> =
        sqlx::query_as("SELECT source, natural_id FROM dead_letters ORDER BY outbox_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(
        recorded,
        "the reconciler recorded them: {:?}; dead letters {sources:?}",
        totals().await
    );
    assert_eq!(totals().await.recorded_from_dlq, poison.len() as i64);
    // Every healthy event was applied: nothing else is dead, nothing is in flight any more.
    assert!(
        eventually(Duration::from_secs(30), || async {
            scalar(
                &pool,
                "SELECT count(*) FROM outbox WHERE dispatched_at IS NOT NULL AND delivered_at IS NULL \
                 AND dead_lettered_at IS NULL",
            )
            .await
                == 0
        })
        .await,
        "events left in flight"
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM charges").await,
        9,
        "the nine healthy orders charged once each"
    );
    // Once nothing is in flight: every healthy event applied (an outcome of its own, no dead letter, never
    // published again), still exactly one dead letter per poison event.
    let healthy_without_outcome: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE id <> ALL ($1) AND (delivered_at IS NULL OR republish_count > 0)",
    )
    .bind(&poison)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        healthy_without_outcome,
        0,
        "healthy events not applied, or published again; {}",
        last_invocation(&stack)
    );
    let dead: Vec<i64> =
        sqlx::query_scalar("SELECT outbox_id FROM dead_letters ORDER BY outbox_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(dead, poison, "one dead letter per poison event, none other");
    stack.stop().await;
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn poison_events_get_one_dead_letter_each_through_the_reconciler_after_the_callback_receiver_was_down(
    pool: PgPool,
) {
    callback_receiver_down_then_up(pool, EvidenceMode::Consumer, 1).await;
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn the_reconciler_closes_batched_messages_and_callback_evidence_too(pool: PgPool) {
    callback_receiver_down_then_up(pool, EvidenceMode::Callback, 10).await;
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn an_accepted_message_qstash_lost_is_published_again_and_applied_once(pool: PgPool) {
    let mut opts = options(&pool, EvidenceMode::Consumer, 1);
    opts.dev.faults = Faults {
        message_loss_rate: 1.0,
        ..Default::default()
    };
    let stack = LocalStack::start(opts).await.unwrap();
    for n in 1..=3u64 {
        place_order(&stack.pool, n, false, None).await.unwrap();
    }
    // The relay publishes the six events; QStash accepts and loses every message.
    let dev = stack.dev.handle();
    assert!(
        eventually(Duration::from_secs(30), || async {
            scalar(
                &pool,
                "SELECT count(*) FROM outbox WHERE dispatched_at IS NOT NULL AND topic = 'audit'",
            )
            .await
                == 3
                && dev.lost_messages().len() >= 4
        })
        .await,
        "the events were not published"
    );
    dev.set_faults(Faults::default()).unwrap();
    // After the horizon the reconciler finds no trace of the unordered events' messages (not held, not in the DLQ)
    // and publishes them again; the ordered ones wait for their evidence timeout (600 s here), so only audit
    // events are checked.
    let applied = eventually(closes_within(), || async {
        scalar(&pool, "SELECT count(*) FROM audit_log").await == 3
    })
    .await;
    assert!(
        applied,
        "lost audit events were not published again: audit_log has {}",
        scalar(&pool, "SELECT count(*) FROM audit_log").await
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE topic = 'audit' AND republish_count = 1"
        )
        .await,
        3,
        "each lost audit event republished once"
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM (SELECT outbox_id FROM audit_log GROUP BY outbox_id HAVING count(*) > 1) t"
        )
        .await,
        0,
        "applied once each"
    );
    let totals = {
        let mut c = pool.acquire().await.unwrap();
        outbox::accounting::totals(&mut c, outbox::db::Statements::Prepared)
            .await
            .unwrap()
    };
    assert!(totals.republished >= 3, "{totals:?}");
    stack.stop().await;
}

/// The open (neither resolved nor redriven) dead letters of event `id`.
async fn open_dead_letters(pool: &PgPool, id: i64) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT id FROM dead_letters WHERE outbox_id = $1 AND resolved_at IS NULL AND redriven_at IS NULL \
         ORDER BY id",
    )
    .bind(id)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn an_event_lost_again_after_its_redrive_gets_one_open_dead_letter(pool: PgPool) {
    // QStash loses every message, and the reconciler publishes nothing again: a lost event becomes an
    // "unaccounted" dead letter after the horizon.
    let mut opts = options(&pool, EvidenceMode::Consumer, 1);
    opts.dev.faults = Faults {
        message_loss_rate: 1.0,
        ..Default::default()
    };
    opts.relay.accounting.max_republish = 0;
    let stack = LocalStack::start(opts).await.unwrap();
    let mut tx = stack.pool.begin().await.unwrap();
    let e = audit_event(
        "lost-twice",
        &AuditEntry {
            actor: "operator".into(),
            action: "lost".into(),
            details: serde_json::json!({}),
        },
    )
    .unwrap();
    let id = Producer::default()
        .enqueue_batch(&mut tx, &[e])
        .await
        .unwrap()[0]
        .id
        .get();
    tx.commit().await.unwrap();
    assert!(
        eventually(closes_within(), || async {
            open_dead_letters(&pool, id).await.len() == 1
        })
        .await,
        "the lost event got no dead letter; {}",
        last_invocation(&stack)
    );
    let first = open_dead_letters(&pool, id).await[0];

    // The operator redrives it (`outbox dead-letters redrive <id>`); QStash loses it again.
    let mut out = Vec::new();
    outbox_cli::dead_letters::run(
        DeadLettersCommand::Redrive(RedriveArgs {
            db: DbArgs {
                database_url: url_of(&pool),
            },
            id: Some(first.into()),
            filter: FilterArgs::default(),
            out_of_order: false,
            yes: true,
            json: false,
        }),
        &mut out,
        Confirm::NoTerminal,
    )
    .await
    .unwrap();
    // Lost again and past the horizon again: dead again, with a dead letter of its own, open (the redriven one
    // stays redriven). Never dead without one.
    let settled = eventually(closes_within(), || async {
        let dead: bool =
            sqlx::query_scalar("SELECT dead_lettered_at IS NOT NULL FROM outbox WHERE id = $1")
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap();
        dead && open_dead_letters(&pool, id)
            .await
            .iter()
            .any(|d| *d != first)
    })
    .await;
    let all: Vec<(i64, String, bool)> = sqlx::query_as(
        "SELECT id, natural_id, redriven_at IS NOT NULL FROM dead_letters WHERE outbox_id = $1 ORDER BY id",
    )
    .bind(id)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(
        settled,
        "after the redrive and a second loss: dead letters {all:?}; {}",
        last_invocation(&stack)
    );
    assert_eq!(open_dead_letters(&pool, id).await.len(), 1, "{all:?}");
    assert_eq!(all.len(), 2, "one redriven, one open: {all:?}");
    stack.stop().await;
}
