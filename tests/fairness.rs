//! Fairness between tenants (decision record 0076) on the whole local system: Postgres, the QStash-compatible dev
//! server, the relay through its Lambda handler, the real consumer and callback receivers.
//!
//! * **A flood does not delay the others.** Tenant `bulk` writes 2,000 events, then five tenants write five
//!   each: their events are claimed within the relay's first round of claims and applied long before the flood
//!   is — and with fair claims switched off (`RELAY_FAIR_CLAIMS=false`) the same run breaks that bound.
//! * **Pause and resume.** A paused tenant's events (unordered and ordered) wait in the outbox while everyone
//!   else's flow; resumed, they are applied, an ordered key in sequence.
//! * **A tenant's rate.** A topic with per-tenant limits (`RELAY_TENANT_LIMITS=audit:rate=5,period=1s`): the dev
//!   server starts at most 5 deliveries of that tenant per second, while another tenant is not held back.

use std::collections::BTreeMap;
use std::time::Duration;

use orders_example::{AuditEntry, LineItem, OrderEvent, OrderPlaced, audit_event, order_event};
use outbox::config::TenantLimits;
use outbox_testkit::db::{enqueue_committed as enqueue, url_of};
use outbox_testkit::stack::{LocalStack, StackOptions};
use qstash_dev::AttemptKind;
use serde_json::{Value, json};
use sqlx::PgPool;

/// Rows per claim and claims in flight in these runs: the fairness bound is written in them.
const BATCH: u32 = 50;
const CONCURRENCY: u32 = 2;

fn audit(tenant: &str, i: usize) -> outbox::NewEvent {
    audit_event(
        tenant,
        &AuditEntry {
            actor: tenant.into(),
            action: format!("import-{i}"),
            details: json!({"i": i}),
        },
    )
    .unwrap()
    .fairness_key(tenant)
}

fn order(tenant: &str, order_id: &str) -> outbox::NewEvent {
    order_event(&OrderEvent::OrderPlaced(OrderPlaced {
        order_id: order_id.into(),
        customer_id: tenant.into(),
        amount_cents: 100,
        currency: "EUR".into(),
        items: vec![LineItem {
            sku: "sku-1".into(),
            quantity: 1,
        }],
    }))
    .unwrap()
    .fairness_key(tenant)
}

fn options(pool: &PgPool) -> StackOptions {
    let mut opts = StackOptions::new(&url_of(pool)).unwrap();
    opts.relay.batch_size = BATCH;
    opts.relay.concurrency = CONCURRENCY;
    opts.relay.poll_interval = Duration::from_millis(50);
    opts
}

/// Applied events of `tenant` (by the default consumer).
async fn applied(pool: &PgPool, tenant: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox o JOIN processed_messages p ON p.message_id = o.id::text \
         WHERE o.fairness_key = $1",
    )
    .bind(tenant)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Waits until `n` events of `tenant` are applied.
