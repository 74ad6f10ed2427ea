//! Batched deliveries, relay side (decision record 0014), against real Postgres and the QStash-compatible dev
//! server: an ordered key's consecutive events go out as one message only as evidence arrives; unordered events
//! are grouped per topic up to each topic's N and under the size limit; deduplication ids follow a message's
//! composition; a permanent refusal of a batch falls back to single events; a crash between publish and settle
//! re-forms the same message. Evidence is simulated with `ordering::record_delivery` for every event of a
//! message in one transaction (what the delivery callback does for a batch).

use std::collections::HashMap;
use std::time::Duration;

use outbox::OutboxId;
use outbox::config::{DeliveryBatching, EvidenceMode, RelayConfig};
use outbox::db::Statements;
use outbox::internals::RelaySteps;
use outbox::internals::qstash::flow_control_key;
use outbox::producer::{NewEvent, Topic};
use outbox::relay::Relay;
use outbox_testkit::db::enqueue_committed as enqueue;
use outbox_testkit::relaying::{self, RelayEnv};
use qstash_dev::Config as DevConfig;
use serde_json::{Value, json};
use sqlx::PgPool;

const ORDERS: Topic = Topic::ordered("orders");
const AUDIT: Topic = Topic::unordered("audit");
const METRICS: Topic = Topic::unordered("metrics");

/// The relay tests' settings with evidence recorded by this test only (no delivery callbacks; the timeout long
/// enough never to republish) and `batching`.
fn relay_config(batching: DeliveryBatching) -> RelayConfig {
    RelayConfig {
        evidence_timeout: Duration::from_secs(600),
        ordered_evidence: EvidenceMode::Consumer,
        batching,
        ..relaying::relay_config()
    }
}

fn batching(default_n: u32, topics: &[(&str, u32)], max_message_bytes: usize) -> DeliveryBatching {
    DeliveryBatching {
        default_n,
        topics: topics.iter().map(|(t, n)| ((*t).to_owned(), *n)).collect(),
        max_message_bytes,
    }
}

/// A relay with `batching` and no QStash retries.
fn batching_relay(e: &RelayEnv, batching: DeliveryBatching) -> Relay {
    e.relay_with_qstash(relay_config(batching), e.qstash(0))
}

