//! The callback function (`outbox::internals::callbacks::handle_callback`) on real Postgres: failure callbacks become
//! dead letters (well-formed, missing fields, string times, garbage — never dropped), delivery callbacks become
//! delivery evidence or a noted failed attempt, anything unsigned or elsewhere is refused. The event a callback
//! is about comes from its signed body only (the envelope in `sourceBody` of a current message, `sourceHeader`
//! of one published by an older relay), never from a header of the callback request.

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
use orders_example::{self as example, LineItem, OrderEvent, OrderPlaced};
use outbox::ReceiverState;
use outbox::config::ConsumerConfig;
use outbox::internals::callbacks::{handle_callback, parse_callback};
use outbox::producer::{NewEvent, Topic, enqueue};
use outbox_testkit::receiving::*;
use serde_json::{Value, json};
use sqlx::{PgPool, Row};

fn state(pool: &PgPool) -> ReceiverState {
    receiver(pool, ConsumerConfig::defaults())
}

fn b64(s: &str) -> String {
    STANDARD.encode(s)
}

async fn enqueue_audit(pool: &PgPool) -> i64 {
    let mut tx = pool.begin().await.unwrap();
    let ev = enqueue(
        &mut tx,
        NewEvent::new(
            &Topic::unordered("audit"),
            "user-1",
            &json!({"actor":"u","action":"a"}),
        )
        .unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    ev.id.get()
}

async fn enqueue_order(pool: &PgPool, order_id: &str) -> (i64, i64) {
    let mut tx = pool.begin().await.unwrap();
    let ev = enqueue(
        &mut tx,
        example::order_event(&OrderEvent::OrderPlaced(OrderPlaced {
            order_id: order_id.into(),
            customer_id: "c".into(),
            amount_cents: 1,
            currency: "EUR".into(),
            items: vec![LineItem {
                sku: "S".into(),
                quantity: 1,
            }],
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    (ev.id.get(), ev.seq.unwrap())
}

const AUDIT_PAYLOAD: &str = r#"{"actor":"u","action":"a"}"#;
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// The current relay's delivery of audit event `id` (what QStash calls the consumer with).
fn audit_delivery(id: i64) -> Delivery {
    Delivery::new("audit", id, AUDIT_PAYLOAD.as_bytes())
        .key("user-1")
        .header("traceparent", TRACEPARENT)
}

/// The current relay's delivery of ordered order event `id`.
fn order_delivery(id: i64, key: &str, seq: i64) -> Delivery {
    Delivery::new("orders", id, br#"{"type":"OrderPlaced"}"#)
        .key(key)
        .seq(seq)
        .schema_version(2)
        .evidence_by_callback()
}

/// The failure callback body QStash sends after giving up on `d`: the original URL (with the contract version)
/// and body (the envelope), and the headers the relay set (the informational `X-Outbox-Id` copy).
fn failure_body(d: &Delivery, dlq_id: &str) -> Value {
    json!({
        "status": 503,
        "header": {"Content-Type": ["application/json"]},
        "body": b64(r#"{"error":"database error"}"#),
        "retried": 5,
        "maxRetries": 5,
        "dlqId": dlq_id,
        "sourceMessageId": "msg_abc",
        "url": d.signed_url(),
        "method": "POST",
        "sourceHeader": {"Content-Type": ["application/json"], "X-Outbox-Id": [d.id().to_string()]},
        "sourceBody": STANDARD.encode(d.body()),
        "notBefore": 1_701_198_458_025_i64,
        "createdAt": 1_701_198_447_054_i64,
        "callerIP": "178.247.74.179"
    })
}

/// A failure callback body for a message published by a relay before the signed contract: URL without a
/// contract version, the payload as body, the identity in `sourceHeader` (forwarded `x-outbox-*` headers).
fn legacy_failure_body(source_header: Value, dlq_id: &str) -> Value {
    json!({
        "status": 503,
        "body": b64(r#"{"error":"database error"}"#),
        "retried": 5,
        "maxRetries": 5,
        "dlqId": dlq_id,
        "sourceMessageId": "msg_old",
        "url": url("/events/audit"),
        "method": "POST",
        "sourceHeader": source_header,
        "sourceBody": b64(AUDIT_PAYLOAD),
    })
}

/// A signed callback request (no `x-outbox-id` header: the current relay forwards none to callbacks).
fn post(path: &str, body: &[u8]) -> lambda_http::Request {
    signed_post(path, body, &[("upstash-message-id", "msg_callback")])
}

/// A signed callback request carrying an `x-outbox-id` request header (relays before the signed contract
/// forwarded one to their callbacks; anyone replaying a callback can set any).
fn post_with_id_header(path: &str, body: &[u8], header_id: i64) -> lambda_http::Request {
    signed_post(
        path,
        body,
        &[
            ("upstash-message-id", "msg_callback"),
            ("x-outbox-id", &header_id.to_string()),
        ],
    )
}

#[derive(Debug, sqlx::FromRow)]
struct DeadLetter {
    source: String,
    natural_id: String,
    outbox_id: Option<i64>,
    topic: Option<String>,
    partition_key: Option<String>,
    payload: Option<Value>,
    body: Option<Vec<u8>>,
    headers: Option<Value>,
    error: String,
    status: Option<i32>,
    response_body: Option<String>,
    attempts: Option<i32>,
    qstash_message_id: Option<String>,
    dlq_id: Option<String>,
    raw_callback: Option<Vec<u8>>,
    parse_error: Option<String>,
}

async fn dead_letters(pool: &PgPool) -> Vec<DeadLetter> {
    sqlx::query_as(
        "SELECT source, natural_id, outbox_id, topic, partition_key, payload, body, headers, error, status, \
                response_body, attempts, qstash_message_id, dlq_id, raw_callback, parse_error \
         FROM dead_letters ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn well_formed_failure_callback_is_recorded_once(pool: PgPool) {
    let id = enqueue_audit(&pool).await;
    let st = state(&pool);
    let delivery = audit_delivery(id).schema_version(2);
    let body = failure_body(&delivery, "1701198458025-0").to_string();
    let r = handle_callback(&st, post("/failure", body.as_bytes())).await;
    let (status, json) = parts(&r);
    assert_eq!(status, 200, "{json}");
    assert_eq!(json["status"], "recorded");
    assert_eq!(json["outbox_id"], id);

    let dl = dead_letters(&pool).await;
    assert_eq!(dl.len(), 1);
    let d = &dl[0];
    assert_eq!(d.source, "qstash");
    assert_eq!(d.natural_id, "1701198458025-0");
    assert_eq!(d.dlq_id.as_deref(), Some("1701198458025-0"));
    assert_eq!(d.outbox_id, Some(id));
    assert_eq!(d.topic.as_deref(), Some("audit"));
    assert_eq!(d.partition_key.as_deref(), Some("user-1"));
    assert_eq!(
        d.payload,
        Some(json!({"actor":"u","action":"a"})),
        "the event's payload, not the whole envelope"
    );
    assert_eq!(d.status, Some(503));
    assert_eq!(d.attempts, Some(6));
    assert_eq!(
        d.response_body.as_deref(),
        Some(r#"{"error":"database error"}"#)
    );
    assert_eq!(d.qstash_message_id.as_deref(), Some("msg_abc"));
    let headers = d.headers.as_ref().unwrap();
    assert_eq!(headers["X-Outbox-Id"], json!([id.to_string()]));
    assert_eq!(
        headers["traceparent"],
        json!([TRACEPARENT]),
        "the envelope's event headers are added, for a redrive that re-creates a pruned event"
    );
    assert_eq!(headers["x-schema-version"], json!(["2"]));
    assert!(d.raw_callback.is_none() && d.parse_error.is_none());
    assert!(d.error.contains("last status 503"), "{}", d.error);
    let dead: bool =
        sqlx::query_scalar("SELECT dead_lettered_at IS NOT NULL FROM outbox WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(dead, "the outbox event is marked dead");

    // QStash retries the callback: idempotent on dlqId.
    let r = handle_callback(&st, post("/failure", body.as_bytes())).await;
    assert_eq!(parts(&r), (200, json!({"status":"duplicate"})));
    assert_eq!(count(&pool, "SELECT count(*) FROM dead_letters").await, 1);
}

/// Two QStash messages of one event both given up on (a batch formed again after a relay died, a republish):
/// the second failure merges into the event's open dead letter — natural id remembered, attempts added, reason
/// appended — so the event has one dead letter, listed once and redriven once; either callback retried is a
/// duplicate. A dead letter that was redriven is handled: a later failure is a new dead letter.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_second_failure_of_an_event_merges_into_its_open_dead_letter(pool: PgPool) {
    let id = enqueue_audit(&pool).await;
    let st = state(&pool);
    let delivery = audit_delivery(id).schema_version(2);
    let first = failure_body(&delivery, "1701198458025-0").to_string();
    let mut second = failure_body(&delivery, "1701198999000-0");
    second["sourceMessageId"] = json!("msg_second");
    second["status"] = json!(500);
    second["retried"] = json!(2);
    let second = second.to_string();
    let r = handle_callback(&st, post("/failure", first.as_bytes())).await;
    assert_eq!(parts(&r).1["status"], "recorded");
    let r = handle_callback(&st, post("/failure", second.as_bytes())).await;
    let (status, json) = parts(&r);
    assert_eq!(status, 200, "{json}");
    assert_eq!(json["status"], "merged", "{json}");
    assert_eq!(json["outbox_id"], id);

    let dl = dead_letters(&pool).await;
    assert_eq!(dl.len(), 1, "one dead letter per event");
    let d = &dl[0];
    assert_eq!(d.natural_id, "1701198458025-0");
    assert_eq!(d.attempts, Some(6 + 3), "the attempts of both messages");
    assert!(
        d.error.contains("last status 503") && d.error.contains("last status 500"),
        "both reasons kept: {}",
        d.error
    );
    let (merged_ids, merged_count): (Vec<String>, i32) =
        sqlx::query_as("SELECT merged_ids, merged_count FROM dead_letters")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(merged_ids, vec!["1701198999000-0".to_owned()]);
    assert_eq!(merged_count, 1);

    // Either callback retried by QStash changes nothing.
    for body in [&first, &second] {
        let r = handle_callback(&st, post("/failure", body.as_bytes())).await;
        assert_eq!(parts(&r), (200, json!({"status":"duplicate"})));
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM dead_letters").await, 1);
    let mut conn = pool.acquire().await.unwrap();
    let page = outbox::dead_letters::list(
        &mut conn,
        &outbox::dead_letters::ListQuery {
            limit: 10,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        page.items.len(),
        1,
        "`dead-letters list` shows the event once"
    );

    // Once handled (redriven), a new failure of the event is a dead letter of its own.
    sqlx::query("UPDATE dead_letters SET redriven_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    let third = failure_body(&delivery, "1701199999000-0").to_string();
    let r = handle_callback(&st, post("/failure", third.as_bytes())).await;
    assert_eq!(parts(&r).1["status"], "recorded");
    assert_eq!(count(&pool, "SELECT count(*) FROM dead_letters").await, 2);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn outbox_id_of_an_older_relays_message_comes_from_the_source_headers(pool: PgPool) {
    // A message published before the signed contract (no contract version in its URL, payload as body): its
    // outbox id is in the headers the relay set at publish time, which QStash signs as `sourceHeader`. That
    // relay also forwarded x-outbox-id to the callback: an equal copy is accepted.
    let id = enqueue_audit(&pool).await;
    let st = state(&pool);
    let body = legacy_failure_body(
        json!({"Upstash-Forward-X-Outbox-Id": [id.to_string()]}),
        "2-0",
    );
    let r = handle_callback(
        &st,
        post_with_id_header("/failure", body.to_string().as_bytes(), id),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
    let d = &dead_letters(&pool).await[0];
    assert_eq!(d.outbox_id, Some(id));
    assert_eq!(
        d.payload,
        Some(json!({"actor":"u","action":"a"})),
        "the whole body of a message in the previous format is its payload"
    );
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn outbox_id_of_a_current_message_comes_from_the_envelope(pool: PgPool) {
    // The envelope in sourceBody names the event even when the publisher set no header at all.
    let id = enqueue_audit(&pool).await;
    let st = state(&pool);
    let mut body = failure_body(&audit_delivery(id), "2-1");
    body["sourceHeader"] = json!({"Content-Type": ["application/json"]});
    let r = handle_callback(&st, post("/failure", body.to_string().as_bytes())).await;
    let (status, json) = parts(&r);
    assert_eq!((status, &json["outbox_id"]), (200, &json!(id)), "{json}");
    assert_eq!(dead_letters(&pool).await[0].outbox_id, Some(id));
    // An envelope in the body of a message whose URL names no contract version is not read as one (a body
    // in the previous format is the producer's payload, whatever it looks like).
    let mut body = failure_body(&audit_delivery(id), "2-2");
    body["url"] = json!(url("/events/audit"));
    body["sourceHeader"] = json!({});
    let r = handle_callback(&st, post("/failure", body.to_string().as_bytes())).await;
    assert_eq!(parts(&r).0, 200);
    let d = &dead_letters(&pool).await[1];
    assert_eq!(d.outbox_id, None);
    assert_eq!(d.payload.as_ref().unwrap()["contract"], 2);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn failure_callback_with_missing_fields(pool: PgPool) {
    let id = enqueue_audit(&pool).await;
    let st = state(&pool);
    // Only a dlqId and the event's id in sourceHeader.
    let only =
        json!({"dlqId": "3-0", "sourceHeader": {"X-Outbox-Id": [id.to_string()]}}).to_string();
    let r = handle_callback(&st, post("/failure", only.as_bytes())).await;
    assert_eq!(parts(&r).0, 200);
    // Nothing at all but an empty object, twice (idempotent through the raw body), and without an outbox id.
    for _ in 0..2 {
        let r = handle_callback(&st, post("/failure", b"{}")).await;
        assert_eq!(parts(&r).0, 200);
    }
    let dl = dead_letters(&pool).await;
    assert_eq!(dl.len(), 2, "{dl:?}");
    assert_eq!(dl[0].outbox_id, Some(id));
    assert_eq!(
        dl[0].topic.as_deref(),
        Some("audit"),
        "taken from the outbox row"
    );
    assert_eq!(dl[0].payload, Some(json!({"actor":"u","action":"a"})));
    assert!(
        dl[0].error.contains("no status reported"),
        "{}",
        dl[0].error
    );
    assert!(dl[1].outbox_id.is_none());
    assert!(dl[1].natural_id.starts_with("nodlq-"));
    assert_eq!(
        dl[1].raw_callback.as_deref(),
        Some(&b"{}"[..]),
        "kept raw: no dlqId"
    );
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn failure_callback_with_string_times_and_string_headers(pool: PgPool) {
    let id = enqueue_audit(&pool).await;
    let st = state(&pool);
    let body = json!({
        "status": "500",
        "retried": "3",
        "maxRetries": 3,
        "dlqId": "4-0",
        "notBefore": "1701198458025",
        "createdAt": "1701198447054",
        "header": {"Content-Type": "text/plain"},
        "sourceHeader": {"Content-Type": "application/json", "X-Outbox-Id": id.to_string()},
        "body": STANDARD_NO_PAD.encode("plain failure"),
        "sourceBody": STANDARD_NO_PAD.encode(r#"{"actor":"u","action":"a"}"#)
    });
    let parsed = parse_callback(body.to_string().as_bytes()).unwrap();
    assert!(parsed.problems.is_empty(), "{:?}", parsed.problems);
    assert_eq!(parsed.body.not_before, Some(1_701_198_458_025));
    assert_eq!(parsed.body.created_at, Some(1_701_198_447_054));
    assert_eq!(
        parsed.body.header,
        Some(json!({"Content-Type": ["text/plain"]}))
    );
    let r = handle_callback(&st, post("/failure", body.to_string().as_bytes())).await;
    assert_eq!(parts(&r).0, 200);
    let d = &dead_letters(&pool).await[0];
    assert_eq!(
        d.outbox_id,
        Some(id),
        "found in sourceHeader given as plain strings"
    );
    assert_eq!(d.status, Some(500));
    assert_eq!(d.attempts, Some(4));
    assert_eq!(d.response_body.as_deref(), Some("plain failure"));
    assert!(d.parse_error.is_none());
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn garbage_failure_callback_is_stored_raw_never_dropped(pool: PgPool) {
    let id = enqueue_audit(&pool).await;
    let st = state(&pool);
    let garbage: &[u8] = b"<html>502 Bad Gateway</html>\xff\xfe";
    let r = handle_callback(&st, post("/failure", garbage)).await;
    assert_eq!(
        parts(&r).0,
        200,
        "a signed but unreadable failure callback is still acknowledged"
    );
    // A JSON array, and an object with wrong types, are kept too.
    let r = handle_callback(&st, post("/failure", b"[1,2,3]")).await;
    assert_eq!(parts(&r).0, 200);
    let bad_fields = json!({
        "dlqId": "5-0",
        "status": {"x": 1},
        "sourceBody": "***not base64***",
        "sourceHeader": {"X-Outbox-Id": [id.to_string()]}
    })
    .to_string();
    let r = handle_callback(&st, post("/failure", bad_fields.as_bytes())).await;
    assert_eq!(parts(&r).0, 200);
    // The garbage again: idempotent.
    let r = handle_callback(&st, post("/failure", garbage)).await;
    assert_eq!(parts(&r), (200, json!({"status":"duplicate"})));

    let dl = dead_letters(&pool).await;
    assert_eq!(dl.len(), 3);
    assert_eq!(dl[0].raw_callback.as_deref(), Some(garbage));
    assert!(dl[0].parse_error.as_deref().unwrap().contains("not JSON"));
    assert_eq!(
        dl[0].outbox_id, None,
        "an unreadable body names no event (and no request header may name one)"
    );
    assert!(dl[0].error.contains("could not be parsed"));
    assert!(
        dl[1]
            .parse_error
            .as_deref()
            .unwrap()
            .contains("not a JSON object")
    );
    let pe = dl[2].parse_error.as_deref().unwrap();
    assert!(pe.contains("status") && pe.contains("sourceBody"), "{pe}");
    assert_eq!(
        dl[2].dlq_id.as_deref(),
        Some("5-0"),
        "the readable fields are kept"
    );
    assert_eq!(
        dl[2].outbox_id,
        Some(id),
        "linked through the readable sourceHeader"
    );
    assert_eq!(dl[2].raw_callback.as_deref(), Some(bad_fields.as_bytes()));
    // Visible in one query.
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letters WHERE outbox_id = $1")
        .bind(id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn failure_of_a_pruned_event_keeps_its_id_topic_and_key(pool: PgPool) {
    // The outbox row is gone (pruned while QStash still retried): the dead letter keeps what the signed callback
    // body says — from the envelope of a current message...
    let st = state(&pool);
    let d = Delivery::new("orders", 999, AUDIT_PAYLOAD.as_bytes()).key("order 1");
    let r = handle_callback(
        &st,
        post("/failure", failure_body(&d, "6-0").to_string().as_bytes()),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
    let d = &dead_letters(&pool).await[0];
    assert_eq!(d.outbox_id, Some(999));
    assert_eq!(d.topic.as_deref(), Some("orders"));
    assert_eq!(d.partition_key.as_deref(), Some("order 1"));
    assert_eq!(d.payload, Some(json!({"actor":"u","action":"a"})));
    assert!(d.body.is_none());

    // ...and from the source headers and URL of one published by an older relay.
    let mut body = legacy_failure_body(
        json!({"X-Outbox-Id": ["998"], "X-Outbox-Key": ["order%202"]}),
        "6-1",
    );
    body["url"] = json!(url("/events/orders"));
    let r = handle_callback(&st, post("/failure", body.to_string().as_bytes())).await;
    assert_eq!(parts(&r).0, 200);
    let d = &dead_letters(&pool).await[1];
    assert_eq!(d.outbox_id, Some(998));
    assert_eq!(d.topic.as_deref(), Some("orders"));
    assert_eq!(d.partition_key.as_deref(), Some("order 2"));
    assert_eq!(d.payload, Some(json!({"actor":"u","action":"a"})));
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn failure_of_an_ordered_head_applies_the_dead_head_policy(pool: PgPool) {
    let (id, seq) = enqueue_order(&pool, "o-1").await;
    assert_eq!(seq, 1);
    let st = state(&pool);
    let r = handle_callback(
        &st,
        post(
            "/failure",
            failure_body(&order_delivery(id, "o-1", seq), "7-0")
                .to_string()
                .as_bytes(),
        ),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
    let blocked: Option<i64> = sqlx::query_scalar(
        "SELECT blocked_id FROM outbox_keys WHERE topic = 'orders' AND partition_key = 'o-1'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(blocked, Some(id), "default policy: block the key");

    // With RELAY_SKIP_DEAD_HEAD_TOPICS=orders the key moves past the head instead.
    let (id2, seq2) = enqueue_order(&pool, "o-2").await;
    let skip = receiver(
        &pool,
        ConsumerConfig {
            skip_topics: vec!["orders".into()],
            ..ConsumerConfig::defaults()
        },
    );
    let r = handle_callback(
        &skip,
        post(
            "/failure",
            failure_body(&order_delivery(id2, "o-2", seq2), "8-0")
                .to_string()
                .as_bytes(),
        ),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
    let row = sqlx::query(
        "SELECT done_seq, blocked_at IS NULL AS free FROM outbox_keys WHERE partition_key = 'o-2'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(row.get::<i64, _>("done_seq"), 1);
    assert!(row.get::<bool, _>("free"));
}

/// The delivery callback QStash sends after an attempt to deliver ordered event `id` (seq 1 of key `key`).
fn delivery_body(id: i64, key: &str, status: i32, retried: i32) -> Value {
    let d = order_delivery(id, key, 1);
    json!({
        "status": status,
        "header": {"Content-Type": ["application/json"]},
        "body": b64(&format!(r#"{{"error":"status {status} from the consumer, with a long explanation {}"}}"#, "x".repeat(2000))),
        "retried": retried,
        "maxRetries": 3,
        "sourceMessageId": "msg_1",
        "url": d.signed_url(),
        "method": "POST",
        "sourceHeader": {"Content-Type": ["application/json"], "X-Outbox-Id": [id.to_string()]},
        "sourceBody": STANDARD.encode(d.body()),
        "notBefore": 1_701_198_458_025_i64,
        "createdAt": "1701198447054"
    })
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn delivery_callback_2xx_is_delivery_evidence(pool: PgPool) {
    let (id, _) = enqueue_order(&pool, "o-1").await;
    let st = state(&pool);
    let r = handle_callback(
        &st,
        post(
            "/delivered",
            delivery_body(id, "o-1", 200, 0).to_string().as_bytes(),
        ),
    )
    .await;
    let (status, json) = parts(&r);
    assert_eq!(status, 200, "{json}");
    assert_eq!(json["status"], "delivered");
    assert_eq!(json["key_advanced"], true);
    let delivered: bool =
        sqlx::query_scalar("SELECT delivered_at IS NOT NULL FROM outbox WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(delivered);
    // Repeated evidence is harmless.
    let r = handle_callback(
        &st,
        post(
            "/delivered",
            delivery_body(id, "o-1", 204, 0).to_string().as_bytes(),
        ),
    )
    .await;
    assert_eq!(parts(&r).1["key_advanced"], false);
    // Evidence for an event we do not know: acknowledged.
    let r = handle_callback(
        &st,
        post(
            "/delivered",
            delivery_body(424242, "o-9", 200, 0).to_string().as_bytes(),
        ),
    )
    .await;
    assert_eq!(
        parts(&r),
        (200, json!({"status":"unknown_event","outbox_id":424242}))
    );
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn delivery_callback_failure_is_noted_on_the_event(pool: PgPool) {
    let (id, _) = enqueue_order(&pool, "o-1").await;
    let st = state(&pool);
    let r = handle_callback(
        &st,
        post(
            "/delivered",
            delivery_body(id, "o-1", 503, 1).to_string().as_bytes(),
        ),
    )
    .await;
    assert_eq!(
        parts(&r),
        (
            200,
            json!({"status":"attempt_failed","outbox_id":id,"recorded":true})
        )
    );
    let (err, delivered): (String, bool) =
        sqlx::query_as("SELECT last_error, delivered_at IS NOT NULL FROM outbox WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(!delivered);
    assert!(
        err.starts_with("delivery attempt 2 of 4 failed with status 503: {\"error\":\"status 503"),
        "{err}"
    );
    assert!(
        err.len() < 700,
        "the response body is truncated: {}",
        err.len()
    );
    // The last attempt says so.
    let r = handle_callback(
        &st,
        post(
            "/delivered",
            delivery_body(id, "o-1", 500, 3).to_string().as_bytes(),
        ),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
    let err: String = sqlx::query_scalar("SELECT last_error FROM outbox WHERE id = $1")
        .bind(id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        err.contains("attempt 4 of 4") && err.contains("last attempt"),
        "{err}"
    );
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn unusable_delivery_callbacks_are_489(pool: PgPool) {
    let (id, _) = enqueue_order(&pool, "o-1").await;
    let st = state(&pool);
    let named = |mut v: Value| {
        v["sourceHeader"] = json!({"X-Outbox-Id": [id.to_string()]});
        v.to_string().into_bytes()
    };
    let mut no_id = delivery_body(id, "o-1", 200, 0);
    no_id["url"] = json!(url("/events/orders"));
    no_id["sourceHeader"] = json!({"Content-Type": ["application/json"]});
    let mut not_an_envelope = delivery_body(id, "o-1", 200, 0);
    not_an_envelope["sourceBody"] = json!(b64(r#"{"type":"OrderPlaced"}"#));
    not_an_envelope["sourceHeader"] = json!({});
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", b"not json".to_vec()),
        ("no status", named(json!({"retried": 0}))),
        ("status of the wrong type", named(json!({"status": [200]}))),
        (
            "no outbox id anywhere in the signed body",
            no_id.to_string().into_bytes(),
        ),
        (
            "a current message whose body is not an envelope, no id in its headers",
            not_an_envelope.to_string().into_bytes(),
        ),
    ];
    for (name, body) in cases {
        let r = handle_callback(&st, post("/delivered", &body)).await;
        let (status, json) = parts(&r);
        assert_eq!(status, 489, "{name}: {json}");
        assert_eq!(
            r.headers().get("upstash-nonretryable-error").unwrap(),
            "true",
            "{name}"
        );
    }
    let (delivered, err): (bool, Option<String>) =
        sqlx::query_as("SELECT delivered_at IS NOT NULL, last_error FROM outbox WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(!delivered && err.is_none(), "nothing recorded");
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn unsigned_oversized_and_unknown_paths_are_refused(pool: PgPool) {
    let id = enqueue_audit(&pool).await;
    let st = state(&pool);
    let body = failure_body(&audit_delivery(id), "9-0").to_string();
    // No signature.
    let r = handle_callback(
        &st,
        post_with_headers(
            "/failure",
            "",
            &[("x-outbox-id", &id.to_string())],
            body.as_bytes(),
        ),
    )
    .await;
    assert_eq!(parts(&r).0, 401);
    // Signed for the other callback path.
    let sig = token(KEY, &url("/delivered"), body.as_bytes());
    let r = handle_callback(
        &st,
        post_with_headers(
            "/failure",
            "",
            &[("upstash-signature", &sig)],
            body.as_bytes(),
        ),
    )
    .await;
    let (status, json) = parts(&r);
    assert_eq!((status, json["check"].as_str()), (401, Some("subject")));
    // Signed, but for a path we do not serve.
    let r = handle_callback(&st, post("/events/audit", body.as_bytes())).await;
    assert_eq!(parts(&r).0, 404);
    // Over the callback cap.
    let small = receiver(
        &pool,
        ConsumerConfig {
            callback_max_body_bytes: 1024,
            ..ConsumerConfig::defaults()
        },
    );
    let big = json!({"dlqId":"10-0","pad":"x".repeat(2000)}).to_string();
    let r = handle_callback(&small, post("/failure", big.as_bytes())).await;
    assert_eq!(parts(&r).0, 413);
    assert_eq!(count(&pool, "SELECT count(*) FROM dead_letters").await, 0);
    let dead: bool =
        sqlx::query_scalar("SELECT dead_lettered_at IS NULL FROM outbox WHERE id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(dead, "outbox untouched");
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_path_prefix_and_a_trailing_slash_still_route(pool: PgPool) {
    let id = enqueue_audit(&pool).await;
    let st = state(&pool);
    let r = handle_callback(
        &st,
        post(
            "/qstash/failure/",
            failure_body(&audit_delivery(id), "11-0")
                .to_string()
                .as_bytes(),
        ),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn database_outage_on_a_callback_is_503(pool: PgPool) {
    let dead = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(std::time::Duration::from_millis(300))
        .connect_lazy("postgres://postgres@127.0.0.1:1/none")
        .unwrap();
    let st = receiver(&dead, ConsumerConfig::defaults());
    let r = handle_callback(
        &st,
        post(
            "/failure",
            failure_body(&audit_delivery(1), "12-0")
                .to_string()
                .as_bytes(),
        ),
    )
    .await;
    assert_eq!(
        parts(&r).0,
        503,
        "QStash retries the callback; nothing is lost"
    );
    let r = handle_callback(
        &st,
        post(
            "/delivered",
            delivery_body(1, "o-1", 200, 0).to_string().as_bytes(),
        ),
    )
    .await;
    assert_eq!(parts(&r).0, 503);
    let _ = pool;
}

// ---------------------------------------------------------------------------------------------------------
// Replayed callbacks with a rewritten x-outbox-id header. A callback token is valid for five minutes and covers
// the body and URL only: whoever holds one (a proxy log, a captured request) can replay it with any header.

async fn dead_lettered(pool: &PgPool, id: i64) -> bool {
    sqlx::query_scalar("SELECT dead_lettered_at IS NOT NULL FROM outbox WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn delivered(pool: &PgPool, id: i64) -> bool {
    sqlx::query_scalar("SELECT delivered_at IS NOT NULL FROM outbox WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn failure_callback_replayed_with_another_events_id_header_is_refused(pool: PgPool) {
    let a = enqueue_audit(&pool).await;
    let b = enqueue_audit(&pool).await;
    let st = state(&pool);
    // QStash's genuine failure callback for A, replayed with x-outbox-id: B.
    let body = failure_body(&audit_delivery(a), "20-0").to_string();
    let r = handle_callback(&st, post_with_id_header("/failure", body.as_bytes(), b)).await;
    let (status, json) = parts(&r);
    assert_eq!(status, 401, "{json}");
    assert_eq!(json["check"], "header_mismatch", "{json}");
    assert_eq!(count(&pool, "SELECT count(*) FROM dead_letters").await, 0);
    assert!(!dead_lettered(&pool, b).await, "B untouched");
    assert!(!dead_lettered(&pool, a).await);
    // The genuine callback (no header, or an equal copy) is recorded for A, and only A.
    let r = handle_callback(&st, post_with_id_header("/failure", body.as_bytes(), a)).await;
    let (status, json) = parts(&r);
    assert_eq!((status, &json["outbox_id"]), (200, &json!(a)), "{json}");
    assert!(dead_lettered(&pool, a).await && !dead_lettered(&pool, b).await);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn delivery_callback_replayed_with_another_events_id_header_is_refused(pool: PgPool) {
    // A is delivered; B (another key's head) was never delivered. A's 2xx delivery callback replayed with
    // x-outbox-id: B must not become B's delivery evidence (the relay would move B's key past an event the
    // consumer never saw).
    let (a, _) = enqueue_order(&pool, "o-a").await;
    let (b, _) = enqueue_order(&pool, "o-b").await;
    let st = state(&pool);
    let body = delivery_body(a, "o-a", 200, 0).to_string();
    let r = handle_callback(&st, post_with_id_header("/delivered", body.as_bytes(), b)).await;
    let (status, json) = parts(&r);
    assert_eq!(status, 401, "{json}");
    assert_eq!(json["check"], "header_mismatch", "{json}");
    assert!(!delivered(&pool, b).await, "B not marked delivered");
    let done: i64 = sqlx::query_scalar(
        "SELECT done_seq FROM outbox_keys WHERE topic = 'orders' AND partition_key = 'o-b'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(done, 0, "B's key did not advance");
    // A failed attempt of A replayed as B's is refused too (it would write B's last_error).
    let body = delivery_body(a, "o-a", 503, 0).to_string();
    let r = handle_callback(&st, post_with_id_header("/delivered", body.as_bytes(), b)).await;
    assert_eq!(parts(&r).0, 401);
    let err: Option<String> = sqlx::query_scalar("SELECT last_error FROM outbox WHERE id = $1")
        .bind(b)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(err, None);
    // The genuine callback is A's evidence.
    let body = delivery_body(a, "o-a", 200, 0).to_string();
    let r = handle_callback(&st, post("/delivered", body.as_bytes())).await;
    assert_eq!(parts(&r).1["outbox_id"], a);
    assert!(delivered(&pool, a).await && !delivered(&pool, b).await);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn failure_callback_named_only_by_a_request_header_never_links_that_event(pool: PgPool) {
    // The signed body names no event (no envelope, no id in sourceHeader); only the unsigned request header
    // does (old relays forwarded it). The callback is still recorded — a failure callback is never dropped, and
    // a refused one would be lost once QStash gives up — but linked to no event: the header is never used.
    let id = enqueue_audit(&pool).await;
    let st = state(&pool);
    let unnamed = legacy_failure_body(json!({"Content-Type": ["application/json"]}), "21-0");
    for (name, body) in [
        ("readable body", unnamed.to_string().into_bytes()),
        ("unreadable body", b"<html>502</html>".to_vec()),
    ] {
        let r = handle_callback(&st, post_with_id_header("/failure", &body, id)).await;
        let (status, json) = parts(&r);
        assert_eq!(status, 200, "{name}: {json}");
    }
    let dl = dead_letters(&pool).await;
    assert_eq!(dl.len(), 2);
    for d in &dl {
        assert_eq!(d.outbox_id, None, "never the header's id");
    }
    assert!(!dead_lettered(&pool, id).await, "the event is untouched");
}

#[test]
fn callback_parser_tolerates_qstash_variants() {
    // Padded, unpadded and URL-safe base64; numbers as floats; both callerIP spellings.
    let p = parse_callback(
        json!({
            "status": 200.0,
            "body": "Y2hpbmVzZeWNjuivrQ==",
            "sourceBody": "Y2hpbmVzZeWNjuivrQ",
            "callerIp": "1.2.3.4",
            "retried": 0
        })
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    assert!(p.problems.is_empty(), "{:?}", p.problems);
    assert_eq!(p.body.status, Some(200));
    assert_eq!(p.body.body.as_deref(), Some("chinese华语".as_bytes()));
    assert_eq!(
        p.body.source_body.as_deref(),
        Some("chinese华语".as_bytes())
    );
    assert_eq!(p.body.caller_ip.as_deref(), Some("1.2.3.4"));
    let p = parse_callback(br#"{"body":"_-8"}"#).unwrap();
    assert_eq!(p.body.body, Some(vec![0xff, 0xef]));
    let p = parse_callback(br#"{"status":2.5,"retried":"x","notBefore":true}"#).unwrap();
    assert_eq!(p.problems.len(), 3, "{:?}", p.problems);
    assert!(parse_callback(b"").is_err());
    assert!(parse_callback(b"null").is_err());
}

async fn key_state(pool: &PgPool, key: &str) -> (Option<i64>, Option<i64>) {
    sqlx::query_as(
        "SELECT done_seq, blocked_id FROM outbox_keys WHERE topic = 'orders' AND partition_key = $1",
    )
    .bind(key)
    .fetch_optional(pool)
    .await
    .unwrap()
    .map(|(d, b): (i64, Option<i64>)| (Some(d), b))
    .unwrap_or((None, None))
}

async fn dead_letter_state(pool: &PgPool, outbox_id: i64) -> (bool, Option<String>) {
    sqlx::query_as(
        "SELECT resolved_at IS NOT NULL, resolution FROM dead_letters WHERE outbox_id = $1",
    )
    .bind(outbox_id)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// QStash gives up on a message whose every response was lost after the consumer committed: the consumer's
/// dedupe row shows the event applied, so the dead letter is stored resolved ("applied"), the event counts as
/// delivered and its ordered key moves on instead of blocking behind a head that is done.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_dead_letter_for_an_event_the_consumer_applied_is_resolved_and_frees_its_key(
    pool: PgPool,
) {
    let (id, seq) = enqueue_order(&pool, "o-1").await;
    // A second event keeps the key row alive once the head is done (an idle key is released).
    enqueue_order(&pool, "o-1").await;
    // The consumer's transaction committed (its dedupe row), then every response was lost.
    sqlx::query("INSERT INTO processed_messages (consumer, message_id) VALUES ('consumer', $1)")
        .bind(id.to_string())
        .execute(&pool)
        .await
        .unwrap();
    let st = state(&pool);
    let r = handle_callback(
        &st,
        post(
            "/failure",
            failure_body(&order_delivery(id, "o-1", seq), "9-0")
                .to_string()
                .as_bytes(),
        ),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
    assert_eq!(
        dead_letter_state(&pool, id).await,
        (true, Some("applied".into()))
    );
    assert!(delivered(&pool, id).await, "applied means delivered");
    assert!(!dead_lettered(&pool, id).await);
    let (done, blocked) = key_state(&pool, "o-1").await;
    assert_eq!(blocked, None, "a head the consumer applied blocks nothing");
    assert_eq!(done, Some(seq), "the key moved past its head");
    // Not an operator's job: list counts it as handled, redrive refuses it.
    let mut conn = pool.acquire().await.unwrap();
    let page = outbox::dead_letters::list(
        &mut conn,
        &outbox::dead_letters::ListQuery {
            limit: 10,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(page.items.is_empty(), "{:?}", page.items);
    assert_eq!(
        outbox::ops::status(&pool)
            .await
            .unwrap()
            .unresolved_dead_letters(),
        0
    );
    drop(conn);

    // Another consumer's dedupe row is not this consumer's: a dead letter for o-2 stays unresolved.
    let (other, oseq) = enqueue_order(&pool, "o-2").await;
    sqlx::query(
        "INSERT INTO processed_messages (consumer, message_id) VALUES ('someone-else', $1)",
    )
    .bind(other.to_string())
    .execute(&pool)
    .await
    .unwrap();
    let r = handle_callback(
        &st,
        post(
            "/failure",
            failure_body(&order_delivery(other, "o-2", oseq), "10-0")
                .to_string()
                .as_bytes(),
        ),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
    assert_eq!(dead_letter_state(&pool, other).await, (false, None));
    assert!(dead_lettered(&pool, other).await);
}

/// The reverse order of the usual one: the dead letter comes first and blocks the key, then late delivery
/// evidence (a delivery callback with a 2xx that QStash sent after all) shows the head was delivered: the dead
/// letter is resolved ("delivered") and the key moves on.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn late_delivery_evidence_resolves_a_dead_letter_and_unblocks_its_key(pool: PgPool) {
    let (id, seq) = enqueue_order(&pool, "o-1").await;
    // A second event keeps the key row alive once the head is done (an idle key is released).
    enqueue_order(&pool, "o-1").await;
    let st = state(&pool);
    let r = handle_callback(
        &st,
        post(
            "/failure",
            failure_body(&order_delivery(id, "o-1", seq), "11-0")
                .to_string()
                .as_bytes(),
        ),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
    assert_eq!(dead_letter_state(&pool, id).await, (false, None));
    assert_eq!(
        key_state(&pool, "o-1").await.1,
        Some(id),
        "the dead head blocks"
    );

    let r = handle_callback(
        &st,
        post(
            "/delivered",
            delivery_body(id, "o-1", 200, 3).to_string().as_bytes(),
        ),
    )
    .await;
    assert_eq!(parts(&r).0, 200, "{}", parts(&r).1);
    assert_eq!(
        dead_letter_state(&pool, id).await,
        (true, Some("delivered".into()))
    );
    assert!(delivered(&pool, id).await);
    assert!(!dead_lettered(&pool, id).await);
    let (done, blocked) = key_state(&pool, "o-1").await;
    assert_eq!(
        (done, blocked),
        (Some(seq), None),
        "the key moved past its head"
    );
    assert_eq!(
        outbox::ops::status(&pool)
            .await
            .unwrap()
            .unresolved_dead_letters(),
        0
    );
}

/// Per-subscriber trust (decision record 0028): with subscriber keys, a callback about a copy is believed only when
/// the original URL carries the copy's subscriber's signature over the original body and the copies it names are
/// that subscriber's. Whoever runs billing's consumer holds QStash's keys and billing's key: it can neither have
/// shipping's copy dead-lettered (signed with billing's key, unsigned, or an envelope naming billing around
/// shipping's copy) nor recorded as delivered. The genuine callback is recorded.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_callback_about_a_subscribers_copy_needs_that_subscribers_signature(pool: PgPool) {
    const BILLING: &str = "billing-key-0123456789abcdefghijklmnop";
    const SHIPPING: &str = "shipping-key-0123456789abcdefghijklmno";
    let db = outbox::db::Db::new(pool.clone(), outbox::db::Statements::Prepared);
    for (topic, name) in [
        ("audit", "billing"),
        ("audit", "shipping"),
        ("orders", "shipping"),
    ] {
        outbox::subscribers::add(
            &db,
            topic,
            name,
            Some("http://127.0.0.1:9"),
            outbox::subscribers::Start::Now,
            std::time::Duration::from_secs(5),
        )
        .await
        .unwrap();
    }
    let event = enqueue_audit(&pool).await;
    let copy_of = |name: &'static str| {
        sqlx::query_scalar::<_, i64>(
            "SELECT id FROM outbox WHERE coalesce(event_id, id) = $1 AND subscriber = $2",
        )
        .bind(event)
        .bind(name)
        .fetch_one(&pool)
    };
    let (billing, shipping) = (
        copy_of("billing").await.unwrap(),
        copy_of("shipping").await.unwrap(),
    );
    let st = state(&pool).with_subscriber_keys(
        outbox::internals::subscriber_keys::SubscriberKeys::parse(&format!(
            "billing:{BILLING},shipping:{SHIPPING}"
        ))
        .unwrap(),
    );
    let copy = |id: i64, name: &str| audit_delivery(id).subscriber(name).event(event);
    let forged = [
        (
            "signed with billing's key",
            copy(shipping, "shipping").signed_for_subscriber(BILLING),
        ),
        ("unsigned", copy(shipping, "shipping")),
        (
            "billing's envelope around shipping's copy",
            copy(shipping, "billing").signed_for_subscriber(BILLING),
        ),
    ];
    for (i, (what, d)) in forged.iter().enumerate() {
        let body = failure_body(d, &format!("1701198458025-{i}")).to_string();
        let (status, json) = parts(&handle_callback(&st, post("/failure", body.as_bytes())).await);
        assert_eq!(status, 401, "{what}: {json}");
    }
    assert!(dead_letters(&pool).await.is_empty());
    let dead: bool =
        sqlx::query_scalar("SELECT dead_lettered_at IS NOT NULL FROM outbox WHERE id = $1")
            .bind(shipping)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        !dead,
        "shipping's copy was marked dead by a forged callback"
    );
    // The genuine callbacks: each subscriber's own signature.
    for (id, name, key, dlq) in [
        (shipping, "shipping", SHIPPING, "9-0"),
        (billing, "billing", BILLING, "9-1"),
    ] {
        let body = failure_body(&copy(id, name).signed_for_subscriber(key), dlq).to_string();
        let (status, json) = parts(&handle_callback(&st, post("/failure", body.as_bytes())).await);
        assert_eq!(status, 200, "{name}: {json}");
    }
    assert_eq!(dead_letters(&pool).await.len(), 2);

    // Delivery evidence: a forged 2xx for shipping's ordered copy is refused; the genuine one is recorded.
    let (order_event, seq) = enqueue_order(&pool, "o-1").await;
    let order_copy: i64 = sqlx::query_scalar(
        "SELECT id FROM outbox WHERE coalesce(event_id, id) = $1 AND subscriber = 'shipping'",
    )
    .bind(order_event)
    .fetch_one(&pool)
    .await
    .unwrap();
    let evidence = |key: &str| {
        let d = order_delivery(order_copy, "o-1", seq)
            .subscriber("shipping")
            .event(order_event)
            .signed_for_subscriber(key);
        let mut body = delivery_body(order_copy, "o-1", 200, 0);
        body["url"] = json!(d.signed_url());
        body["sourceBody"] = json!(STANDARD.encode(d.body()));
        body.to_string()
    };
    let delivered = || {
        sqlx::query_scalar::<_, bool>("SELECT delivered_at IS NOT NULL FROM outbox WHERE id = $1")
            .bind(order_copy)
            .fetch_one(&pool)
    };
    let (status, json) =
        parts(&handle_callback(&st, post("/delivered", evidence(BILLING).as_bytes())).await);
    assert_eq!(status, 401, "{json}");
    assert!(!delivered().await.unwrap());
    let (status, json) =
        parts(&handle_callback(&st, post("/delivered", evidence(SHIPPING).as_bytes())).await);
    assert_eq!(status, 200, "{json}");
    assert!(delivered().await.unwrap());
}

/// A failure callback for a copy a removal deleted while QStash still held it: the dead letter is the copy's
/// subscriber's (read from the signed envelope, the row being gone), not the default subscriber's, and it is
/// recorded resolved: "applied" when that subscriber applied the event (its dedupe row under the event's id),
/// "withdrawn" otherwise (the copy was not owed any more; an open dead letter would page an operator for nothing).
/// The default subscriber's first copy is never withdrawn.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_failure_callback_for_a_deleted_copy_is_its_subscribers_dead_letter(pool: PgPool) {
    let st = state(&pool);
    let lost = audit_delivery(900).subscriber("search").event(899);
    let body = failure_body(&lost, "1701198458025-7").to_string();
    let (status, json) = parts(&handle_callback(&st, post("/failure", body.as_bytes())).await);
    assert_eq!(status, 200, "{json}");
    let applied = audit_delivery(902).subscriber("search").event(901);
    sqlx::query("INSERT INTO processed_messages (consumer, message_id) VALUES ('search', '901')")
        .execute(&pool)
        .await
        .unwrap();
    let body = failure_body(&applied, "1701198458025-8").to_string();
    let (status, json) = parts(&handle_callback(&st, post("/failure", body.as_bytes())).await);
    assert_eq!(status, 200, "{json}");
    let rows: Vec<(i64, String, Option<String>)> = sqlx::query_as(
        "SELECT outbox_id, subscriber, resolution FROM dead_letters ORDER BY outbox_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        [
            (900, "search".to_owned(), Some("withdrawn".to_owned())),
            (902, "search".to_owned(), Some("applied".to_owned()))
        ]
    );
    let pruned = audit_delivery(904);
    let body = failure_body(&pruned, "1701198458025-9").to_string();
    let (status, json) = parts(&handle_callback(&st, post("/failure", body.as_bytes())).await);
    assert_eq!(status, 200, "{json}");
    let default: (String, Option<String>) =
        sqlx::query_as("SELECT subscriber, resolution FROM dead_letters WHERE outbox_id = 904")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(default, (String::new(), None));
}

/// A removal deleting a named subscriber's in-flight copy while QStash's failure callback for it is being
/// recorded (the explorer's seed 106): the callback waits for the removal and records the copy as withdrawn, not
/// an open dead letter for a row that no longer exists.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_failure_callback_racing_the_removal_of_its_copy_records_it_withdrawn(pool: PgPool) {
    let event: i64 = sqlx::query_scalar(
        "INSERT INTO outbox (topic, partition_key, payload, dispatched_at, delivered_at) \
         VALUES ('audit', 'user-1', '{}', now(), now()) RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let copy: i64 = sqlx::query_scalar(
        "INSERT INTO outbox (topic, partition_key, payload, subscriber, event_id, dispatched_at) \
         VALUES ('audit', 'user-1', '{}', 'search', $1, now()) RETURNING id",
    )
    .bind(event)
    .fetch_one(&pool)
    .await
    .unwrap();
    // The removal's delete, not committed yet.
    let mut removal = pool.begin().await.unwrap();
    let deleted = sqlx::query("DELETE FROM outbox WHERE id = $1 AND dead_lettered_at IS NULL")
        .bind(copy)
        .execute(&mut *removal)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(deleted, 1);
    let body = failure_body(
        &audit_delivery(copy).subscriber("search").event(event),
        "1701198458025-10",
    )
    .to_string();
    let callback = tokio::spawn({
        let pool = pool.clone();
        async move {
            let st = state(&pool);
            parts(&handle_callback(&st, post("/failure", body.as_bytes())).await)
        }
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    removal.commit().await.unwrap();
    let (status, json) = callback.await.unwrap();
    assert_eq!(status, 200, "{json}");
    let row: (i64, String, Option<String>) =
        sqlx::query_as("SELECT outbox_id, subscriber, resolution FROM dead_letters")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        row,
        (copy, "search".to_owned(), Some("withdrawn".to_owned()))
    );
}
