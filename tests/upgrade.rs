//! The signed wire contract (decision record 0025) on the whole local system: Postgres, the QStash-compatible dev
//! server, the relay through its Lambda handler, the real consumer and callback receivers.
//!
//! * **Upgrade.** Messages the previous relay published (raw payload, identity in forwarded `X-Outbox-*`
//!   headers, no contract version in the URL) are still inside QStash when the new version starts: an event
//!   whose outbox row is there is applied exactly once and its ordered key moves on to events the new relay
//!   publishes; one whose row was pruned cannot be verified and ends as a dead letter that says why (and a
//!   redrive brings it back) — never applied blindly, never dropped.
//! * **Replay with a rewritten header.** Whoever holds one real signed delivery (or delivery callback) can
//!   replay it within the token's lifetime and change any header. Naming another pending event in `x-outbox-id`
//!   is refused (401, `header_mismatch`), and that event is applied normally later.

use std::time::Duration;

use orders_example::{
    AuditEntry, LineItem, OrderCancelled, OrderEvent, OrderPlaced, audit_event, order_event,
};
use outbox::config::EvidenceMode;
use outbox::dead_letters::RedriveOptions;
use outbox_testkit::db::{enqueue_committed as enqueue, url_of};
use outbox_testkit::previous_relay::{OldEvent, mark_dispatched};
use outbox_testkit::stack::{LocalStack, Receiver, RecordedRequest, StackOptions};
use serde_json::{Value, json};
use sqlx::PgPool;

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn placed(order_id: &str, amount_cents: i64) -> outbox::NewEvent {
    order_event(&OrderEvent::OrderPlaced(OrderPlaced {
        order_id: order_id.into(),
        customer_id: "customer-1".into(),
        amount_cents,
        currency: "EUR".into(),
        items: vec![LineItem {
            sku: "sku-1".into(),
            quantity: 1,
        }],
    }))
    .unwrap()
}

fn cancelled(order_id: &str) -> outbox::NewEvent {
    order_event(&OrderEvent::OrderCancelled(OrderCancelled {
        order_id: order_id.into(),
        reason: Some("changed their mind".into()),
    }))
    .unwrap()
}

fn audit(actor: &str, action: &str) -> outbox::NewEvent {
    audit_event(
        actor,
        &AuditEntry {
            actor: actor.into(),
            action: action.into(),
            details: json!({"by": actor}),
        },
    )
    .unwrap()
}

async fn stack(pool: &PgPool, mode: EvidenceMode) -> LocalStack {
    let mut opts = StackOptions::new(&url_of(pool)).unwrap();
    opts.relay.ordered_evidence = mode;
    opts.record_requests = true;
    opts.relay.poll_interval = Duration::from_millis(50);
    LocalStack::start(opts).await.unwrap()
}

