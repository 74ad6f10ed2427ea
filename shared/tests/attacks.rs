//! Replay attacks on the consumer and deliveries in the previous wire format, through the real handler
//! (`outbox::consumer::handle_event`) on real Postgres.
//!
//! A QStash token is valid for five minutes and covers the body (`body` claim) and the URL (`sub`) only. Whoever
//! holds one valid delivery — a proxy's access log, a captured request, a debugging session — can replay it
//! within that window with any request header changed. So nothing that decides a write may come from a header:
//! each test here takes a genuine signed delivery, rewrites a header, and checks that nothing is written and the
//! genuine deliveries still apply afterwards.
//!
//! Deliveries published by the relay before the signed contract (no `contract` in their URL, identity in
//! `x-outbox-*` headers) can still arrive after an upgrade: they are applied only when the outbox row named by
//! `x-outbox-id` has the delivery's topic and payload, is dispatched and (ordered) follows an event this consumer
//! applied (`LEGACY_DELIVERIES=verify`), or refused (`LEGACY_DELIVERIES=refuse`).

use lambda_http::Request;
use orders_example::{self as example, LineItem, OrderCancelled, OrderEvent, OrderPlaced};
use outbox::config::{ConsumerConfig, LegacyDeliveries};
use outbox::consumer::{ConsumerState, Event, Handler, HandlerError, Registry, handle_event};
use outbox::producer::{NewEvent, Topic};
use outbox_testkit::receiving::*;
use serde_json::{Value, json};
use sqlx::{PgConnection, PgPool};

fn placed(order_id: &str, amount_cents: i64) -> OrderEvent {
    OrderEvent::OrderPlaced(OrderPlaced {
        order_id: order_id.into(),
        customer_id: "customer-7".into(),
        amount_cents,
        currency: "EUR".into(),
        items: vec![LineItem {
            sku: "BOOK-1".into(),
            quantity: 1,
        }],
    })
}

/// An outbox row as the producer wrote it.
struct Row {
    id: i64,
    topic: String,
    key: String,
    seq: Option<i64>,
    schema_version: Option<u32>,
    /// The payload as Postgres renders the `jsonb` (what a relay sends).
    payload: String,
}

async fn row(pool: &PgPool, id: i64) -> Row {
    let (topic, key, seq, headers, payload): (String, String, Option<i64>, Option<Value>, String) =
        sqlx::query_as(
            "SELECT topic, partition_key, seq, headers, payload::text FROM outbox WHERE id = $1",
        )
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap();
    Row {
        id,
        topic,
        key,
        seq,
        schema_version: headers
            .and_then(|h| h["schema_version"].as_u64())
            .map(|v| u32::try_from(v).unwrap()),
        payload,
    }
}

