//! The relay against real Postgres and the QStash-compatible dev server: leases, fencing, backoff, budgets,
//! permanent errors, ambiguous publishes, crashes, concurrent relays and per-key order end to end.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering as AtomicOrdering};
use std::time::{Duration, Instant};

use outbox::db::Statements;
use outbox::internals::RelaySteps;
use outbox::internals::claim::ClaimStatements;
use outbox::internals::settle::{SettleItem, Settlement, settle};
use outbox::producer::{NewEvent, Topic, enqueue_batch};
use outbox_testkit::relaying::{RelayEnv, relay_config};
use qstash_dev::{Config as DevConfig, Faults, WaitlistOrder};
use serde_json::json;
use sqlx::{PgPool, Row};

const ORDERS: Topic = Topic::ordered("orders");
const AUDIT: Topic = Topic::unordered("audit");

fn fast() -> DevConfig {
    DevConfig {
        waitlist_order: WaitlistOrder::Shuffled,
        seed: 7,
        ..DevConfig::for_tests(0.0005)
    }
}

async fn enqueue_n(pool: &PgPool, topic: &Topic, keys: usize, per_key: usize) -> Vec<i64> {
    let mut events = Vec::new();
    for round in 0..per_key {
        for k in 0..keys {
            events.push(
                NewEvent::new(topic, format!("key-{k}"), &json!({"k": k, "round": round})).unwrap(),
            );
        }
    }
    let mut tx = pool.begin().await.unwrap();
    let out = enqueue_batch(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    out.into_iter().map(|e| e.id.get()).collect()
}

async fn scalar(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// The database's clock (`now()`, unix seconds): what leases and backoffs are measured on.
async fn db_epoch(pool: &PgPool) -> f64 {
    sqlx::query_scalar("SELECT extract(epoch FROM now())::float8")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn leased_rows_are_skipped_and_expired_leases_reclaimed(pool: PgPool) {
    enqueue_n(&pool, &AUDIT, 10, 1).await;
    let claims = ClaimStatements::new(100, Statements::Prepared);
    let mut a = pool.acquire().await.unwrap();
    // A lease long enough that no run of this test outlives it by accident...
    let first = claims.claim_unordered(&mut a, 600.0).await.unwrap();
    assert_eq!(first.len(), 10);
    assert!(first.iter().all(|e| e.attempts == 1));
    let again = claims.claim_unordered(&mut a, 0.3).await.unwrap();
    assert!(again.is_empty(), "leased rows must be skipped");
    // ...then aged past its end, as if the ten minutes had gone by (the lease end is `available_at`).
    sqlx::query(
        "UPDATE outbox SET available_at = now() - interval '1 ms', locked_until = now() - interval '1 ms'",
    )
    .execute(&mut *a)
    .await
    .unwrap();
    let reclaimed = claims.claim_unordered(&mut a, 10.0).await.unwrap();
    assert_eq!(reclaimed.len(), 10, "an expired lease is claimed again");
    assert!(
        reclaimed.iter().all(|e| e.attempts == 2),
        "attempts are counted at claim"
    );
    assert!(
        reclaimed[0].lease_token > first[0].lease_token,
        "a new lease gets a new token"
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_stale_relays_settle_changes_nothing(pool: PgPool) {
    enqueue_n(&pool, &AUDIT, 5, 1).await;
    enqueue_n(&pool, &ORDERS, 5, 2).await;
    let claims = ClaimStatements::new(100, Statements::Prepared);
    let mut conn = pool.acquire().await.unwrap();
    let mut stale = claims.claim_unordered(&mut conn, 0.2).await.unwrap();
    stale.extend(claims.claim_ordered(&mut conn, 0.2).await.unwrap());
    assert_eq!(stale.len(), 10);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut fresh = claims.claim_unordered(&mut conn, 30.0).await.unwrap();
    fresh.extend(claims.claim_ordered(&mut conn, 30.0).await.unwrap());
    assert_eq!(fresh.len(), 10);

    let as_items =
        |evs: &[outbox::internals::claim::ClaimedEvent], s: Settlement| -> Vec<SettleItem> {
            evs.iter()
                .map(|e| SettleItem {
                    id: e.id,
                    lease_token: e.lease_token,
                    settlement: s.clone(),
                })
                .collect()
        };
    // The zombie tries every kind of write: none lands.
    for s in [
        Settlement::Dispatched {
            message_id: "msg_zombie".into(),
        },
        Settlement::Retry {
            delay: Duration::from_secs(99),
            error: "zombie".into(),
        },
        Settlement::Dead {
            error: "zombie".into(),
            status: None,
            skip_key: false,
        },
    ] {
        let c = settle(
            &mut conn,
            &as_items(&stale, s),
            Duration::from_secs(60),
            Statements::Prepared,
        )
        .await
        .unwrap();
        assert_eq!(
            c.total(),
            0,
            "a settle with a taken-over lease must change 0 rows"
        );
    }
    assert_eq!(scalar(&pool, "SELECT count(*) FROM dead_letters").await, 0);
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE dispatched_at IS NOT NULL"
        )
        .await,
        0
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox_keys WHERE blocked_at IS NOT NULL"
        )
        .await,
        0
    );
    // The current owner's settle works.
    let c = settle(
        &mut conn,
        &as_items(
            &fresh,
            Settlement::Dispatched {
                message_id: "msg_ok".into(),
            },
        ),
        Duration::from_secs(60),
        Statements::Prepared,
    )
    .await
    .unwrap();
    assert_eq!(c.dispatched, 10);
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox_keys WHERE inflight_id IS NOT NULL"
        )
        .await,
        5
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn transient_failures_back_off_within_bounds_then_dead_letter_with_the_last_error(
    pool: PgPool,
) {
    // Failures that are about the events (a batch item's own 5xx): a QStash that fails every request as a whole
    // is an outage instead and spends nothing (tests/relay_outage.rs).
    let e = RelayEnv::start(pool.clone(), fast()).await;
    let ids = enqueue_n(&pool, &AUDIT, 3, 1).await;
    let mut cfg = relay_config();
    cfg.max_attempts = 3;
    let relay = e.relay_with(cfg);
    let item_5xx = || outbox::internals::qstash::PublishOutcome::Transient {
        status: Some(500),
        retry_after: None,
        error: "QStash answered 500: item failed".into(),
        config_problem: false,
    };
    let cycle = || async {
        let claimed = relay.claim().await.unwrap();
        let outcomes: Vec<_> = claimed.iter().map(|_| item_5xx()).collect();
        let items = relay.decide(&claimed, &outcomes);
        let settled = relay.settle(&items).await.unwrap();
        (claimed.len() as u64, settled)
    };

    // The settle's clock lies between these two readings of the database's, so each row's next attempt is due
    // between `before + 1 s` and `after + 60 s`, however long the cycle and the check take.
    let before = db_epoch(&pool).await;
    let (claimed, settled) = cycle().await;
    assert_eq!((claimed, settled.retried), (3, 3));
    let after = db_epoch(&pool).await;
    // attempt 1: window = min(3600, 30·2^1) = 60 s, floored at 1 s.
    let due: Vec<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM available_at)::float8 FROM outbox WHERE dispatched_at IS NULL",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(due.len(), 3);
    for d in &due {
        assert!(
            *d >= before + 0.999 && *d <= after + 60.001,
            "backoff outside [1, 60] s: due {d}, cycle between {before} and {after}"
        );
    }
    let err: String = sqlx::query_scalar("SELECT last_error FROM outbox LIMIT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(err.starts_with("attempt 1: QStash answered 500"), "{err}");

    e.make_due().await;
    assert_eq!(cycle().await.1.retried, 3);
    e.make_due().await;
    assert_eq!(
        cycle().await.1.dead,
        3,
        "the third attempt exhausts a budget of 3"
    );
    let rows = sqlx::query(
        "SELECT outbox_id, source, error, attempts, payload FROM dead_letters ORDER BY outbox_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 3);
    for (row, id) in rows.iter().zip(&ids) {
        assert_eq!(row.get::<i64, _>("outbox_id"), *id);
        assert_eq!(row.get::<String, _>("source"), "relay");
        assert_eq!(row.get::<i32, _>("attempts"), 3);
        let error: String = row.get("error");
        assert!(
            error.starts_with(
                "retry budget of 3 attempts exhausted; last error: QStash answered 500"
            ),
            "{error}"
        );
        assert!(
            row.get::<serde_json::Value, _>("payload")
                .get("k")
                .is_some()
        );
    }
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL"
        )
        .await,
        3
    );
    // Nothing left to claim.
    e.make_due().await;
    assert_eq!(relay.run_cycle().await.unwrap().claimed, 0);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_permanent_refusal_dead_letters_at_once_and_only_the_culprit(pool: PgPool) {
    let e = RelayEnv::start(
        pool.clone(),
        DevConfig {
            max_request_bytes: 4000,
            ..fast()
        },
    )
    .await;
    let mut tx = pool.begin().await.unwrap();
    let small = enqueue_batch(
        &mut tx,
        &(0..3)
            .map(|i| NewEvent::new(&AUDIT, "k", &json!({"i": i})).unwrap())
            .collect::<Vec<_>>(),
    )
    .await
    .unwrap();
    let big = enqueue_batch(
        &mut tx,
        &[NewEvent::new(&AUDIT, "k", &json!({"blob": "x".repeat(6000)})).unwrap()],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let relay = e.relay();
    let r = relay.run_cycle().await.unwrap();
    assert_eq!(r.claimed, 4);
    assert_eq!(
        (r.settled.dispatched, r.settled.dead, r.settled.retried),
        (3, 1, 0)
    );
    let (id, status, error, attempts): (i64, Option<i32>, String, i32) =
        sqlx::query_as("SELECT outbox_id, status, error, attempts FROM dead_letters")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(id, big[0].id.get());
    assert_eq!(status, Some(413));
    assert_eq!(attempts, 1, "a 4xx is not retried");
    assert!(!r.outage, "a refused message is no outage");
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox_relay_outage WHERE since IS NOT NULL"
        )
        .await,
        0
    );
    assert!(
        error.starts_with("QStash refused the message (HTTP 413)"),
        "{error}"
    );
    e.dev
        .handle()
        .wait_idle(Duration::from_secs(20))
        .await
        .unwrap();
    let got: HashSet<i64> = e.sink.accepted().iter().map(|s| s.outbox_id).collect();
    assert_eq!(got, small.iter().map(|s| s.id.get()).collect());
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_ambiguous_publish_yields_one_delivery(pool: PgPool) {
    let e = RelayEnv::start(pool.clone(), fast()).await;
    let ids = enqueue_n(&pool, &AUDIT, 5, 1).await;
    let relay = e.relay();
    // QStash stores the messages but the response never arrives.
    e.dev
        .handle()
        .set_faults(Faults {
            publish_drop_response_rate: 1.0,
            ..Default::default()
        })
        .unwrap();
    let r = relay.run_cycle().await.unwrap();
    // Every request failed at request level (no response at all): an outage, the claim given back unspent.
    assert_eq!(r.settled.released, 5, "a lost response is transient");
    assert!(r.outage);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM outbox WHERE attempts = 0").await,
        5
    );
    e.dev.handle().set_faults(Faults::default()).unwrap();
    e.make_due().await;
    let r = relay.run_cycle().await.unwrap();
    assert_eq!(r.settled.dispatched, 5);
    e.dev
        .handle()
        .wait_idle(Duration::from_secs(20))
        .await
        .unwrap();
    let stats = e.dev.handle().stats();
    assert_eq!(stats.accepted, 5);
    assert_eq!(
        stats.deduplicated, 5,
        "the retry carried the same deduplication id"
    );
    let mut got: Vec<i64> = e.sink.accepted().iter().map(|s| s.outbox_id).collect();
    got.sort();
    assert_eq!(got, ids, "exactly one delivery per event");
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_relay_killed_after_claim_or_after_publish_loses_nothing(pool: PgPool) {
    let e = RelayEnv::start(pool.clone(), fast()).await;
    let ids = enqueue_n(&pool, &AUDIT, 6, 1).await;
    let ordered = enqueue_n(&pool, &ORDERS, 3, 2).await;
    let relay = e.relay();

    // Killed right after its claim: the lease expires, another cycle publishes.
    let claimed = relay.claim().await.unwrap();
    assert_eq!(claimed.len(), 9);
    drop(claimed);
    // Killed after publishing, before settling.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let claimed = relay.claim().await.unwrap();
    assert_eq!(claimed.len(), 9, "every expired lease is claimed again");
    let (outcomes, _) = relay.publish(&claimed).await;
    assert!(outcomes.iter().all(|o| matches!(
        o,
        outbox::internals::qstash::PublishOutcome::Accepted { .. }
    )));
    drop(claimed);
    tokio::time::sleep(Duration::from_millis(1100)).await;

    // A healthy relay finishes the job.
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        relay.run_cycle().await.unwrap();
        let done = scalar(&pool, "SELECT count(*) FROM outbox WHERE dispatched_at IS NOT NULL AND (seq IS NULL OR delivered_at IS NOT NULL)").await;
        if done == 12 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    e.dev
        .handle()
        .wait_idle(Duration::from_secs(20))
        .await
        .unwrap();
    let accepted = e.sink.accepted();
    let mut per_id: HashMap<i64, usize> = HashMap::new();
    for s in &accepted {
        *per_id.entry(s.outbox_id).or_default() += 1;
    }
    for id in ids.iter().chain(&ordered) {
        assert_eq!(
            per_id.get(id),
            Some(&1),
            "event {id} delivered exactly once: {per_id:?}"
        );
    }
    assert_eq!(scalar(&pool, "SELECT count(*) FROM dead_letters").await, 0);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn two_relays_never_hold_the_same_key(pool: PgPool) {
    enqueue_n(&pool, &ORDERS, 100, 3).await;
    let claims = ClaimStatements::new(1000, Statements::Prepared);
    let (mut c1, mut c2) = (pool.acquire().await.unwrap(), pool.acquire().await.unwrap());
    let (a, b) = tokio::join!(
        claims.claim_ordered(&mut c1, 30.0),
        claims.claim_ordered(&mut c2, 30.0)
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(
        a.len() + b.len(),
        100,
        "one head per key, every key claimed once"
    );
    let ka: HashSet<&str> = a.iter().map(|e| e.partition_key.as_str()).collect();
    let kb: HashSet<&str> = b.iter().map(|e| e.partition_key.as_str()).collect();
    assert_eq!(ka.len(), a.len());
    assert!(ka.is_disjoint(&kb), "two relays held the same key");
    assert!(
        a.iter().chain(&b).all(|e| e.seq == Some(1)),
        "only heads are claimed"
    );
    // While the heads are leased, nothing of those keys is claimable.
    assert!(
        claims
            .claim_ordered(&mut c1, 30.0)
            .await
            .unwrap()
            .is_empty()
    );
}

/// Two relays drain ordered keys concurrently while the dev server shuffles its flow-control waitlist and the
/// consumer fails some deliveries (QStash retries them). Every key must arrive in sequence order, and no event of
/// a key may be delivered before its predecessor was delivered successfully.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn ordered_keys_arrive_in_sequence_under_shuffling_retries_and_two_relays(pool: PgPool) {
    let e = RelayEnv::start(pool.clone(), DevConfig { seed: 11, ..fast() }).await;
    let keys = 30;
    let per_key = 8;
    enqueue_n(&pool, &ORDERS, keys, per_key).await;
    enqueue_n(&pool, &AUDIT, 40, 2).await;
    let failures = Arc::new(AtomicU32::new(0));
    let f = failures.clone();
    e.sink.set_policy(move |s| {
        // Fail the first one or two attempts of about a third of the events.
        if s.outbox_id % 3 == 0 && s.retried < (s.outbox_id % 2 + 1) as u32 {
            f.fetch_add(1, AtomicOrdering::Relaxed);
            500
        } else {
            200
        }
    });
    let (r1, r2) = (e.relay(), e.relay());
    let total = (keys * per_key + 80) as i64;
    let started = Instant::now();
    loop {
        let until = Instant::now() + Duration::from_millis(2500);
        let (a, b) = tokio::join!(r1.drain(until), r2.drain(until));
        a.unwrap();
        b.unwrap();
        let done = scalar(&pool, "SELECT count(*) FROM outbox WHERE dispatched_at IS NOT NULL AND (seq IS NULL OR delivered_at IS NOT NULL)").await;
        if done == total {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "only {done}/{total} events finished"
        );
    }
    e.dev
        .handle()
        .wait_idle(Duration::from_secs(20))
        .await
        .unwrap();
    assert!(
        failures.load(AtomicOrdering::Relaxed) > 20,
        "the scenario must include retried deliveries"
    );

    let seen = e.sink.seen();
    let mut by_key: HashMap<String, Vec<&outbox_testkit::sink::Seen>> = HashMap::new();
    for s in seen.iter().filter(|s| s.topic == "orders") {
        by_key.entry(s.key.clone()).or_default().push(s);
    }
    assert_eq!(by_key.len(), keys);
    for (key, deliveries) in &by_key {
        // Successful deliveries: exactly 1..=per_key, in order.
        let ok: Vec<i64> = deliveries
            .iter()
            .filter(|s| s.status == 200)
            .filter_map(|s| s.seq)
            .collect();
        assert_eq!(
            ok,
            (1..=per_key as i64).collect::<Vec<_>>(),
            "key {key} applied out of order: {ok:?}"
        );
        // No attempt of seq n+1 before seq n was delivered successfully.
        let mut delivered_upto = 0;
        for s in deliveries {
            let seq = s.seq.unwrap_or(0);
            assert!(
                seq <= delivered_upto + 1,
                "key {key}: seq {seq} attempted while {} not yet delivered",
                delivered_upto + 1
            );
            if s.status == 200 {
                delivered_upto = seq;
            }
        }
    }
    assert_eq!(
        e.sink.max_in_flight_per_key(),
        1,
        "two deliveries of one ordered key were in flight at once"
    );
    assert_eq!(scalar(&pool, "SELECT count(*) FROM dead_letters").await, 0);
}

/// The drain never claims with less than a lease left before its deadline, so everything it claimed is settled
/// when it returns, and it stops by itself. Asserted on what it did, not on how long it took: a slow machine
/// may need more drains, never a faster clock.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn the_drain_loop_stops_before_the_deadline(pool: PgPool) {
    let e = RelayEnv::start(pool.clone(), fast()).await;
    enqueue_n(&pool, &AUDIT, 20, 1).await;
    let relay = e.relay();
    let lease = relay_config().lease;
    // Drains with a little more than a lease to go, until all 20 are out (the limit only stops a hung test).
    let hung = Instant::now() + Duration::from_secs(90);
    let mut dispatched = 0;
    while dispatched < 20 {
        assert!(Instant::now() < hung, "only {dispatched}/20 dispatched");
        let summary = tokio::time::timeout(
            Duration::from_secs(60),
            relay.drain(Instant::now() + lease + Duration::from_millis(300)),
        )
        .await
        .expect("the drain stops by itself")
        .unwrap();
        assert_eq!(summary.stopped, "deadline");
        assert_eq!(
            scalar(
                &pool,
                "SELECT count(*) FROM outbox WHERE locked_until IS NOT NULL"
            )
            .await,
            0,
            "the drain returned with a claim unsettled: {summary:?}"
        );
        dispatched += summary.dispatched;
    }
    assert_eq!(dispatched, 20);
    // With less time left than the lease, it does not claim at all.
    enqueue_n(&pool, &AUDIT, 5, 1).await;
    let summary = relay
        .drain(Instant::now() + lease - Duration::from_millis(100))
        .await
        .unwrap();
    assert_eq!(
        (summary.cycles, summary.claimed),
        (0, 0),
        "claimed with less time left than the lease"
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM outbox WHERE attempts = 0").await,
        5,
        "the new events were not touched"
    );
}