/// The messages the consumer received, in arrival order: each one's event ids and its `x-outbox-id` copy.
async fn delivered(e: &RelayEnv) -> Vec<(Vec<i64>, String)> {
    e.dev
        .handle()
        .wait_idle(Duration::from_secs(20))
        .await
        .unwrap();
    e.sink
        .seen()
        .iter()
        .map(|s| {
            let v: Value = serde_json::from_slice(&s.body).unwrap();
            let ids = v["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["id"].as_i64().unwrap())
                .collect();
            (
                ids,
                s.headers.get("x-outbox-id").cloned().unwrap_or_default(),
            )
        })
        .collect()
}

/// Delivery evidence for every event of a message, in one transaction.
async fn evidence(e: &RelayEnv, ids: &[i64]) {
    let mut tx = e.pool.begin().await.unwrap();
    for id in ids {
        outbox::internals::ordering::record_delivery(&mut tx, OutboxId(*id), Statements::Prepared)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
}

/// Ends every lease now (as if it had run out), without waiting.
async fn expire_leases(e: &RelayEnv) {
    sqlx::query("UPDATE outbox SET available_at = least(available_at, now() - interval '1 ms'), locked_until = now() - interval '1 ms' WHERE dispatched_at IS NULL")
        .execute(&e.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE outbox_keys SET available_at = now() - interval '1 ms', locked_until = now() - interval '1 ms'")
        .execute(&e.pool)
        .await
        .unwrap();
}

fn dev() -> DevConfig {
    DevConfig::for_tests(0.0005)
}

fn joined(ids: &[i64]) -> String {
    ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_ordered_key_goes_out_in_runs_of_n_only_as_evidence_arrives(pool: PgPool) {
    let e = RelayEnv::start(pool.clone(), dev()).await;
    let ids = enqueue(
        &pool,
        &(0..7)
            .map(|i| NewEvent::new(&ORDERS, "k", &json!({"i": i})).unwrap())
            .collect::<Vec<_>>(),
    )
    .await;
    let relay = batching_relay(&e, batching(1, &[("orders", 3)], 1_000_000));

    let mut runs: Vec<Vec<i64>> = Vec::new();
    for expected in [&ids[0..3], &ids[3..6], &ids[6..7]] {
        let r = relay.run_cycle().await.unwrap();
        assert_eq!(r.claimed, expected.len() as u64);
        assert_eq!(r.settled.dispatched, expected.len() as u64);
        // The key waits for evidence of its LAST event; until then nothing more goes out.
        let (inflight, waiting): (Option<i64>, bool) = sqlx::query_as(
            "SELECT inflight_id, available_at > now() FROM outbox_keys WHERE partition_key = 'k'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(inflight, expected.last().copied());
        assert!(waiting);
        let r = relay.run_cycle().await.unwrap();
        assert_eq!(r.claimed, 0, "nothing more before the evidence");
        let delivered = delivered(&e).await;
        assert_eq!(delivered.len(), runs.len() + 1);
        let (got, header) = delivered.last().unwrap().clone();
        assert_eq!(got, expected);
        assert_eq!(header, joined(expected));
        evidence(&e, expected).await;
        runs.push(got);
    }
    assert_eq!(runs.concat(), ids);
    let r = relay.run_cycle().await.unwrap();
    assert_eq!(r.claimed, 0);
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE delivered_at IS NULL")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(pending, 0);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn unordered_events_are_grouped_per_topic_up_to_each_topics_n(pool: PgPool) {
    let e = RelayEnv::start(pool.clone(), dev()).await;
    let mut events = Vec::new();
    for i in 0..5 {
        events.push(NewEvent::new(&AUDIT, format!("a{i}"), &json!({"i": i})).unwrap());
        if i < 4 {
            events.push(NewEvent::new(&METRICS, format!("m{i}"), &json!({"i": i})).unwrap());
        }
    }
    let ids = enqueue(&pool, &events).await;
    let relay = batching_relay(&e, batching(2, &[("audit", 3)], 1_000_000));

    let claimed = relay.claim().await.unwrap();
    let formed = relay.messages_for(&claimed);
    let mut by_topic: HashMap<String, Vec<Vec<i64>>> = HashMap::new();
    for m in &formed.messages {
        let topic = &claimed[m.events[0]].topic;
        let group: Vec<i64> = m.events.iter().map(|&i| claimed[i].id.get()).collect();
        assert!(m.events.iter().all(|&i| &claimed[i].topic == topic));
        // Several events of any keys: the topic's flow-control key.
        let fc = m.message.options.flow_control.as_ref().unwrap();
        assert_eq!(fc.key, flow_control_key(topic));
        by_topic.entry(topic.to_string()).or_default().push(group);
    }
    let audit: Vec<i64> = ids.iter().copied().step_by(2).collect();
    let metrics: Vec<i64> = ids.iter().copied().skip(1).step_by(2).collect();
    assert_eq!(
        by_topic["audit"],
        vec![audit[0..3].to_vec(), audit[3..5].to_vec()]
    );
    assert_eq!(
        by_topic["metrics"],
        vec![metrics[0..2].to_vec(), metrics[2..4].to_vec()]
    );
    // Publish and settle that claim: every event dispatched with its message's id.
    let published = relay.publish_classified(&claimed).await;
    let items = relay.decide(&claimed, &published.outcomes());
    let settled = relay.settle(&items).await.unwrap();
    assert_eq!(settled.dispatched, 9);
    let distinct: i64 = sqlx::query_scalar("SELECT count(DISTINCT qstash_message_id) FROM outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(distinct, 4, "one QStash message id per message");
    let mut delivered = delivered(&e).await;
    delivered.sort();
    assert_eq!(delivered.len(), 4);
    for (got, header) in &delivered {
        assert_eq!(header, &joined(got));
    }
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn the_size_limit_splits_messages_and_a_huge_event_goes_alone(pool: PgPool) {
    let e = RelayEnv::start(pool.clone(), dev()).await;
    let blob = "x".repeat(1500);
    let mut events: Vec<NewEvent> = (0..5)
        .map(|i| NewEvent::new(&AUDIT, "k", &json!({"i": i, "blob": blob})).unwrap())
        .collect();
    events.push(NewEvent::new(&AUDIT, "k", &json!({"huge": "y".repeat(9000)})).unwrap());
    let ids = enqueue(&pool, &events).await;
    let limit = 4000;
    let relay = batching_relay(&e, batching(10, &[], limit));
    let claimed = relay.claim().await.unwrap();
    let formed = relay.messages_for(&claimed);
    let groups: Vec<Vec<i64>> = formed
        .messages
        .iter()
        .map(|m| m.events.iter().map(|&i| claimed[i].id.get()).collect())
        .collect();
    // Two ~1.6 kB events fit under 4000 bytes, a third does not; the 9 kB event goes alone.
    assert_eq!(
        groups,
        vec![
            ids[0..2].to_vec(),
            ids[2..4].to_vec(),
            vec![ids[4]],
            vec![ids[5]]
        ]
    );
    for m in &formed.messages {
        if m.events.len() > 1 {
            assert!(m.message.body.len() < limit, "{}", m.message.body.len());
        }
    }
    assert!(formed.left_over.is_empty());
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn dedup_ids_follow_the_composition_and_a_crash_reforms_the_same_message(pool: PgPool) {
    let e = RelayEnv::start(pool.clone(), dev()).await;
    let ids = enqueue(
        &pool,
        &(0..3)
            .map(|i| NewEvent::new(&ORDERS, "k", &json!({"i": i})).unwrap())
            .collect::<Vec<_>>(),
    )
    .await;
    let relay = batching_relay(&e, batching(3, &[], 1_000_000));
    // Killed after publishing, before settling.
    let claimed = relay.claim().await.unwrap();
    assert_eq!(claimed.len(), 3);
    let first = relay.messages_for(&claimed);
    assert_eq!(first.messages.len(), 1);
    let dedup = first.messages[0]
        .message
        .options
        .deduplication_id
        .clone()
        .unwrap();
    assert!(
        dedup.starts_with(&format!("outbox-b{}-3-", ids[0])),
        "{dedup}"
    );
    let published = relay.publish_classified(&claimed).await;
    assert!(published.events.iter().all(|e| matches!(
        e.outcome,
        outbox::internals::qstash::PublishOutcome::Accepted { .. }
    )));
    drop(claimed);
    expire_leases(&e).await;
    // The reclaim forms the same message: same id, and QStash drops the copy.
    let again = relay.claim().await.unwrap();
    assert_eq!(again.len(), 3);
    assert!(again.iter().all(|e| e.attempts == 2));
    let reformed = relay.messages_for(&again);
    assert_eq!(
        reformed.messages[0].message.options.deduplication_id,
        Some(dedup.clone())
    );
    let published = relay.publish_classified(&again).await;
    let items = relay.decide(&again, &published.outcomes());
    assert_eq!(relay.settle(&items).await.unwrap().dispatched, 3);
    assert_eq!(e.dev.handle().stats().deduplicated, 1);
    assert_eq!(delivered(&e).await, vec![(ids.clone(), joined(&ids))]);

    // Another composition (the first two only) gets another id.
    expire_leases(&e).await;
    sqlx::query("UPDATE outbox_keys SET inflight_id = NULL")
        .execute(&pool)
        .await
        .unwrap();
    let two = batching_relay(&e, batching(2, &[], 1_000_000));
    let claimed = two.claim().await.unwrap();
    assert_eq!(claimed.len(), 2);
    let other = two.messages_for(&claimed).messages[0]
        .message
        .options
        .deduplication_id
        .clone()
        .unwrap();
    assert!(other.starts_with(&format!("outbox-b{}-2-", ids[0])));
    assert_ne!(other, dedup);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_refused_batch_falls_back_to_single_events(pool: PgPool) {
    // The dev server refuses any request over 4000 bytes with 413: the batch of four is refused, each small
    // event alone passes, the big one alone is refused and is the only dead letter.
    let e = RelayEnv::start(
        pool.clone(),
        DevConfig {
            max_request_bytes: 4000,
            ..dev()
        },
    )
    .await;
    let mut events: Vec<NewEvent> = (0..3)
        .map(|i| NewEvent::new(&AUDIT, "k", &json!({"i": i, "pad": "p".repeat(1000)})).unwrap())
        .collect();
    events.push(NewEvent::new(&AUDIT, "k", &json!({"blob": "x".repeat(6000)})).unwrap());
    let ids = enqueue(&pool, &events).await;
    let relay = batching_relay(&e, batching(4, &[], 1_000_000));
    let r = relay.run_cycle().await.unwrap();
    assert_eq!(r.claimed, 4);
    assert_eq!(
        (r.settled.dispatched, r.settled.dead, r.settled.retried),
        (3, 1, 0)
    );
    let dead: Vec<i64> = sqlx::query_scalar("SELECT outbox_id FROM dead_letters")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(dead, vec![ids[3]]);
    let mut delivered = delivered(&e).await;
    delivered.sort();
    assert_eq!(
        delivered,
        ids[0..3]
            .iter()
            .map(|id| (vec![*id], id.to_string()))
            .collect::<Vec<_>>()
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_dead_ordered_head_blocks_its_key_and_its_followers_go_back_to_pending(pool: PgPool) {
    let e = RelayEnv::start(
        pool.clone(),
        DevConfig {
            max_request_bytes: 4000,
            ..dev()
        },
    )
    .await;
    let mut events = vec![NewEvent::new(&ORDERS, "k", &json!({"blob": "x".repeat(6000)})).unwrap()];
    events.extend((0..2).map(|i| NewEvent::new(&ORDERS, "k", &json!({"i": i})).unwrap()));
    let ids = enqueue(&pool, &events).await;
    let relay = batching_relay(&e, batching(3, &[], 1_000_000));
    let r = relay.run_cycle().await.unwrap();
    assert_eq!(r.claimed, 3);
    assert_eq!((r.settled.dead, r.settled.released), (1, 2));
    let dead: Vec<i64> = sqlx::query_scalar("SELECT outbox_id FROM dead_letters")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(dead, vec![ids[0]], "only the head is a dead letter");
    let blocked: Option<i64> =
        sqlx::query_scalar("SELECT blocked_id FROM outbox_keys WHERE partition_key = 'k'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(blocked, Some(ids[0]));
    let followers: Vec<(i64, bool, bool, i32)> = sqlx::query_as(
        "SELECT id, dead_lettered_at IS NULL AND dispatched_at IS NULL, locked_until IS NULL, attempts \
         FROM outbox WHERE id <> $1 ORDER BY id",
    )
    .bind(ids[0])
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        followers,
        vec![(ids[1], true, true, 0), (ids[2], true, true, 0)],
        "followers are pending again, not leased, their attempt given back"
    );
    assert!(delivered(&e).await.is_empty());
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn without_batching_every_event_is_its_own_message_as_before(pool: PgPool) {
    let e = RelayEnv::start(pool.clone(), dev()).await;
    let mut events: Vec<NewEvent> = (0..3)
        .map(|i| NewEvent::new(&AUDIT, format!("a{i}"), &json!({"i": i})).unwrap())
        .collect();
    events.extend((0..3).map(|i| NewEvent::new(&ORDERS, "k", &json!({"i": i})).unwrap()));
    enqueue(&pool, &events).await;
    let relay = batching_relay(&e, batching(1, &[], 1_000_000));
    let claimed = relay.claim().await.unwrap();
    // Unordered rows plus one head: nothing behind the head is claimed.
    assert_eq!(claimed.len(), 4);
    let formed = relay.messages_for(&claimed);
    assert!(formed.left_over.is_empty());
    assert_eq!(formed.messages.len(), 4);
    for m in &formed.messages {
        assert_eq!(m.events.len(), 1);
        let ev = &claimed[m.events[0]];
        let single = relay.message_for(ev);
        assert_eq!(m.message.body, single.body);
        assert_eq!(
            m.message.options.deduplication_id,
            Some(outbox::internals::contract::dedup_id(ev.id, 0))
        );
        let fc = m.message.options.flow_control.as_ref().unwrap();
        assert_eq!(
            fc.key,
            flow_control_key(&format!("{}.{}", ev.topic, ev.partition_key))
        );
        let v: Value = serde_json::from_str(&m.message.body).unwrap();
        assert_eq!(v["events"].as_array().unwrap().len(), 1);
    }
    let published = relay.publish_classified(&claimed).await;
    let items = relay.decide(&claimed, &published.outcomes());
    assert_eq!(relay.settle(&items).await.unwrap().dispatched, 4);
    for (ids, header) in delivered(&e).await {
        assert_eq!(ids.len(), 1);
        assert_eq!(header, ids[0].to_string());
    }
}

/// A QStash stand-in for `/v2/batch` that accepts every message, but holds its answer to a request that carries
/// the word `hold` (in an event's payload) until `release` turns true. Returns its URL.
async fn holding_qstash(release: tokio::sync::watch::Receiver<bool>) -> String {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let ids = Arc::new(AtomicU64::new(0));
    tokio::spawn(outbox::local::serve(
        listener,
        move |req| {
            let mut release = release.clone();
            let ids = ids.clone();
            async move {
                let body = req.body().as_ref().to_vec();
                if String::from_utf8_lossy(&body).contains("hold") {
                    let _ = release.wait_for(|r| *r).await;
                }
                let messages: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let answer: Vec<Value> = (0..messages.as_array().map_or(0, Vec::len))
                    .map(|_| json!({"messageId": format!("msg_{}", ids.fetch_add(1, Ordering::SeqCst))}))
                    .collect();
                lambda_http::Response::builder()
                    .status(200)
                    .header("content-type", "application/json")
                    .body(lambda_http::Body::from(
                        serde_json::to_string(&answer).unwrap(),
                    ))
                    .unwrap()
            }
        },
        std::future::pending(),
    ));
    url
}

/// Rows of key `key` that a settle marked with QStash's message id.
async fn settled_rows(pool: &PgPool, key: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE partition_key = $1 AND qstash_message_id IS NOT NULL",
    )
    .bind(key)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_run_is_settled_and_its_evidence_recorded_while_the_rest_of_its_claim_is_in_flight(
    pool: PgPool,
) {
    // One claim of two keys' runs, published in two requests (one message each). QStash answers the first at
    // once and holds the second: the first run must be settled (decision record 0018), its evidence recorded
    // and its key claimed again while the second request — and its part of the settle — is still out.
    let (release, held) = tokio::sync::watch::channel(false);
    let url = holding_qstash(held).await;
    let quick = enqueue(
        &pool,
        &(0..3)
            .map(|i| NewEvent::new(&ORDERS, "quick", &json!({"i": i})).unwrap())
            .collect::<Vec<_>>(),
    )
    .await;
    let slow = enqueue(
        &pool,
        &(0..2)
            .map(|i| NewEvent::new(&ORDERS, "slow", &json!({"hold": i})).unwrap())
            .collect::<Vec<_>>(),
    )
    .await;
    let qstash = outbox::config::QstashConfig {
        base_url: url.clone(),
        retries: 0,
        publish_timeout: Duration::from_secs(30),
        batch_size: 1,
        delivery_timeout: None,
        flow_parallelism: 1,
        replay_parallelism: 4,
        flow_rate: None,
        flow_period: Duration::from_secs(1),
        consumer_url: "http://127.0.0.1:9/consumer".into(),
        callback_url: "http://127.0.0.1:9/callback".into(),
    };
    let cfg = RelayConfig {
        // Longer than the test holds the second request: the held key's lease must not run out meanwhile.
        lease: Duration::from_secs(60),
        ..relay_config(batching(2, &[], 1_000_000))
    };
    let first = relaying::relay_to(&pool, "token", cfg.clone(), qstash.clone());
    let cycle = tokio::spawn(async move { first.run_cycle().await });

    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while settled_rows(&pool, "quick").await < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the answered run was not settled while the other request of its claim was in flight"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!cycle.is_finished(), "the claim's second request is held");
    assert_eq!(
        settled_rows(&pool, "slow").await,
        0,
        "the held run is not settled yet"
    );

    // The consumer's evidence for the answered run goes through at once (nothing of the claim's settle holds
    // its rows), and the key moves on.
    let mut conn = pool.acquire().await.unwrap();
    let recorded = tokio::time::timeout(
        Duration::from_secs(5),
        outbox::internals::ordering::record_delivery_batch(
            &mut conn,
            &[OutboxId(quick[0]), OutboxId(quick[1])],
            Statements::Prepared,
        ),
    )
    .await
    .expect("evidence does not wait for the rest of the claim")
    .unwrap();
    drop(conn);
    assert_eq!(recorded.keys_advanced, 1);

    // Another relay claims the key's next run while the first claim is still out, and publishes it.
    let second = relaying::relay_to(&pool, "token", cfg, qstash);
    let r = second.run_cycle().await.unwrap();
    assert_eq!((r.claimed, r.settled.dispatched), (1, 1));
    let next: Option<String> =
        sqlx::query_scalar("SELECT qstash_message_id FROM outbox WHERE id = $1")
            .bind(quick[2])
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(next.is_some(), "the key's next run went out");
    assert!(!cycle.is_finished());
    assert_eq!(settled_rows(&pool, "slow").await, 0);

    // Released, the first claim settles its held run too: nothing fenced, the key awaits its last event.
    release.send(true).unwrap();
    let r = cycle.await.unwrap().unwrap();
    assert_eq!((r.claimed, r.settled.dispatched, r.fenced), (4, 4, 0));
    let inflight: Option<i64> =
        sqlx::query_scalar("SELECT inflight_id FROM outbox_keys WHERE partition_key = 'slow'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(inflight, Some(slow[1]));
    let delivered: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE partition_key = 'quick' AND delivered_at IS NOT NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(delivered, 2, "the settle did not undo the evidence");
}