/// Enqueues an `OrderPlaced` (ordered topic `orders`, key = order id).
async fn enqueue_order(pool: &PgPool, order_id: &str) -> Row {
    let mut tx = pool.begin().await.unwrap();
    let ev = outbox::enqueue(
        &mut tx,
        example::order_event(&placed(order_id, 100)).unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    row(pool, ev.id.get()).await
}

/// Enqueues an `OrderCancelled` (the next event of the order's key).
async fn enqueue_cancel(pool: &PgPool, order_id: &str) -> Row {
    let mut tx = pool.begin().await.unwrap();
    let ev = outbox::enqueue(
        &mut tx,
        example::order_event(&OrderEvent::OrderCancelled(OrderCancelled {
            order_id: order_id.into(),
            reason: None,
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    row(pool, ev.id.get()).await
}

/// Enqueues an audit entry (unordered topic `audit`).
async fn enqueue_audit(pool: &PgPool, actor: &str) -> Row {
    let mut tx = pool.begin().await.unwrap();
    let ev = outbox::enqueue(
        &mut tx,
        NewEvent::new(
            &Topic::unordered("audit"),
            actor,
            &json!({"actor": actor, "action": "login"}),
        )
        .unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    row(pool, ev.id.get()).await
}

/// The current relay's delivery of `r` (evidence by QStash's delivery callback, the relay's default).
fn delivery_of(r: &Row) -> Delivery {
    let mut d = Delivery::new(&r.topic, r.id, r.payload.as_bytes()).key(&r.key);
    if let Some(seq) = r.seq {
        d = d.seq(seq).evidence_by_callback();
    }
    if let Some(v) = r.schema_version {
        d = d.schema_version(v);
    }
    d
}

/// The previous relay's delivery of `r`: payload as body, identity in headers, no contract version in the URL.
fn legacy_delivery_of(r: &Row, extra: &[(&str, &str)]) -> Request {
    let key = outbox::internals::contract::encode_key(&r.key);
    let seq = r.seq.map(|s| s.to_string());
    let version = r.schema_version.map(|v| v.to_string());
    let mut h: Vec<(&str, &str)> = vec![("x-outbox-key", &key)];
    if let Some(s) = &seq {
        h.push(("x-outbox-seq", s));
    }
    if let Some(v) = &version {
        h.push(("x-schema-version", v));
    }
    h.extend_from_slice(extra);
    legacy_request(&r.topic, r.id, r.payload.as_bytes(), &h)
}

fn consumer_with(pool: &PgPool, config: ConsumerConfig) -> ConsumerState {
    ConsumerState::new(receiver(pool, config), example::registry())
}

/// Marks events dispatched, as the previous relay left them once QStash accepted their old-format message.
async fn mark_dispatched(pool: &PgPool, rows: &[&Row]) {
    for r in rows {
        sqlx::query("UPDATE outbox SET dispatched_at = now() WHERE id = $1")
            .bind(r.id)
            .execute(pool)
            .await
            .unwrap();
    }
}

async fn processed(pool: &PgPool, id: i64) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM processed_messages WHERE message_id = $1)")
        .bind(id.to_string())
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

async fn done_seq(pool: &PgPool, key: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT done_seq FROM outbox_keys WHERE topic = 'orders' AND partition_key = $1",
    )
    .bind(key)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Asserts a 401 `header_mismatch` answer.
fn assert_refused_as_altered(r: &lambda_http::Response<lambda_http::Body>, what: &str) {
    let (status, json) = parts(r);
    assert_eq!(status, 401, "{what}: {json}");
    assert_eq!(json["check"], "header_mismatch", "{what}: {json}");
    assert!(
        json["error"]
            .as_str()
            .unwrap()
            .starts_with("request refused: "),
        "{what}: {json}"
    );
}

// ---------------------------------------------------------------------------------------------------------
// Current deliveries replayed with rewritten headers.

/// Records the application headers its handler sees (topic `tenanted`), in `seen_headers`.
struct RecordHeaders;

impl Handler<Value> for RecordHeaders {
    async fn handle(&self, conn: &mut PgConnection, e: &Event<Value>) -> Result<(), HandlerError> {
        assert_eq!(
            e.header("Tenant"),
            e.headers().get("tenant").map(String::as_str)
        );
        sqlx::query("INSERT INTO seen_headers (outbox_id, headers) VALUES ($1, $2)")
            .bind(e.meta.outbox_id)
            .bind(serde_json::to_value(e.headers()).unwrap())
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

async fn seen_headers(pool: &PgPool, id: i64) -> Value {
    sqlx::query_scalar("SELECT headers FROM seen_headers WHERE outbox_id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn user_headers_come_from_the_signed_envelope_never_from_request_headers(pool: PgPool) {
    // A handler may decide from a user header (the tenant): a replay with request headers naming another tenant,
    // or adding one, must not change what it sees.
    sqlx::query("CREATE TABLE seen_headers (outbox_id bigint PRIMARY KEY, headers jsonb NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let st = consumer(&pool, Registry::new().on("tenanted", RecordHeaders));
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let genuine = Delivery::new("tenanted", 1001, br#"{"n":1}"#)
        .header("traceparent", tp)
        .header("x-correlation-id", "req-9")
        .header("tenant", "acme");
    let r = handle_event(
        &st,
        genuine
            .clone()
            .request_header("tenant", "globex")
            .request_header("upstash-forward-tenant", "globex")
            .request_header("role", "admin")
            .request(),
    )
    .await;
    assert_eq!(parts(&r).0, 200, "{:?}", parts(&r));
    assert_eq!(
        seen_headers(&pool, 1001).await,
        json!({"tenant": "acme"}),
        "the envelope's tenant only; the pipeline's own entries are not user headers"
    );

    // No user header in the envelope: request headers do not add any.
    let bare = Delivery::new("tenanted", 1002, br#"{"n":2}"#).request_header("tenant", "globex");
    assert_eq!(parts(&handle_event(&st, bare.request()).await).0, 200);
    assert_eq!(seen_headers(&pool, 1002).await, json!({}));

    // A delivery in the previous wire format carries none, whatever its request headers and its row say (ids of
    // the fake deliveries above are far from the outbox's).
    let mut tx = pool.begin().await.unwrap();
    let ev = outbox::enqueue(
        &mut tx,
        NewEvent::new(&Topic::unordered("tenanted"), "k", &json!({"n": 3}))
            .unwrap()
            .header("tenant", "acme"),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let old = row(&pool, ev.id.get()).await;
    mark_dispatched(&pool, &[&old]).await;
    let r = handle_event(&st, legacy_delivery_of(&old, &[("tenant", "globex")])).await;
    assert_eq!(
        parts(&r),
        (
            200,
            json!({"status":"processed","outbox_id":ev.id,"events":[{"id":ev.id,"outcome":"processed"}]})
        )
    );
    assert_eq!(seen_headers(&pool, ev.id.get()).await, json!({}));
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn replayed_delivery_with_another_outbox_id_header_is_refused(pool: PgPool) {
    // A's genuine delivery replayed with x-outbox-id: B. Applied under B, it would write A's effect a second time
    // and make B's own delivery a "duplicate": B's effect would be lost.
    let a = enqueue_audit(&pool, "alice").await;
    let b = enqueue_audit(&pool, "bob").await;
    let st = consumer(&pool, example::registry());
    let r = handle_event(
        &st,
        delivery_of(&a)
            .request_header("x-outbox-id", &b.id.to_string())
            .request(),
    )
    .await;
    assert_refused_as_altered(&r, "x-outbox-id of another event");
    assert!(!processed(&pool, b.id).await, "no dedupe row for B");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_messages").await,
        0
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM audit_log").await, 0);

    // B's real delivery arrives later: applied, not a duplicate. A's too.
    let r = handle_event(&st, delivery_of(&b).request()).await;
    assert_eq!(
        parts(&r),
        (
            200,
            json!({"status":"processed","outbox_id":b.id,"events":[{"id":b.id,"outcome":"processed"}]})
        )
    );
    let r = handle_event(&st, delivery_of(&a).request()).await;
    assert_eq!(
        parts(&r),
        (
            200,
            json!({"status":"processed","outbox_id":a.id,"events":[{"id":a.id,"outcome":"processed"}]})
        )
    );
    let actors: Vec<String> = sqlx::query_scalar("SELECT actor FROM audit_log ORDER BY actor")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(actors, vec!["alice", "bob"]);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn replayed_delivery_with_forged_sequence_or_key_headers_is_refused(pool: PgPool) {
    // Event seq 1 of key K replayed with x-outbox-seq: 5 would record sequence 5 for K, and the genuine
    // seq 2..4 would then be refused as late (489, dead-lettered); with another x-outbox-key it would be
    // applied under that key's sequence.
    let e1 = enqueue_order(&pool, "order-k").await;
    let e2 = enqueue_order(&pool, "order-l").await;
    assert_eq!((e1.seq, e2.seq), (Some(1), Some(1)));
    let st = consumer(&pool, example::registry());
    for (name, header, value) in [
        ("forged sequence", "x-outbox-seq", "5".to_owned()),
        ("forged key", "x-outbox-key", "order-l".to_owned()),
        ("forged topic", "x-outbox-topic", "audit".to_owned()),
        ("forged schema version", "x-schema-version", "1".to_owned()),
    ] {
        let r = handle_event(
            &st,
            delivery_of(&e1).request_header(header, &value).request(),
        )
        .await;
        assert_refused_as_altered(&r, name);
    }
    assert_eq!(
        count(&pool, "SELECT count(*) FROM consumer_sequences").await,
        0,
        "no sequence recorded for any key"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_messages").await,
        0
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM charges").await, 0);

    // Copies that agree with the envelope are fine (the key compared after percent-decoding).
    let r = handle_event(
        &st,
        delivery_of(&e1)
            .request_header("x-outbox-seq", "1")
            .request_header("x-outbox-key", "order%2Dk")
            .request_header("x-outbox-topic", "orders")
            .request_header("x-schema-version", "2")
            .request(),
    )
    .await;
    assert_eq!(
        parts(&r),
        (
            200,
            json!({"status":"processed","outbox_id":e1.id,"events":[{"id":e1.id,"outcome":"processed"}]})
        )
    );
    let r = handle_event(&st, delivery_of(&e2).request()).await;
    assert_eq!(parts(&r).0, 200);
    let seqs: Vec<(String, i64)> = sqlx::query_as(
        "SELECT partition_key, last_seq FROM consumer_sequences ORDER BY partition_key",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        seqs,
        vec![("order-k".to_owned(), 1), ("order-l".to_owned(), 1)]
    );
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn forged_evidence_header_records_no_delivery_evidence(pool: PgPool) {
    // The relay runs with callback evidence: QStash's delivery callback frees a key. A delivery replayed with
    // x-outbox-evidence: consumer would make the consumer record delivery evidence itself; with the id, key and
    // sequence of an event the relay has not published yet (B), B would be marked delivered and its key moved
    // on — B never reaches the consumer.
    let a = enqueue_order(&pool, "order-a").await;
    let b = enqueue_order(&pool, "order-b").await;
    let st = consumer(&pool, example::registry());
    let r = handle_event(
        &st,
        delivery_of(&a)
            .request_header("x-outbox-evidence", "consumer")
            .request(),
    )
    .await;
    assert_refused_as_altered(&r, "forged evidence");
    let b_id = b.id.to_string();
    let r = handle_event(
        &st,
        delivery_of(&a)
            .request_header("x-outbox-id", &b_id)
            .request_header("x-outbox-key", "order-b")
            .request_header("x-outbox-seq", "1")
            .request_header("x-outbox-evidence", "consumer")
            .request(),
    )
    .await;
    assert_refused_as_altered(&r, "forged evidence for an unpublished event");
    for ev in [&a, &b] {
        assert!(!delivered(&pool, ev.id).await, "no evidence for {}", ev.id);
        assert!(!processed(&pool, ev.id).await);
    }
    assert_eq!(done_seq(&pool, "order-a").await, 0);
    assert_eq!(done_seq(&pool, "order-b").await, 0, "B's key did not move");

    // A's genuine delivery is applied; its evidence stays the callback's job.
    let r = handle_event(&st, delivery_of(&a).request()).await;
    assert_eq!(parts(&r).0, 200);
    assert!(!delivered(&pool, a.id).await);
    assert_eq!(done_seq(&pool, "order-a").await, 0);
}

// ---------------------------------------------------------------------------------------------------------
// Deliveries in the previous wire format (in flight inside QStash across an upgrade).

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn legacy_delivery_matching_its_outbox_row_is_applied_once_with_evidence(pool: PgPool) {
    let ordered = enqueue_order(&pool, "order-old").await;
    let next = enqueue_cancel(&pool, "order-old").await;
    assert_eq!(next.seq, Some(2));
    let unordered = enqueue_audit(&pool, "carol").await;
    mark_dispatched(&pool, &[&ordered, &unordered]).await;
    let st = consumer(&pool, example::registry());
    let r = handle_event(&st, legacy_delivery_of(&ordered, &[])).await;
    assert_eq!(
        parts(&r),
        (
            200,
            json!({"status":"processed","outbox_id":ordered.id,"events":[{"id":ordered.id,"outcome":"processed"}]})
        )
    );
    // QStash redelivers it: a duplicate.
    let r = handle_event(&st, legacy_delivery_of(&ordered, &[])).await;
    assert_eq!(
        parts(&r),
        (
            200,
            json!({"status":"duplicate","outbox_id":ordered.id,"events":[{"id":ordered.id,"outcome":"duplicate"}]})
        )
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM charges WHERE order_id = 'order-old'"
        )
        .await,
        1
    );
    // The row is in this database, so the ordered event's delivery evidence is recorded here: the key moves on
    // whether or not the old message asked for a delivery callback.
    assert!(delivered(&pool, ordered.id).await);
    assert_eq!(done_seq(&pool, "order-old").await, 1);
    // Key and sequence come from the row.
    let (key, last): (String, i64) =
        sqlx::query_as("SELECT partition_key, last_seq FROM consumer_sequences")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((key.as_str(), last), ("order-old", 1));

    // An unordered one, with its payload's JSON re-spaced (compared as jsonb, not as bytes).
    let mut respaced = unordered.payload.replace(", ", ",");
    assert_ne!(respaced, unordered.payload);
    respaced.insert(0, ' ');
    let r = handle_event(
        &st,
        legacy_request("audit", unordered.id, respaced.as_bytes(), &[]),
    )
    .await;
    assert_eq!(
        parts(&r),
        (
            200,
            json!({"status":"processed","outbox_id":unordered.id,"events":[{"id":unordered.id,"outcome":"processed"}]})
        )
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM audit_log").await, 1);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn legacy_delivery_naming_a_missing_outbox_row_is_refused_permanently(pool: PgPool) {
    let st = consumer(&pool, example::registry());
    let r = handle_event(
        &st,
        legacy_request(
            "audit",
            777,
            br#"{"actor":"mallory","action":"login"}"#,
            &[],
        ),
    )
    .await;
    let (status, json) = parts(&r);
    assert_eq!(status, 489, "{json}");
    assert_eq!(
        r.headers().get("upstash-nonretryable-error").unwrap(),
        "true"
    );
    let msg = json["error"].as_str().unwrap();
    assert!(
        msg.contains("outbox id 777") && msg.contains("not in the outbox"),
        "{msg}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_messages").await,
        0
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM audit_log").await, 0);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn legacy_delivery_whose_id_header_names_another_event_is_refused(pool: PgPool) {
    let a = enqueue_order(&pool, "order-a").await;
    let b = enqueue_order(&pool, "order-b").await;
    let audit = enqueue_audit(&pool, "dave").await;
    mark_dispatched(&pool, &[&a, &b, &audit]).await;
    let st = consumer(&pool, example::registry());
    // A's old-format delivery (signed body: A's payload) with x-outbox-id: B (payload differs).
    let b_id = b.id.to_string();
    let r = handle_event(&st, legacy_delivery_of(&a, &[("x-outbox-id", &b_id)])).await;
    assert_refused_as_altered(&r, "x-outbox-id of an event with another payload");
    // The audit delivery's x-outbox-id rewritten to an orders event (topic differs).
    let r = handle_event(
        &st,
        legacy_request("audit", a.id, audit.payload.as_bytes(), &[]),
    )
    .await;
    assert_refused_as_altered(&r, "x-outbox-id of an event of another topic");
    // The right id with a forged sequence or key: the row decides, a disagreeing header is refused.
    for (name, header, value) in [
        ("sequence", "x-outbox-seq", "7"),
        ("key", "x-outbox-key", "order-b"),
    ] {
        let r = handle_event(&st, legacy_delivery_of(&a, &[(header, value)])).await;
        assert_refused_as_altered(&r, name);
    }
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_messages").await,
        0
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM charges").await, 0);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM consumer_sequences").await,
        0
    );
    assert!(!delivered(&pool, b.id).await);
    assert_eq!(done_seq(&pool, "order-b").await, 0);

    // The genuine old-format deliveries apply.
    for ev in [&a, &b] {
        let r = handle_event(&st, legacy_delivery_of(ev, &[])).await;
        assert_eq!(
            parts(&r),
            (
                200,
                json!({"status":"processed","outbox_id":ev.id,"events":[{"id":ev.id,"outcome":"processed"}]})
            )
        );
    }
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn legacy_delivery_naming_an_undispatched_twin_is_retried_not_applied(pool: PgPool) {
    // Two events of one key with the same payload: topic and payload cannot tell them apart. The second is not
    // dispatched (the previous relay published a key's next event only after its predecessor was delivered), so
    // no genuine old-format delivery of it can exist: a replay of the first with x-outbox-id of the second must
    // not apply it out of turn.
    let first = enqueue_order(&pool, "twin").await;
    let second = enqueue_order(&pool, "twin").await;
    assert_eq!(first.payload, second.payload);
    assert_eq!((first.seq, second.seq), (Some(1), Some(2)));
    mark_dispatched(&pool, &[&first]).await;
    let st = consumer(&pool, example::registry());
    let second_id = second.id.to_string();
    let r = handle_event(
        &st,
        legacy_delivery_of(
            &first,
            &[("x-outbox-id", &second_id), ("x-outbox-seq", "2")],
        ),
    )
    .await;
    let (status, json) = parts(&r);
    assert_eq!(status, 503, "{json}");
    assert!(
        json["error"]
            .as_str()
            .unwrap()
            .contains("not show as dispatched"),
        "{json}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_messages").await,
        0
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM consumer_sequences").await,
        0
    );
    // The first one's genuine delivery is applied in order.
    let r = handle_event(&st, legacy_delivery_of(&first, &[])).await;
    assert_eq!(
        parts(&r),
        (
            200,
            json!({"status":"processed","outbox_id":first.id,"events":[{"id":first.id,"outcome":"processed"}]})
        )
    );
}

/// Two events of one key with the same payload, dispatched together as one run (decision record 0014: the relay
/// sets `dispatched_at` on every member and the key awaits the evidence of the last one).
async fn dispatched_twin_run(pool: &PgPool, key: &str) -> (Row, Row) {
    let first = enqueue_order(pool, key).await;
    let second = enqueue_order(pool, key).await;
    assert_eq!(first.payload, second.payload);
    assert_eq!((first.seq, second.seq), (Some(1), Some(2)));
    mark_dispatched(pool, &[&first, &second]).await;
    sqlx::query(
        "UPDATE outbox_keys SET inflight_id = $2, inflight_since = now() \
         WHERE topic = 'orders' AND partition_key = $1",
    )
    .bind(key)
    .bind(second.id)
    .execute(pool)
    .await
    .unwrap();
    (first, second)
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn legacy_delivery_of_a_run_member_before_its_predecessor_is_applied_is_retried_not_applied(
    pool: PgPool,
) {
    // Both events of the run are dispatched, so "dispatched" no longer says the predecessor was delivered. With
    // identical payloads, the second's old-format delivery is byte for byte the first's with x-outbox-id (and
    // x-outbox-seq) rewritten: a replay that must not apply the second before the first.
    let (first, second) = dispatched_twin_run(&pool, "twin-run").await;
    let st = consumer(&pool, example::registry());
    let r = handle_event(&st, legacy_delivery_of(&second, &[])).await;
    let (status, json) = parts(&r);
    assert_eq!(status, 503, "{json}");
    assert_eq!(r.headers().get("retry-after").unwrap(), "60");
    assert!(
        json["error"]
            .as_str()
            .unwrap()
            .contains("whose predecessor this consumer has not applied yet"),
        "{json}"
    );
    assert!(!processed(&pool, second.id).await);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM consumer_sequences").await,
        0
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM charges").await, 0);
    assert!(!delivered(&pool, second.id).await);

    // The first is applied; then the second's delivery (QStash's retry) applies in order.
    for ev in [&first, &second] {
        let r = handle_event(&st, legacy_delivery_of(ev, &[])).await;
        assert_eq!(
            parts(&r),
            (
                200,
                json!({"status":"processed","outbox_id":ev.id,"events":[{"id":ev.id,"outcome":"processed"}]})
            )
        );
    }
    let last: i64 = sqlx::query_scalar(
        "SELECT last_seq FROM consumer_sequences WHERE partition_key = 'twin-run'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(last, 2);
    assert!(delivered(&pool, first.id).await && delivered(&pool, second.id).await);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn legacy_delivery_of_a_run_member_applies_once_its_key_moved_past_the_predecessor(
    pool: PgPool,
) {
    // The predecessor was never applied here, but the key moved past it (dead, and its topic skips dead heads):
    // nothing is left to wait for.
    let (_first, second) = dispatched_twin_run(&pool, "skipped-head").await;
    sqlx::query("UPDATE outbox_keys SET done_seq = 1 WHERE partition_key = 'skipped-head'")
        .execute(&pool)
        .await
        .unwrap();
    let st = consumer(&pool, example::registry());
    let r = handle_event(&st, legacy_delivery_of(&second, &[])).await;
    assert_eq!(
        parts(&r),
        (
            200,
            json!({"status":"processed","outbox_id":second.id,"events":[{"id":second.id,"outcome":"processed"}]})
        )
    );
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn legacy_deliveries_refused_by_setting_are_489_naming_it(pool: PgPool) {
    let ev = enqueue_order(&pool, "order-old").await;
    let st = consumer_with(
        &pool,
        ConsumerConfig {
            legacy_deliveries: LegacyDeliveries::Refuse,
            ..ConsumerConfig::defaults()
        },
    );
    let r = handle_event(&st, legacy_delivery_of(&ev, &[])).await;
    let (status, json) = parts(&r);
    assert_eq!(status, 489, "{json}");
    assert_eq!(
        r.headers().get("upstash-nonretryable-error").unwrap(),
        "true"
    );
    assert!(
        json["error"]
            .as_str()
            .unwrap()
            .contains("LEGACY_DELIVERIES=refuse"),
        "{json}"
    );
    assert!(!processed(&pool, ev.id).await);
    assert!(!delivered(&pool, ev.id).await);
    // The same event in the current contract is applied as usual.
    let r = handle_event(&st, delivery_of(&ev).request()).await;
    assert_eq!(parts(&r).0, 200);
}

/// A delivery of the previous format names its event only in an unsigned header; a relay of that format wrote only
/// the default subscriber's rows. A replay of one naming a named subscriber's copy of the same event (same topic,
/// same payload, dispatched) at the default consumer is refused, and nothing is applied: before, the lookup found
/// any copy, and the default consumer applied the event under the copy's id.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn legacy_delivery_naming_a_named_subscribers_copy_is_refused(pool: PgPool) {
    let db = outbox::db::Db::new(pool.clone(), outbox::db::Statements::Prepared);
    outbox::subscribers::add(
        &db,
        "audit",
        "search",
        Some("http://127.0.0.1:9"),
        outbox::subscribers::Start::Now,
        std::time::Duration::from_secs(5),
    )
    .await
    .unwrap();
    let event = enqueue_audit(&pool, "erin").await;
    let copy_id: i64 =
        sqlx::query_scalar("SELECT id FROM outbox WHERE event_id = $1 AND subscriber = 'search'")
            .bind(event.id)
            .fetch_one(&pool)
            .await
            .unwrap();
    let copy = row(&pool, copy_id).await;
    mark_dispatched(&pool, &[&event, &copy]).await;
    let st = consumer(&pool, example::registry());
    let (status, json) = parts(&handle_event(&st, legacy_delivery_of(&copy, &[])).await);
    assert_eq!(status, 489, "{json}");
    assert!(
        json["error"]
            .as_str()
            .unwrap()
            .contains("not in the outbox"),
        "{json}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_messages").await,
        0
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM audit_log").await, 0);
    // The default subscriber's own event, in the previous format: applied as before.
    let (status, json) = parts(&handle_event(&st, legacy_delivery_of(&event, &[])).await);
    assert_eq!(status, 200, "{json}");
    assert!(processed(&pool, event.id).await);
}
