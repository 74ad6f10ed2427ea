//! The whole system under faults: Postgres, the QStash-compatible dev server (failing publishes, lost publish
//! responses, duplicate deliveries, network errors, a shuffled flow-control waitlist, QStash retries), the relay
//! through its Lambda handler, and the real consumer and callback handlers behind the local function-URL adapter.
//! Every guarantee is checked at once: nothing lost, nothing applied twice, per-key order, nothing silent.

use std::collections::HashMap;
use std::time::Duration;

use orders_example::demo::place_order;
use outbox::config::EvidenceMode;
use outbox_testkit::db::url_of;
use outbox_testkit::stack::{LocalStack, StackOptions};
use qstash_dev::{AttemptKind, Faults, WaitlistOrder};
use sqlx::PgPool;

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn every_guarantee_holds_end_to_end_under_faults(pool: PgPool) {
    run_scenario(pool, EvidenceMode::Callback).await;
}

/// The same with ordered delivery evidence recorded by the consumer in its own transaction
/// (`RELAY_ORDERED_EVIDENCE=consumer`): no delivery callbacks at all, same guarantees.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn every_guarantee_holds_with_evidence_recorded_by_the_consumer(pool: PgPool) {
    run_scenario(pool, EvidenceMode::Consumer).await;
}

/// The dev server's seed: `PIPELINE_SEED`, else 42. A failing run prints it. Fault draws are a function of the
/// seed and of each message or publish request (decision record 0114), so the same seed injects the same faults
/// into the same events; what timing still changes is which events the relay batches together (a batch request
/// draws on its items) and the order of the shuffled waitlist.
fn seed() -> u64 {
    match std::env::var("PIPELINE_SEED") {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("PIPELINE_SEED must be an unsigned integer, got {v:?}")),
        Err(_) => 42,
    }
}

/// Prints how to replay a run that fails (panics) while this is alive.
struct ReplayHint {
    seed: u64,
    mode: EvidenceMode,
}

impl Drop for ReplayHint {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "pipeline run ({:?} evidence) failed with seed {seed}; replay its faults with \
                 PIPELINE_SEED={seed} cargo test -p outbox-system --test pipeline",
                self.mode,
                seed = self.seed
            );
        }
    }
}