async fn count(pool: &PgPool, sql: &str, id: i64) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn total(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// How long event B of the replay tests waits: far longer than any run takes to get A through, so B is surely
/// still pending when A's delivery is replayed under B's id; [`fall_due`] then makes it due.
const B_DELAY: Duration = Duration::from_secs(3600);

/// Makes a delayed event due now, and its key when it heads an ordered one (the relay parks a key until its
/// head is due).
async fn fall_due(pool: &PgPool, id: i64) {
    for sql in [
        "UPDATE outbox SET available_at = now() WHERE id = $1",
        "UPDATE outbox_keys k SET available_at = now() FROM outbox o \
         WHERE o.id = $1 AND (k.topic, k.partition_key) = (o.topic, o.partition_key) AND k.available_at > now()",
    ] {
        sqlx::query(sql).bind(id).execute(pool).await.unwrap();
    }
}

/// Waits until `sql` (one `$1` parameter) returns a row.
async fn eventually<T>(pool: &PgPool, sql: &str, id: i64, what: &str) -> T
where
    T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + Unpin,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .bind(id)
            .fetch_optional(pool)
            .await
            .unwrap()
        {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits for the first recorded request that matches (a request is recorded just after its answer is made, so
/// it may trail the database effect by a moment).
async fn recorded(
    stack: &LocalStack,
    what: &str,
    pred: impl Fn(&RecordedRequest) -> bool,
) -> RecordedRequest {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(r) = stack.recorded_requests().into_iter().find(|r| pred(r)) {
            return r;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The events of a delivery's signed envelope (`None` for a delivery in the previous format).
fn envelope_ids(r: &RecordedRequest) -> Option<Vec<(i64, Option<i64>)>> {
    if !r.path_and_query.contains("contract=") {
        return None;
    }
    let env: Value = serde_json::from_slice(&r.body).ok()?;
    Some(
        env["events"]
            .as_array()?
            .iter()
            .map(|e| (e["id"].as_i64().unwrap_or(0), e["seq"].as_i64()))
            .collect(),
    )
}

/// Sends a recorded request again, byte for byte, with `x-outbox-id` set to `outbox_id`: what an attacker holding
/// one valid delivery can do while its token lives. Returns the status and the JSON answer.
async fn replay_with_outbox_id(
    base_url: &str,
    r: &RecordedRequest,
    outbox_id: i64,
) -> (u16, Value) {
    let url = format!("{}{}", base_url.trim_end_matches('/'), r.path_and_query);
    let mut req = reqwest::Client::new()
        .request(r.method.parse().unwrap(), &url)
        .body(r.body.clone());
    for (k, v) in &r.headers {
        if !matches!(
            k.as_str(),
            "host" | "content-length" | "connection" | "x-outbox-id"
        ) {
            req = req.header(k, v);
        }
    }
    let resp = req
        .header("x-outbox-id", outbox_id.to_string())
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn old_format_messages_inside_qstash_at_upgrade_are_applied_once_and_their_key_moves_on(
    pool: PgPool,
) {
    // Before the upgrade: the previous relay published an audit event and the head of an order's key (its
    // placement); the cancellation (seq 2) was still waiting for the head's delivery evidence.
    let audit_id = enqueue(&pool, &[audit("actor-1", "login").traceparent(TRACEPARENT)]).await[0];
    let head = enqueue(&pool, &[placed("order-up", 1200)]).await[0];
    let next = enqueue(&pool, &[cancelled("order-up")]).await[0];
    let mut old: Vec<OldEvent> = Vec::new();
    for id in [audit_id, head] {
        old.push(OldEvent::load(&pool, id).await.unwrap());
        mark_dispatched(&pool, id, 120.0).await.unwrap();
    }

    // The new version starts; the dev server plays the QStash that still holds the old messages and delivers
    // each one twice (QStash is at-least-once).
    let stack = stack(&pool, EvidenceMode::Callback).await;
    let mut faults = stack.dev.handle().faults();
    faults.duplicate_delivery_rate = 1.0;
    stack.dev.handle().set_faults(faults).unwrap();
    for ev in &old {
        ev.publish(
            &stack.dev.url(),
            stack.dev.token(),
            &stack.consumer_url,
            &stack.callback_url,
            false,
            3,
        )
        .await
        .unwrap();
    }
    assert!(
        stack.wait_quiet(Duration::from_secs(60)).await,
        "the pipeline did not drain"
    );
    assert!(stack.dev.handle().stats().duplicate_deliveries >= 2);

    // Applied exactly once, each effect from its own event.
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM audit_log WHERE outbox_id = $1",
            audit_id
        )
        .await,
        1
    );
    let charge: (i64, String) =
        sqlx::query_as("SELECT outbox_id, status FROM charges WHERE order_id = 'order-up'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        charge,
        (head, "refunded".to_owned()),
        "one charge, from the head, refunded by the cancellation applied after it"
    );
    for id in [audit_id, head, next] {
        assert_eq!(
            count(
                &pool,
                "SELECT count(*) FROM processed_messages WHERE message_id = $1::bigint::text",
                id
            )
            .await,
            1,
            "event {id} applied once"
        );
    }
    assert_eq!(
        total(&pool, "SELECT count(*) FROM dead_letters").await,
        0,
        "nothing dead-lettered"
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM outbox WHERE id = $1 AND delivered_at IS NOT NULL",
            head
        )
        .await,
        1,
        "the head's delivery evidence was recorded"
    );

    // What the consumer saw: the two old-format deliveries (no contract version in the URL, twice each, all
    // applied or duplicates: 200), then the cancellation in the new format, published by the new relay once
    // the old head's evidence freed the key.
    let consumer: Vec<RecordedRequest> = stack
        .recorded_requests()
        .into_iter()
        .filter(|r| r.receiver == Receiver::Consumer)
        .collect();
    for r in &consumer {
        assert_eq!(
            r.status,
            200,
            "{} {:?}",
            r.path_and_query,
            r.header("x-outbox-id")
        );
    }
    let old_paths: Vec<&str> = consumer
        .iter()
        .filter(|r| envelope_ids(r).is_none())
        .map(|r| r.path_and_query.as_str())
        .collect();
    assert_eq!(
        old_paths.len(),
        4,
        "two old messages delivered twice each: {old_paths:?}"
    );
    assert!(
        old_paths
            .iter()
            .all(|p| *p == "/events/audit" || *p == "/events/orders"),
        "{old_paths:?}"
    );
    let new: Vec<&RecordedRequest> = consumer
        .iter()
        .filter(|r| envelope_ids(r).is_some())
        .collect();
    assert!(!new.is_empty(), "the new relay published the cancellation");
    for r in &new {
        assert_eq!(r.path_and_query, "/events/orders?contract=2");
        assert_eq!(envelope_ids(r), Some(vec![(next, Some(2))]));
    }
    stack.stop().await;
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn an_old_format_message_whose_event_was_pruned_is_dead_lettered_with_the_reason(
    pool: PgPool,
) {
    // The previous relay published an audit event; retention pruned its outbox row before QStash delivered it.
    let id = enqueue(
        &pool,
        &[audit("actor-2", "export").traceparent(TRACEPARENT)],
    )
    .await[0];
    let old = OldEvent::load(&pool, id).await.unwrap();
    sqlx::query("DELETE FROM outbox WHERE id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();

    let stack = stack(&pool, EvidenceMode::Callback).await;
    old.publish(
        &stack.dev.url(),
        stack.dev.token(),
        &stack.consumer_url,
        &stack.callback_url,
        false,
        3,
    )
    .await
    .unwrap();

    // Its identity is in unsigned headers and there is no row to check them against: the consumer refuses it
    // (489), QStash gives up at once and calls the failure callback, which records the dead letter.
    let dl: i64 = eventually(
        &pool,
        "SELECT id FROM dead_letters WHERE outbox_id = $1",
        id,
        "the dead letter",
    )
    .await;
    let d: Value = sqlx::query_scalar("SELECT to_jsonb(d) FROM dead_letters d WHERE id = $1")
        .bind(dl)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        (&d["source"], &d["status"], &d["topic"], &d["partition_key"]),
        (
            &json!("qstash"),
            &json!(489),
            &json!("audit"),
            &json!("actor-2")
        ),
        "{d}"
    );
    let response = d["response_body"].as_str().unwrap_or_default();
    assert!(
        response.contains("previous wire format")
            && response.contains(&format!("outbox id {id}"))
            && response.contains("not in the outbox")
            && response.contains("pruned"),
        "the dead letter says why: {d}"
    );
    assert_eq!(
        d["payload"],
        json!({"actor": "actor-2", "action": "export", "details": {"by": "actor-2"}})
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM audit_log WHERE outbox_id = $1",
            id
        )
        .await,
        0,
        "not applied"
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM processed_messages WHERE message_id = $1::bigint::text",
            id
        )
        .await,
        0
    );

    // The operator redrives it: the event is re-inserted with its id and headers, published in the new format,
    // and applied once.
    let mut conn = pool.acquire().await.unwrap();
    let r = outbox::dead_letters::redrive(&mut conn, dl, RedriveOptions::default())
        .await
        .unwrap();
    drop(conn);
    assert!(r.reinserted && r.outbox_id == id, "{r:?}");
    assert!(
        stack.wait_quiet(Duration::from_secs(60)).await,
        "the pipeline did not drain"
    );
    let (actor, tp): (String, Option<String>) = sqlx::query_as(
        "SELECT a.actor, o.headers->>'traceparent' FROM audit_log a JOIN outbox o ON o.id = a.outbox_id \
         WHERE a.outbox_id = $1",
    )
    .bind(id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (actor.as_str(), tp.as_deref()),
        ("actor-2", Some(TRACEPARENT))
    );
    let redelivered = stack
        .recorded_requests()
        .into_iter()
        .filter(|r| r.receiver == Receiver::Consumer && envelope_ids(r) == Some(vec![(id, None)]))
        .count();
    assert!(redelivered >= 1, "the redrive went out in the new format");
    stack.stop().await;
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_replayed_delivery_naming_another_pending_event_is_refused_and_that_event_is_applied_later(
    pool: PgPool,
) {
    let stack = stack(&pool, EvidenceMode::Callback).await;
    // A is delivered now; B waits (a delayed event: still pending in the outbox when the replay comes).
    let a = enqueue(&pool, &[audit("actor-a", "a")]).await[0];
    let b = enqueue(&pool, &[audit("actor-b", "b").delay(B_DELAY)]).await[0];
    eventually::<i64>(
        &pool,
        "SELECT outbox_id FROM audit_log WHERE outbox_id = $1",
        a,
        "event A applied",
    )
    .await;
    let delivery = recorded(&stack, "A's real signed delivery", |r| {
        r.receiver == Receiver::Consumer
            && r.status == 200
            && r.header("x-outbox-id") == Some(&a.to_string())
    })
    .await;
    assert!(delivery.header("upstash-signature").is_some());
    let pending: bool = sqlx::query_scalar(
        "SELECT dispatched_at IS NULL AND available_at > now() + interval '1 second' FROM outbox WHERE id = $1",
    )
    .bind(b)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(pending, "B must still be pending when the replay comes");

    // The attacker replays A's delivery with x-outbox-id rewritten to B: refused, nothing written.
    let (status, answer) = replay_with_outbox_id(&stack.consumer_url, &delivery, b).await;
    assert_eq!(status, 401, "{answer}");
    assert_eq!(answer["check"], "header_mismatch", "{answer}");
    for (sql, what) in [
        (
            "SELECT count(*) FROM processed_messages WHERE message_id = $1::bigint::text",
            "no dedupe row for B",
        ),
        (
            "SELECT count(*) FROM audit_log WHERE outbox_id = $1",
            "nothing applied under B's id",
        ),
    ] {
        assert_eq!(count(&pool, sql, b).await, 0, "{what}");
    }
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM audit_log WHERE outbox_id = $1",
            a
        )
        .await,
        1,
        "A not applied again"
    );

    // B is published when due and applied normally, with its own payload.
    fall_due(&pool, b).await;
    assert!(
        stack.wait_quiet(Duration::from_secs(60)).await,
        "the pipeline did not drain"
    );
    let rows: Vec<(i64, String, String)> =
        sqlx::query_as("SELECT outbox_id, actor, action FROM audit_log ORDER BY outbox_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        rows,
        vec![
            (a, "actor-a".to_owned(), "a".to_owned()),
            (b, "actor-b".to_owned(), "b".to_owned())
        ]
    );
    stack.stop().await;
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_replayed_delivery_callback_naming_another_pending_event_is_refused_and_that_event_is_delivered(
    pool: PgPool,
) {
    let stack = stack(&pool, EvidenceMode::Callback).await;
    // Two orders, each the head of its own key: A's is delivered now (with a delivery callback), B's waits.
    let a = enqueue(&pool, &[placed("order-a", 100)]).await[0];
    let b = enqueue(&pool, &[placed("order-b", 200).delay(B_DELAY)]).await[0];
    eventually::<bool>(
        &pool,
        "SELECT true FROM outbox WHERE id = $1 AND delivered_at IS NOT NULL",
        a,
        "A's delivery evidence",
    )
    .await;
    let callback = recorded(&stack, "A's real signed delivery callback", |r| {
        r.receiver == Receiver::Callbacks
            && r.status == 200
            && r.path_and_query.starts_with("/delivered")
    })
    .await;
    assert!(callback.header("upstash-signature").is_some());

    // Replayed with x-outbox-id naming B: had it been believed, B would be marked delivered without ever being
    // published, and its key would move past it — B lost.
    let (status, answer) = replay_with_outbox_id(&stack.callback_url, &callback, b).await;
    assert_eq!(status, 401, "{answer}");
    assert_eq!(answer["check"], "header_mismatch", "{answer}");
    let untouched: bool = sqlx::query_scalar(
        "SELECT o.delivered_at IS NULL AND o.dispatched_at IS NULL AND k.done_seq = 0 \
         FROM outbox o JOIN outbox_keys k USING (topic, partition_key) WHERE o.id = $1",
    )
    .bind(b)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(untouched, "B and its key are untouched");

    fall_due(&pool, b).await;
    assert!(
        stack.wait_quiet(Duration::from_secs(60)).await,
        "the pipeline did not drain"
    );
    let charges: Vec<(String, i64)> =
        sqlx::query_as("SELECT order_id, outbox_id FROM charges ORDER BY order_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        charges,
        vec![("order-a".to_owned(), a), ("order-b".to_owned(), b)],
        "B was published and applied"
    );
    stack.stop().await;
}
