//! The callback function (`outbox::callbacks::handle_callback`) on real Postgres: failure callbacks become
//! dead letters (well-formed, missing fields, string times, garbage — never dropped), delivery callbacks become
//! delivery evidence or a noted failed attempt, anything unsigned or elsewhere is refused.

mod support;

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
use outbox::callbacks::{handle_callback, parse_callback};
use outbox::config::ConsumerConfig;
use outbox::consumer::ReceiverState;
use outbox::example::{self, LineItem, OrderEvent, OrderPlaced};
use outbox::producer::{NewEvent, Topic, enqueue};
use serde_json::{Value, json};
use sqlx::{PgPool, Row};
use support::*;

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
    ev.id
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
    (ev.id, ev.seq.unwrap())
}

fn failure_body(outbox_id: i64, dlq_id: &str) -> Value {
    json!({
        "status": 503,
        "header": {"Content-Type": ["application/json"]},
        "body": b64(r#"{"error":"database error"}"#),
        "retried": 5,
        "maxRetries": 5,
        "dlqId": dlq_id,
        "sourceMessageId": "msg_abc",
        "url": url("/events/audit"),
        "method": "POST",
        "sourceHeader": {"Content-Type": ["application/json"], "X-Outbox-Id": [outbox_id.to_string()]},
        "sourceBody": b64(r#"{"actor":"u","action":"a"}"#),
        "notBefore": 1_701_198_458_025_i64,
        "createdAt": 1_701_198_447_054_i64,
        "callerIP": "178.247.74.179"
    })
}

fn post(path: &str, body: &[u8], outbox_id: Option<i64>) -> lambda_http::Request {
    let id = outbox_id.map(|i| i.to_string());
    let mut h: Vec<(&str, &str)> = vec![("upstash-message-id", "msg_callback")];
    if let Some(id) = &id {
        h.push(("x-outbox-id", id));
    }
    signed_post(path, body, &h)
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

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn well_formed_failure_callback_is_recorded_once(pool: PgPool) {
    let id = enqueue_audit(&pool).await;
    let st = state(&pool);
    let body = failure_body(id, "1701198458025-0").to_string();
    let r = handle_callback(&st, post("/failure", body.as_bytes(), Some(id))).await;
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
    assert_eq!(d.payload, Some(json!({"actor":"u","action":"a"})));
    assert_eq!(d.status, Some(503));
    assert_eq!(d.attempts, Some(6));
    assert_eq!(
        d.response_body.as_deref(),
        Some(r#"{"error":"database error"}"#)
    );
    assert_eq!(d.qstash_message_id.as_deref(), Some("msg_abc"));
    assert_eq!(
        d.headers.as_ref().unwrap()["X-Outbox-Id"],
        json!([id.to_string()])
    );
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
    let r = handle_callback(&st, post("/failure", body.as_bytes(), Some(id))).await;
    assert_eq!(parts(&r), (200, json!({"status":"duplicate"})));
    assert_eq!(count(&pool, "SELECT count(*) FROM dead_letters").await, 1);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn outbox_id_falls_back_to_the_source_headers(pool: PgPool) {
    let id = enqueue_audit(&pool).await;
    let st = state(&pool);
    let mut body = failure_body(id, "2-0");
    body["sourceHeader"] = json!({"Upstash-Forward-X-Outbox-Id": [id.to_string()]});
    let r = handle_callback(&st, post("/failure", body.to_string().as_bytes(), None)).await;
    assert_eq!(parts(&r).0, 200);
    assert_eq!(dead_letters(&pool).await[0].outbox_id, Some(id));
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn failure_callback_with_missing_fields(pool: PgPool) {
    let id = enqueue_audit(&pool).await;
    let st = state(&pool);
    // Only a dlqId.
    let r = handle_callback(&st, post("/failure", br#"{"dlqId":"3-0"}"#, Some(id))).await;
    assert_eq!(parts(&r).0, 200);
    // Nothing at all but an empty object, twice (idempotent through the raw body), and without an outbox id.
    for _ in 0..2 {
        let r = handle_callback(&st, post("/failure", b"{}", None)).await;
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

#[sqlx::test(migrator = "outbox::MIGRATOR")]
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
    let r = handle_callback(&st, post("/failure", body.to_string().as_bytes(), None)).await;
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

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn garbage_failure_callback_is_stored_raw_never_dropped(pool: PgPool) {
    let id = enqueue_audit(&pool).await;
    let st = state(&pool);
    let garbage: &[u8] = b"<html>502 Bad Gateway</html>\xff\xfe";
    let r = handle_callback(&st, post("/failure", garbage, Some(id))).await;
    assert_eq!(
        parts(&r).0,
        200,
        "a signed but unreadable failure callback is still acknowledged"
    );
    // A JSON array, and an object with wrong types, are kept too.
    let r = handle_callback(&st, post("/failure", b"[1,2,3]", Some(id))).await;
    assert_eq!(parts(&r).0, 200);
    let bad_fields =
        json!({"dlqId": "5-0", "status": {"x": 1}, "sourceBody": "***not base64***"}).to_string();
    let r = handle_callback(&st, post("/failure", bad_fields.as_bytes(), Some(id))).await;
    assert_eq!(parts(&r).0, 200);
    // The garbage again: idempotent.
    let r = handle_callback(&st, post("/failure", garbage, Some(id))).await;
    assert_eq!(parts(&r), (200, json!({"status":"duplicate"})));

    let dl = dead_letters(&pool).await;
    assert_eq!(dl.len(), 3);
    assert_eq!(dl[0].raw_callback.as_deref(), Some(garbage));
    assert!(dl[0].parse_error.as_deref().unwrap().contains("not JSON"));
    assert_eq!(
        dl[0].outbox_id,
        Some(id),
        "linked through the forwarded header"
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
    assert_eq!(dl[2].raw_callback.as_deref(), Some(bad_fields.as_bytes()));
    // Visible in one query.
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letters WHERE outbox_id = $1")
        .bind(id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 3);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn failure_of_a_pruned_event_keeps_its_id_topic_and_key(pool: PgPool) {
    // The outbox row is gone (pruned while QStash still retried): the dead letter keeps what the callback says.
    let st = state(&pool);
    let mut body = failure_body(999, "6-0");
    body["url"] = json!(url("/events/orders"));
    body["sourceHeader"] = json!({"X-Outbox-Key": ["order%201"]});
    let r = handle_callback(
        &st,
        post("/failure", body.to_string().as_bytes(), Some(999)),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
    let d = &dead_letters(&pool).await[0];
    assert_eq!(d.outbox_id, Some(999));
    assert_eq!(d.topic.as_deref(), Some("orders"));
    assert_eq!(d.partition_key.as_deref(), Some("order 1"));
    assert_eq!(d.payload, Some(json!({"actor":"u","action":"a"})));
    assert!(d.body.is_none());
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn failure_of_an_ordered_head_applies_the_dead_head_policy(pool: PgPool) {
    let (id, seq) = enqueue_order(&pool, "o-1").await;
    assert_eq!(seq, 1);
    let st = state(&pool);
    let r = handle_callback(
        &st,
        post(
            "/failure",
            failure_body(id, "7-0").to_string().as_bytes(),
            Some(id),
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
    let (id2, _) = enqueue_order(&pool, "o-2").await;
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
            failure_body(id2, "8-0").to_string().as_bytes(),
            Some(id2),
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

fn delivery_body(status: i32, retried: i32) -> Value {
    json!({
        "status": status,
        "header": {"Content-Type": ["application/json"]},
        "body": b64(&format!(r#"{{"error":"status {status} from the consumer, with a long explanation {}"}}"#, "x".repeat(2000))),
        "retried": retried,
        "maxRetries": 3,
        "sourceMessageId": "msg_1",
        "url": url("/events/orders"),
        "method": "POST",
        "sourceBody": b64("{}"),
        "notBefore": 1_701_198_458_025_i64,
        "createdAt": "1701198447054"
    })
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn delivery_callback_2xx_is_delivery_evidence(pool: PgPool) {
    let (id, _) = enqueue_order(&pool, "o-1").await;
    let st = state(&pool);
    let r = handle_callback(
        &st,
        post(
            "/delivered",
            delivery_body(200, 0).to_string().as_bytes(),
            Some(id),
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
            delivery_body(204, 0).to_string().as_bytes(),
            Some(id),
        ),
    )
    .await;
    assert_eq!(parts(&r).1["key_advanced"], false);
    // Evidence for an event we do not know: acknowledged.
    let r = handle_callback(
        &st,
        post(
            "/delivered",
            delivery_body(200, 0).to_string().as_bytes(),
            Some(424242),
        ),
    )
    .await;
    assert_eq!(
        parts(&r),
        (200, json!({"status":"unknown_event","outbox_id":424242}))
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn delivery_callback_failure_is_noted_on_the_event(pool: PgPool) {
    let (id, _) = enqueue_order(&pool, "o-1").await;
    let st = state(&pool);
    let r = handle_callback(
        &st,
        post(
            "/delivered",
            delivery_body(503, 1).to_string().as_bytes(),
            Some(id),
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
            delivery_body(500, 3).to_string().as_bytes(),
            Some(id),
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

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn unusable_delivery_callbacks_are_489(pool: PgPool) {
    let (id, _) = enqueue_order(&pool, "o-1").await;
    let st = state(&pool);
    let cases: Vec<(&str, Vec<u8>, Option<i64>)> = vec![
        ("garbage", b"not json".to_vec(), Some(id)),
        (
            "no status",
            json!({"retried": 0}).to_string().into_bytes(),
            Some(id),
        ),
        (
            "status of the wrong type",
            json!({"status": [200]}).to_string().into_bytes(),
            Some(id),
        ),
        (
            "no outbox id anywhere",
            delivery_body(200, 0).to_string().into_bytes(),
            None,
        ),
    ];
    for (name, body, oid) in cases {
        let r = handle_callback(&st, post("/delivered", &body, oid)).await;
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

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn unsigned_oversized_and_unknown_paths_are_refused(pool: PgPool) {
    let id = enqueue_audit(&pool).await;
    let st = state(&pool);
    let body = failure_body(id, "9-0").to_string();
    // No signature.
    let r = handle_callback(
        &st,
        request_from_event(&function_url_event(
            "POST",
            "/failure",
            "",
            &[("x-outbox-id", &id.to_string())],
            body.as_bytes(),
        )),
    )
    .await;
    assert_eq!(parts(&r).0, 401);
    // Signed for the other callback path.
    let sig = token(KEY, &url("/delivered"), body.as_bytes());
    let r = handle_callback(
        &st,
        request_from_event(&function_url_event(
            "POST",
            "/failure",
            "",
            &[("upstash-signature", &sig)],
            body.as_bytes(),
        )),
    )
    .await;
    let (status, json) = parts(&r);
    assert_eq!((status, json["check"].as_str()), (401, Some("subject")));
    // Signed, but for a path we do not serve.
    let r = handle_callback(&st, post("/events/audit", body.as_bytes(), Some(id))).await;
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
    let r = handle_callback(&small, post("/failure", big.as_bytes(), Some(id))).await;
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

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_path_prefix_and_a_trailing_slash_still_route(pool: PgPool) {
    let id = enqueue_audit(&pool).await;
    let st = state(&pool);
    let r = handle_callback(
        &st,
        post(
            "/qstash/failure/",
            failure_body(id, "11-0").to_string().as_bytes(),
            Some(id),
        ),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
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
            failure_body(1, "12-0").to_string().as_bytes(),
            Some(1),
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
            delivery_body(200, 0).to_string().as_bytes(),
            Some(1),
        ),
    )
    .await;
    assert_eq!(parts(&r).0, 503);
    let _ = pool;
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