async fn run_scenario(pool: PgPool, mode: EvidenceMode) {
    let seed = seed();
    let _hint = ReplayHint { seed, mode };
    eprintln!("pipeline run ({mode:?} evidence): seed {seed}");
    let mut opts = StackOptions::new(&url_of(&pool)).unwrap();
    opts.relay.ordered_evidence = mode;
    opts.dev.time_scale = 0.005;
    opts.dev.seed = seed;
    opts.dev.waitlist_order = WaitlistOrder::Shuffled;
    opts.dev.faults = Faults {
        publish_5xx_rate: 0.15,
        publish_drop_response_rate: 0.10,
        duplicate_delivery_rate: 0.25,
        delivery_network_error_rate: 0.05,
        delivery_lost_response_rate: 0.05,
        // Faults QStash rides out: with 10 % of attempts failing, one of ~170 messages lost all four attempts about
        // once in a hundred runs (a CI run saw it: QStash dead-lettered an event whose lost response hid that it
        // was applied, so applied + dead exceeded the events by one). Exhausted retries have their own tests.
        spare_final_attempt: true,
        ..Default::default()
    };
    // Small batches: enough publish requests (~90) that the seeded publish faults are sure to hit some of them
    // (with 100 per batch, a run could see a dozen requests and, by chance, no dropped response).
    opts.qstash_batch_size = 2;
    opts.relay.lease = Duration::from_secs(2);
    opts.relay.poll_interval = Duration::from_millis(20);
    opts.invocation = Duration::from_secs(5);
    let stack = LocalStack::start(opts).await.unwrap();

    // 80 orders: every 20th is poison; every 10th cancels the order placed 3 before it (same key, so the
    // cancellation must be applied after the placement).
    let orders = 80u64;
    let mut poison = Vec::new();
    let mut cancelled = Vec::new();
    for n in 1..=orders {
        let is_poison = n % 20 == 0;
        let cancel = (n % 10 == 0 && (n - 3) % 20 != 0).then(|| n - 3);
        if is_poison {
            poison.push(format!("order-{n}"));
        }
        if let Some(c) = cancel {
            cancelled.push(format!("order-{c}"));
        }
        place_order(&stack.pool, n, is_poison, cancel)
            .await
            .unwrap();
    }
    assert!(
        stack.wait_quiet(Duration::from_secs(120)).await,
        "the pipeline did not drain"
    );

    let scalar = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let events = scalar("SELECT count(*) FROM outbox").await;
    let stats = stack.dev.handle().stats();
    assert!(
        stats.duplicate_deliveries > 0
            && stats.injected_publish_errors > 0
            && stats.injected_dropped_responses > 0,
        "the faults must actually have happened (seed {seed}): {stats:?}"
    );

    // No side effect twice: one charge per good order, one audit row per audit event, despite duplicates.
    let good = orders as i64 - poison.len() as i64;
    assert_eq!(scalar("SELECT count(*) FROM charges").await, good);
    assert_eq!(
        scalar("SELECT count(DISTINCT order_id) FROM charges").await,
        good
    );
    assert_eq!(scalar("SELECT count(*) FROM shipments").await, good);
    assert_eq!(
        scalar("SELECT count(*) FROM audit_log").await,
        orders as i64
    );
    // No loss: every event applied or dead-lettered.
    let applied = scalar("SELECT count(*) FROM processed_messages").await;
    let dead = scalar("SELECT count(*) FROM dead_letters").await;
    assert_eq!(
        applied + dead,
        events,
        "applied {applied} + dead {dead} != enqueued {events}"
    );
    // Nothing silent: exactly the poison orders are dead letters, from QStash, with the consumer's 489.
    let dead_keys: Vec<(String, String, Option<i32>)> = sqlx::query_as(
        "SELECT partition_key, source, status FROM dead_letters ORDER BY partition_key",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut expected = poison.clone();
    expected.sort();
    assert_eq!(
        dead_keys.iter().map(|d| d.0.clone()).collect::<Vec<_>>(),
        expected
    );
    assert!(
        dead_keys
            .iter()
            .all(|d| d.1 == "qstash" && d.2 == Some(489)),
        "{dead_keys:?}"
    );
    assert_eq!(
        scalar("SELECT count(*) FROM outbox_keys WHERE blocked_at IS NOT NULL").await,
        poison.len() as i64
    );
    // Order: every cancellation was applied after its placement.
    for order in &cancelled {
        let (charge, shipment): (String, String) = sqlx::query_as(
            "SELECT c.status, s.status FROM charges c JOIN shipments s USING (order_id) WHERE order_id = $1",
        )
        .bind(order)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            (charge.as_str(), shipment.as_str()),
            ("refunded", "cancelled"),
            "{order}"
        );
    }
    // And the strong form: no delivery attempt of an ordered event before its predecessor was delivered.
    let mut seq_of: HashMap<String, (String, i64)> = HashMap::new();
    for (id, key, seq) in sqlx::query_as::<_, (i64, String, i64)>(
        "SELECT id, partition_key, seq FROM outbox WHERE seq IS NOT NULL",
    )
    .fetch_all(&pool)
    .await
    .unwrap()
    {
        seq_of.insert(id.to_string(), (key, seq));
    }
    let mut delivered_upto: HashMap<String, i64> = HashMap::new();
    for a in stack
        .dev
        .handle()
        .attempts()
        .iter()
        .filter(|a| a.kind == AttemptKind::Destination)
    {
        // Every event went out in the signed contract (decision record 0025).
        assert!(
            a.url.ends_with("?contract=2") && a.url.contains("/events/"),
            "{}",
            a.url
        );
        // The attempt log keeps headers, not bodies: the outbox id is the informational x-outbox-id copy, which
        // the consumer refuses to see disagree with the signed envelope.
        let Some(id) = a
            .request_headers
            .iter()
            .find(|(k, _)| k == "x-outbox-id")
            .map(|(_, v)| v.clone())
        else {
            continue;
        };
        let Some((key, seq)) = seq_of.get(&id).cloned() else {
            continue;
        };
        let upto = delivered_upto.entry(key.clone()).or_default();
        assert!(
            seq <= *upto + 1,
            "key {key}: seq {seq} attempted before seq {} was delivered",
            *upto + 1
        );
        if a.status.is_some_and(|s| (200..300).contains(&s)) && seq == *upto + 1 {
            *upto = seq;
        }
    }
    let callbacks = stack
        .dev
        .handle()
        .attempts()
        .iter()
        .filter(|a| a.kind == AttemptKind::Callback)
        .count();
    match mode {
        EvidenceMode::Callback => assert!(callbacks > 0, "ordered events carry delivery callbacks"),
        EvidenceMode::Consumer => assert_eq!(
            callbacks, 0,
            "the consumer records the evidence: no callbacks"
        ),
    }
    stack.stop().await;
}