async fn wait_applied(pool: &PgPool, tenant: &str, n: i64, timeout: Duration) {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let done = applied(pool, tenant).await;
        if done >= n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{done} of {n} events of {tenant} applied after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What one flood run measured: for the small tenants' last event, how many of the flood's events were claimed
/// before it was, and how many were applied before it was.
#[derive(Debug)]
struct FloodRun {
    claimed_before: i64,
    applied_before: i64,
    flood_applied: i64,
}

async fn flood_run(pool: PgPool, fair: bool) -> FloodRun {
    // Everything is written before the relay starts, flood first: the first claim sees the whole backlog.
    let flood: Vec<outbox::NewEvent> = (0..2000).map(|i| audit("bulk", i)).collect();
    enqueue(&pool, &flood).await;
    for t in 1..=5 {
        let small: Vec<outbox::NewEvent> = (0..5).map(|i| audit(&format!("t{t}"), i)).collect();
        enqueue(&pool, &small).await;
    }
    let mut opts = options(&pool);
    opts.relay.fairness.fair_claims = fair;
    // Several events per message, as the measured flood had: each tenant's messages in a lane of its own.
    opts.relay.batching.default_n = 10;
    let stack = LocalStack::start(opts).await.unwrap();
    for t in 1..=5 {
        wait_applied(&pool, &format!("t{t}"), 5, Duration::from_secs(120)).await;
    }
    let (claimed_before, applied_before): (i64, i64) = sqlx::query_as(
        "WITH last AS ( \
           SELECT max(o.first_claimed_at) AS claimed, max(p.processed_at) AS applied \
           FROM outbox o JOIN processed_messages p ON p.message_id = o.id::text \
           WHERE o.fairness_key LIKE 't_') \
         SELECT (SELECT count(*) FROM outbox o, last \
                 WHERE o.fairness_key = 'bulk' AND o.first_claimed_at < last.claimed), \
                (SELECT count(*) FROM outbox o JOIN processed_messages p ON p.message_id = o.id::text, last \
                 WHERE o.fairness_key = 'bulk' AND p.processed_at < last.applied)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        stack.wait_quiet(Duration::from_secs(180)).await,
        "the flood did not drain"
    );
    let flood_applied = applied(&pool, "bulk").await;
    stack.stop().await;
    FloodRun {
        claimed_before,
        applied_before,
        flood_applied,
    }
}

/// The bound: the small tenants' events are claimed in the relay's first round of claims (one per cycle in flight),
/// so at most that round's rows of the flood are claimed before them; while they are delivered the relay keeps
/// claiming, so the flood's events applied before them are bounded by a few rounds, far below the flood.
fn claim_bound() -> i64 {
    i64::from(BATCH * CONCURRENCY)
}

fn applied_bound() -> i64 {
    4 * claim_bound()
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_flood_of_one_tenant_does_not_delay_the_others_beyond_the_first_claims(pool: PgPool) {
    let run = flood_run(pool, true).await;
    eprintln!("fair claims: {run:?}");
    assert_eq!(run.flood_applied, 2000, "{run:?}");
    assert!(
        run.claimed_before <= claim_bound(),
        "{} of the flood claimed before the others' last event (bound {}): {run:?}",
        run.claimed_before,
        claim_bound()
    );
    assert!(
        run.applied_before <= applied_bound(),
        "{} of the flood applied before the others' last event (bound {}): {run:?}",
        run.applied_before,
        applied_bound()
    );
}

/// The same run with fair claims switched off breaks both bounds: the check above can fail.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn without_fair_claims_the_same_flood_delays_the_others_past_the_bound(pool: PgPool) {
    let run = flood_run(pool, false).await;
    eprintln!("oldest-first claims: {run:?}");
    assert_eq!(run.flood_applied, 2000, "{run:?}");
    assert!(run.claimed_before > claim_bound(), "{run:?}");
    assert!(run.applied_before > applied_bound(), "{run:?}");
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_paused_tenant_waits_and_resumes_in_order_while_the_others_flow(pool: PgPool) {
    let mut opts = options(&pool);
    opts.record_requests = true;
    let stack = LocalStack::start(opts).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    outbox::fairness::pause(&mut conn, "noisy", "test", Some("bulk import"))
        .await
        .unwrap();
    let noisy_orders = enqueue(
        &pool,
        &[
            order("noisy", "o-1"),
            order("noisy", "o-1"),
            order("noisy", "o-1"),
        ],
    )
    .await;
    let noisy_audit = enqueue(
        &pool,
        &(0..10).map(|i| audit("noisy", i)).collect::<Vec<_>>(),
    )
    .await;
    enqueue(
        &pool,
        &(0..10).map(|i| audit("quiet", i)).collect::<Vec<_>>(),
    )
    .await;
    enqueue(&pool, &[order("quiet", "o-2")]).await;
    wait_applied(&pool, "quiet", 11, Duration::from_secs(60)).await;
    // The others are through with the paused tenant's events still waiting: a few more claims to be sure.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        applied(&pool, "noisy").await,
        0,
        "a paused tenant's event was applied"
    );
    let backlog = outbox::fairness::backlog(&mut conn, None, 10)
        .await
        .unwrap();
    let noisy = backlog.iter().find(|b| b.fairness_key == "noisy").unwrap();
    assert_eq!(
        (noisy.pending, noisy.paused_by.as_deref()),
        (13, Some("test")),
        "{backlog:?}"
    );

    let resumed = outbox::fairness::resume(&mut conn, "noisy").await.unwrap();
    assert_eq!((resumed.changed, resumed.events), (true, 10));
    wait_applied(&pool, "noisy", 13, Duration::from_secs(60)).await;
    // The ordered key's events were applied in sequence.
    let order_applied: Vec<i64> = sqlx::query_scalar(
        "SELECT o.id FROM outbox o JOIN processed_messages p ON p.message_id = o.id::text \
         WHERE o.id = ANY($1) ORDER BY p.processed_at, o.seq",
    )
    .bind(&noisy_orders)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(order_applied, noisy_orders);
    assert_eq!(noisy_audit.len(), 10);
    // The consumer saw each event's fairness key in the signed envelope.
    let mut keys: BTreeMap<String, usize> = BTreeMap::new();
    for r in stack.recorded_requests() {
        let Ok(body) = serde_json::from_slice::<Value>(&r.body) else {
            continue;
        };
        for ev in body["events"].as_array().into_iter().flatten() {
            if let Some(k) = ev["headers"]["x-outbox-fairness-key"].as_str() {
                *keys.entry(k.to_owned()).or_insert(0) += 1;
            }
        }
    }
    assert!(keys.get("noisy").copied().unwrap_or(0) >= 13, "{keys:?}");
    assert!(keys.get("quiet").copied().unwrap_or(0) >= 11, "{keys:?}");
    stack.stop().await;
}

/// First delivery attempts of each flow-control key, as the dev server started them: (key, offset from server
/// start).
fn delivery_starts(stack: &LocalStack) -> Vec<(String, Duration)> {
    stack
        .dev
        .handle()
        .attempts()
        .into_iter()
        .filter(|a| a.kind == AttemptKind::Destination && a.retried == 0)
        .filter_map(|a| Some((a.flow_control_key?, a.offset)))
        .collect()
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn each_tenants_rate_limit_holds_at_the_dev_server_in_a_key_of_its_own(pool: PgPool) {
    const RATE: usize = 5;
    let mut opts = options(&pool);
    opts.relay.fairness.limits =
        TenantLimits::parse(&format!("audit:rate={RATE},period=1s")).unwrap();
    // One event per message: QStash's limits count messages (a message of n events is one delivery).
    opts.relay.batching.default_n = 1;
    let stack = LocalStack::start(opts).await.unwrap();
    enqueue(
        &pool,
        &(0..20).map(|i| audit("limited", i)).collect::<Vec<_>>(),
    )
    .await;
    enqueue(
        &pool,
        &(0..20).map(|i| audit("free", i)).collect::<Vec<_>>(),
    )
    .await;
    let unkeyed: Vec<outbox::NewEvent> = (0..20)
        .map(|i| {
            let entry = AuditEntry {
                actor: "unkeyed".into(),
                action: format!("a-{i}"),
                details: json!({"i": i}),
            };
            audit_event("unkeyed", &entry).unwrap()
        })
        .collect();
    enqueue(&pool, &unkeyed).await;
    wait_applied(&pool, "free", 20, Duration::from_secs(60)).await;
    wait_applied(&pool, "", 20, Duration::from_secs(60)).await;
    wait_applied(&pool, "limited", 20, Duration::from_secs(60)).await;
    // An attempt is logged when its response arrives, after the consumer committed: wait for the last ones.
    stack
        .dev
        .handle()
        .wait_idle(Duration::from_secs(30))
        .await
        .expect("the dev server goes idle");

    let starts = delivery_starts(&stack);
    let of = |t: &str| -> Vec<Duration> {
        let mut v: Vec<Duration> = starts
            .iter()
            .filter(|(k, _)| k == t)
            .map(|(_, o)| *o)
            .collect();
        v.sort();
        v
    };
    let limited = of("audit.tenant-limited");
    assert_eq!(limited.len(), 20);
    // At most RATE starts in any window of one period (the dev server's windows are fixed from the first grant;
    // a sliding window of one period may hold at most two windows' share, so check the fixed ones and the span).
    let first = limited[0];
    let mut per_window: BTreeMap<u128, usize> = BTreeMap::new();
    for o in &limited {
        *per_window
            .entry((*o - first).as_millis() / 1000)
            .or_insert(0) += 1;
    }
    assert!(per_window.values().all(|&n| n <= RATE), "{per_window:?}");
    let span = *limited.last().unwrap() - first;
    let min_span = Duration::from_secs((20 / RATE - 1) as u64);
    assert!(
        span >= min_span,
        "20 deliveries at {RATE}/s took only {span:?}"
    );
    // The other tenant has the same limit in a key of its own: it ran beside the first, not after it.
    let free = of("audit.tenant-free");
    assert_eq!(free.len(), 20);
    assert!(
        free[0] < limited[0] + Duration::from_secs(1),
        "{free:?} {limited:?}"
    );
    // Events without a fairness key keep the topic's usual flow control: not held to the tenants' rate.
    let unkeyed = of("audit.unkeyed");
    assert_eq!(unkeyed.len(), 20);
    let unkeyed_span = *unkeyed.last().unwrap() - unkeyed[0];
    assert!(
        unkeyed_span < min_span,
        "events without a key took {unkeyed_span:?}"
    );

    // QStash's own view of the tenant's flow-control key.
    let info =
        outbox_testkit::dev_api::get(&stack.dev, "/v2/flowControl/audit.tenant-limited").await;
    assert_eq!(info["rateMax"], RATE, "{info}");
    stack.stop().await;
}
