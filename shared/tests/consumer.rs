//! Guarantee 2 (no side effect applied twice) and the outcome → HTTP mapping, through the real consumer handler
//! (`outbox::consumer::handle_event`) on real Postgres. Deliveries are in the signed wire contract (an envelope
//! body POSTed to `/events/{topic}?contract=2`, written by the independent builder in
//! `outbox_testkit::receiving`); the attacks on it and the deliveries of the previous format are in `attacks.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use orders_example::{self as example, LineItem, OrderCancelled, OrderEvent, OrderPlaced};
use outbox::OutboxId;
use outbox::consumer::{
    ConsumerState, Event, Handler, HandlerError, Registry, TopicRoute, handle_event,
};
use outbox::db::{Db, Statements};
use outbox::once::{Once, OnceError, handle_once};
use outbox_testkit::receiving::*;
use serde_json::{Value, json};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};

fn placed(order_id: &str, amount_cents: i64) -> Vec<u8> {
    serde_json::to_vec(&OrderEvent::OrderPlaced(OrderPlaced {
        order_id: order_id.into(),
        customer_id: "customer-7".into(),
        amount_cents,
        currency: "EUR".into(),
        items: vec![LineItem {
            sku: "BOOK-1".into(),
            quantity: 2,
        }],
    }))
    .unwrap()
}

fn cancelled(order_id: &str) -> Vec<u8> {
    serde_json::to_vec(&OrderEvent::OrderCancelled(OrderCancelled {
        order_id: order_id.into(),
        reason: Some("changed mind".into()),
    }))
    .unwrap()
}

/// An ordered `orders` event at schema version 2 (evidence by QStash's delivery callback, the relay's default).
fn ordered(id: i64, body: &[u8], key: &str, seq: i64) -> Delivery {
    Delivery::new("orders", id, body)
        .key(key)
        .seq(seq)
        .schema_version(2)
        .evidence_by_callback()
}

fn orders_request(id: i64, body: &[u8], key: &str, seq: i64) -> lambda_http::Request {
    ordered(id, body, key, seq).request()
}

fn note(id: i64, body: &[u8]) -> lambda_http::Request {
    Delivery::new("notes", id, body).request()
}

/// A pool with room for real concurrency (the test pool may be smaller).
async fn wide_pool(pool: &PgPool, n: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(n)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap()
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn same_message_eight_times_concurrently_applies_once(pool: PgPool) {
    let wide = wide_pool(&pool, 8).await;
    let state = consumer(&wide, example::registry());
    let body = placed("order-1", 4999);
    let requests: Vec<_> = (0..8)
        .map(|_| orders_request(42, &body, "order-1", 1))
        .collect();
    let responses =
        futures::future::join_all(requests.into_iter().map(|req| handle_event(&state, req))).await;
    let mut processed = 0;
    for r in &responses {
        let (status, body) = parts(r);
        assert_eq!(status, 200, "every delivery answers 2xx: {body}");
        match body["status"].as_str() {
            Some("processed") => processed += 1,
            Some("duplicate") => {}
            other => panic!("unexpected status {other:?}"),
        }
        assert_eq!(body["outbox_id"], 42);
    }
    assert_eq!(processed, 1, "exactly one delivery applied the event");
    assert_eq!(count(&pool, "SELECT count(*) FROM charges").await, 1);
    assert_eq!(count(&pool, "SELECT count(*) FROM shipments").await, 1);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_messages").await,
        1
    );
}

/// Inserts a row, then waits, so concurrent duplicates really overlap inside the transaction.
struct SlowInsert {
    calls: Arc<AtomicUsize>,
}

#[derive(serde::Deserialize)]
struct Note {
    note: String,
}

impl Handler<Note> for SlowInsert {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        event: &Event<Note>,
    ) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        event
            .statements
            .query("INSERT INTO effects (outbox_id, note) VALUES ($1, $2)")
            .bind(event.meta.outbox_id)
            .bind(&event.payload.note)
            .execute(&mut *conn)
            .await?;
        sqlx::query("SELECT pg_sleep(0.2)")
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

async fn effects_table(pool: &PgPool) {
    sqlx::query("CREATE TABLE effects (outbox_id bigint NOT NULL, note text NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn concurrent_duplicates_wait_for_the_first_and_do_nothing(pool: PgPool) {
    effects_table(&pool).await;
    let wide = wide_pool(&pool, 8).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let state = consumer(
        &wide,
        Registry::new().on(
            "notes",
            SlowInsert {
                calls: calls.clone(),
            },
        ),
    );
    let body = br#"{"note":"once"}"#;
    let responses =
        futures::future::join_all((0..8).map(|_| handle_event(&state, note(7, body)))).await;
    let statuses: Vec<u16> = responses.iter().map(|r| parts(r).0).collect();
    assert_eq!(statuses, vec![200; 8]);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
    assert_eq!(count(&pool, "SELECT count(*) FROM effects").await, 1);
}

/// Writes its side effect, then fails on its first `fail_times` calls.
struct FailsAfterWriting {
    fail_times: usize,
    calls: Arc<AtomicUsize>,
    permanent: bool,
}

impl Handler<Note> for FailsAfterWriting {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        event: &Event<Note>,
    ) -> Result<(), HandlerError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        event
            .statements
            .query("INSERT INTO effects (outbox_id, note) VALUES ($1, $2)")
            .bind(event.meta.outbox_id)
            .bind(&event.payload.note)
            .execute(&mut *conn)
            .await?;
        if n < self.fail_times {
            return Err(if self.permanent {
                HandlerError::permanent("refused after writing")
            } else {
                HandlerError::retry_after("downstream unavailable", Duration::from_millis(7_200))
            });
        }
        Ok(())
    }
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn work_failing_mid_transaction_commits_nothing_and_the_retry_applies_once(pool: PgPool) {
    effects_table(&pool).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let state = consumer(
        &pool,
        Registry::new().on(
            "notes",
            FailsAfterWriting {
                fail_times: 1,
                calls: calls.clone(),
                permanent: false,
            },
        ),
    );
    let body = br#"{"note":"n"}"#;

    let r = handle_event(&state, note(9, body)).await;
    let (status, json) = parts(&r);
    assert_eq!(status, 503, "{json}");
    assert_eq!(
        r.headers().get("retry-after").unwrap(),
        "8",
        "rounded up to whole seconds"
    );
    assert!(r.headers().get("upstash-nonretryable-error").is_none());
    assert_eq!(json["error"], "downstream unavailable");
    assert_eq!(count(&pool, "SELECT count(*) FROM effects").await, 0);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_messages").await,
        0,
        "the dedupe row rolled back with the work"
    );

    // QStash retries: applied once.
    let r = handle_event(&state, note(9, body)).await;
    assert_eq!(
        parts(&r),
        (
            200,
            json!({"status":"processed","outbox_id":9,"events":[{"id":9,"outcome":"processed"}]})
        )
    );
    // And once more: a duplicate, no new effect.
    let r = handle_event(&state, note(9, body)).await;
    assert_eq!(
        parts(&r),
        (
            200,
            json!({"status":"duplicate","outbox_id":9,"events":[{"id":9,"outcome":"duplicate"}]})
        )
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM effects").await, 1);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn handle_once_directly(pool: PgPool) {
    effects_table(&pool).await;
    let insert = async |conn: &mut PgConnection, note: &str| {
        sqlx::query("INSERT INTO effects (outbox_id, note) VALUES (1, $1)")
            .bind(note)
            .execute(&mut *conn)
            .await
    };
    let db = Db::new(pool.clone(), Statements::Prepared);
    // The same table through a handle whose statements are unnamed (behind a transaction-mode pooler).
    let unnamed = Db::new(pool.clone(), Statements::Unnamed);
    let r = handle_once(&db, "c1", "m1", async |conn: &mut PgConnection| {
        insert(conn, "a").await?;
        Ok::<_, sqlx::Error>(5)
    })
    .await
    .unwrap();
    assert_eq!(r, Once::Applied(5));
    let r = handle_once(&db, "c1", "m1", async |conn: &mut PgConnection| {
        insert(conn, "b").await?;
        Ok::<_, sqlx::Error>(6)
    })
    .await
    .unwrap();
    assert_eq!(r, Once::Duplicate);
    // Another consumer has its own namespace.
    let r = handle_once(&unnamed, "c2", "m1", async |conn: &mut PgConnection| {
        insert(conn, "c").await?;
        Ok::<_, sqlx::Error>(7)
    })
    .await
    .unwrap();
    assert_eq!(r, Once::Applied(7));
    // A failing work leaves nothing.
    let r = handle_once(&db, "c1", "m2", async |conn: &mut PgConnection| {
        insert(conn, "d").await.map_err(|_| "insert failed")?;
        Err::<(), _>("boom")
    })
    .await;
    assert!(matches!(r, Err(OnceError::Work("boom"))));
    let notes: Vec<String> = sqlx::query_scalar("SELECT note FROM effects ORDER BY note")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(notes, vec!["a", "c"]);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn poison_is_489_with_the_nonretryable_header(pool: PgPool) {
    let state = consumer(&pool, example::registry());
    let r = handle_event(
        &state,
        orders_request(5, &placed("order-5", -100), "order-5", 1),
    )
    .await;
    let (status, json) = parts(&r);
    assert_eq!(status, 489, "{json}");
    assert_eq!(
        r.headers().get("upstash-nonretryable-error").unwrap(),
        "true"
    );
    assert_eq!(r.headers().get("content-type").unwrap(), "application/json");
    assert!(
        json["error"]
            .as_str()
            .unwrap()
            .contains("cannot be negative"),
        "{json}"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM charges").await, 0);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_messages").await,
        0
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM consumer_sequences").await,
        0,
        "the sequence check rolled back too"
    );
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn every_permanent_error_is_489(pool: PgPool) {
    let state = consumer(&pool, example::registry());
    let good = placed("o", 1);
    let two_events = json!({
        "contract": 2,
        "topic": "orders",
        "events": [
            {"id": 20, "key": "o", "seq": 1, "payload": {}},
            {"id": 21, "key": "o", "seq": 3, "payload": {}}
        ]
    })
    .to_string();
    let cases: Vec<(&str, lambda_http::Request, &str)> = vec![
        (
            "body not JSON",
            ordered(1, b"{}", "o", 1).request_with_body(b"{\"type\":\"OrderPlaced\","),
            "not a contract-2 envelope",
        ),
        (
            "payload of the wrong shape",
            orders_request(2, br#"{"type":"OrderShipped","order_id":"o"}"#, "o", 1),
            "malformed payload",
        ),
        (
            "payload missing fields",
            orders_request(3, br#"{"type":"OrderPlaced","order_id":"o"}"#, "o", 1),
            "malformed payload",
        ),
        (
            "unsupported schema version",
            Delivery::new("orders", 4, &good)
                .key("o")
                .seq(1)
                .schema_version(3)
                .request(),
            "unsupported schema version 3",
        ),
        (
            "unknown topic",
            Delivery::new("payments", 5, b"{}").request(),
            "unknown topic \"payments\"",
        ),
        (
            "path outside /events/",
            ordered(6, &good, "o", 1).path("/hooks/orders").request(),
            "no route for path",
        ),
        (
            "envelope topic disagrees with the path",
            ordered(7, &good, "o", 1).envelope_topic("audit").request(),
            "differs from the URL's topic",
        ),
        (
            "a named subscriber's copy at a consumer of another name",
            ordered(14, &good, "o", 1).subscriber("billing").request(),
            "is subscriber \"billing\"'s copy, but this consumer's CONSUMER_NAME is",
        ),
        (
            "event id not positive",
            ordered(0, &good, "o", 1).without_id_copy().request(),
            "not positive",
        ),
        (
            "empty partition key",
            ordered(8, &good, "", 1).request(),
            "empty partition key",
        ),
        (
            "sequence below 1",
            ordered(9, &good, "o", 0).request(),
            "sequence below 1",
        ),
        (
            "a batch whose sequences are not consecutive",
            signed_post_with_query("/events/orders", CONTRACT_QUERY, two_events.as_bytes(), &[]),
            "not consecutive",
        ),
        (
            "the envelope says another contract than the URL",
            signed_post_with_query(
                "/events/orders",
                CONTRACT_QUERY,
                br#"{"contract":3,"topic":"orders","events":[{"id":10,"key":"o","payload":{}}]}"#,
                &[],
            ),
            "says contract 3",
        ),
        (
            "a contract version in the URL that never existed",
            ordered(11, &good, "o", 1).query("contract=1").request(),
            "unknown contract version",
        ),
        (
            "the contract version twice in the URL",
            ordered(12, &good, "o", 1)
                .query("contract=2&contract=2")
                .request(),
            "twice",
        ),
        (
            "previous format without x-outbox-id",
            signed_post("/events/orders", &good, &[]),
            "without x-outbox-id",
        ),
        (
            "previous format, x-outbox-id not a number",
            signed_post("/events/orders", &good, &[("x-outbox-id", "msg_123")]),
            "not a positive integer",
        ),
        (
            "cancel of an unknown order",
            orders_request(13, &cancelled("never-placed"), "never-placed", 1),
            "no charge for it",
        ),
    ];
    for (name, req, want) in cases {
        let r = handle_event(&state, req).await;
        let (status, json) = parts(&r);
        assert_eq!(status, 489, "{name}: {json}");
        assert_eq!(
            r.headers()
                .get("upstash-nonretryable-error")
                .map(|v| v.to_str().unwrap()),
            Some("true"),
            "{name}"
        );
        assert!(
            json["error"].as_str().unwrap_or("").contains(want),
            "{name}: {json} should mention {want:?}"
        );
    }
    // A GET with a valid signature is not an event either.
    let body = b"";
    let sig = token(KEY, &url_with_query("/events/orders", CONTRACT_QUERY), body);
    let r = handle_event(
        &state,
        request_from_event(&function_url_event(
            "GET",
            "/events/orders",
            CONTRACT_QUERY,
            &[("upstash-signature", &sig), ("x-outbox-id", "10")],
            body,
        )),
    )
    .await;
    assert_eq!(parts(&r).0, 489);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_messages").await,
        0
    );
}

/// Fan-out: a named subscriber's copy names the subscriber in its envelope; only a consumer deployed under that
/// `CONSUMER_NAME` applies it (in that dedupe namespace), another one refuses it and writes nothing.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_named_subscribers_copy_is_applied_only_by_the_consumer_of_that_name(pool: PgPool) {
    let mut config = outbox::config::ConsumerConfig::defaults();
    config.name = "billing".into();
    let billing = ConsumerState::new(receiver(&pool, config), example::registry());
    let copy = |id: i64| {
        ordered(id, &placed(&format!("o{id}"), 1), &format!("o{id}"), 1)
            .subscriber("billing")
            .request()
    };
    let (status, json) = parts(&handle_event(&billing, copy(30)).await);
    assert_eq!(status, 200, "{json}");
    let rows = |id: i64| {
        sqlx::query_scalar::<_, Vec<String>>(
            "SELECT coalesce(array_agg(consumer ORDER BY consumer), '{}') FROM processed_messages \
             WHERE message_id = $1",
        )
        .bind(id.to_string())
        .fetch_one(&pool)
    };
    assert_eq!(rows(30).await.unwrap(), vec!["billing".to_owned()]);
    // The default consumer (another CONSUMER_NAME) gets billing's copy: refused, nothing written.
    let default = consumer(&pool, example::registry());
    let (status, json) = parts(&handle_event(&default, copy(31)).await);
    assert_eq!(status, 489, "{json}");
    assert!(rows(31).await.unwrap().is_empty());
    // A copy for the default subscriber names none, and either consumer takes it as before.
    let plain = ordered(32, &placed("o32", 1), "o32", 1).request();
    assert_eq!(parts(&handle_event(&billing, plain).await).0, 200);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_delivery_from_a_newer_relay_is_retried_later(pool: PgPool) {
    // contract=3 comes from a relay upgraded before this consumer: 503 with Retry-After (QStash retries; the
    // consumer's upgrade applies it), nothing written. Not 489: the event is fine, the consumer is old.
    let state = consumer(&pool, example::registry());
    let r = handle_event(
        &state,
        ordered(1, &placed("o", 1), "o", 1)
            .query("contract=3")
            .request(),
    )
    .await;
    let (status, json) = parts(&r);
    assert_eq!(status, 503, "{json}");
    assert_eq!(r.headers().get("retry-after").unwrap(), "60");
    assert!(r.headers().get("upstash-nonretryable-error").is_none());
    assert!(json["error"].as_str().unwrap().contains("newer"), "{json}");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_messages").await,
        0
    );
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn database_outage_is_503_and_nothing_is_written(pool: PgPool) {
    // A pool that cannot connect: the handler must answer 5xx (QStash retries), never 2xx or 489.
    let dead = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy("postgres://postgres@127.0.0.1:1/none")
        .unwrap();
    let state = consumer(&dead, example::registry());
    let r = handle_event(&state, orders_request(1, &placed("o", 1), "o", 1)).await;
    let (status, json) = parts(&r);
    assert_eq!(status, 503, "{json}");
    assert!(r.headers().get("retry-after").is_none());
    assert!(
        json["error"]
            .as_str()
            .unwrap()
            .starts_with("database error")
    );
    assert!(r.headers().get("upstash-nonretryable-error").is_none());
    let _ = pool;
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn handler_database_errors_are_classified(pool: PgPool) {
    sqlx::query("CREATE TABLE strict (v int NOT NULL CHECK (v > 0))")
        .execute(&pool)
        .await
        .unwrap();
    struct InsertV;
    #[derive(serde::Deserialize)]
    struct V {
        v: i32,
    }
    impl Handler<V> for InsertV {
        async fn handle(&self, conn: &mut PgConnection, e: &Event<V>) -> Result<(), HandlerError> {
            sqlx::query("INSERT INTO strict (v) VALUES ($1)")
                .bind(e.payload.v)
                .execute(&mut *conn)
                .await?;
            Ok(())
        }
    }
    let state = consumer(&pool, Registry::new().on("strict", InsertV));
    let r = handle_event(&state, Delivery::new("strict", 1, br#"{"v":-1}"#).request()).await;
    assert_eq!(
        parts(&r).0,
        489,
        "a CHECK violation cannot be fixed by retrying"
    );
    let r = handle_event(&state, Delivery::new("strict", 2, br#"{"v":1}"#).request()).await;
    assert_eq!(parts(&r).0, 200);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn ordered_key_refuses_an_event_older_than_one_applied(pool: PgPool) {
    let state = consumer(&pool, example::registry());
    // seq 2 (placing order B under key K) arrives first: applied (the relay's gating makes this impossible
    // in normal operation; a forced redrive can do it).
    let r = handle_event(&state, orders_request(11, &placed("b", 1), "K", 2)).await;
    assert_eq!(parts(&r).0, 200);
    // seq 1 now: refused permanently, naming both sequences; nothing written.
    let r = handle_event(&state, orders_request(10, &placed("a", 1), "K", 1)).await;
    let (status, json) = parts(&r);
    assert_eq!(status, 489, "{json}");
    let msg = json["error"].as_str().unwrap();
    assert!(
        msg.contains("sequence 1") && msg.contains("sequence 2"),
        "{msg}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM charges WHERE order_id = 'a'").await,
        0
    );
    // A redelivery of the applied seq 2 is a duplicate (dedupe runs before the sequence check), not "late".
    let r = handle_event(&state, orders_request(11, &placed("b", 1), "K", 2)).await;
    assert_eq!(
        parts(&r),
        (
            200,
            json!({"status":"duplicate","outbox_id":11,"events":[{"id":11,"outcome":"duplicate"}]})
        )
    );
    // seq 3 goes through, and the key's state says 3.
    let r = handle_event(&state, orders_request(12, &cancelled("b"), "K", 3)).await;
    assert_eq!(parts(&r).0, 200);
    let last: i64 = sqlx::query_scalar(
        "SELECT last_seq FROM consumer_sequences WHERE consumer = 'consumer' AND topic = 'orders' AND partition_key = 'K'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(last, 3);
    // Another key is independent.
    let r = handle_event(&state, orders_request(13, &placed("c", 1), "L", 1)).await;
    assert_eq!(parts(&r).0, 200);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn example_domain_end_to_end(pool: PgPool) {
    let state = consumer(&pool, example::registry());
    // Placed at schema v2 with a key that needs escaping in JSON and would need encoding in a header.
    let key = "order 1/ü \"q\"";
    let r = handle_event(
        &state,
        orders_request(1, &placed("order 1/ü", 2500), key, 1),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
    let (customer, amount, currency, status): (String, i64, String, String) = sqlx::query_as(
        "SELECT customer_id, amount_cents, currency, status FROM charges WHERE order_id = 'order 1/ü'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (
            customer.as_str(),
            amount,
            currency.as_str(),
            status.as_str()
        ),
        ("customer-7", 2500, "EUR", "captured")
    );
    let items: Value =
        sqlx::query_scalar("SELECT items FROM shipments WHERE order_id = 'order 1/ü'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(items, json!([{"sku":"BOOK-1","quantity":2}]));
    // The key recorded for the ordering check is the envelope's, as it was written.
    let k: String = sqlx::query_scalar("SELECT partition_key FROM consumer_sequences")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(k, key);

    // Cancelled (seq 2): refund + cancelled shipment.
    let r = handle_event(&state, orders_request(2, &cancelled("order 1/ü"), key, 2)).await;
    assert_eq!(parts(&r).0, 200);
    let (c, s): (String, String) = sqlx::query_as(
        "SELECT c.status, s.status FROM charges c JOIN shipments s USING (order_id)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((c.as_str(), s.as_str()), ("refunded", "cancelled"));

    // Schema version 1 (no currency) is upcast: EUR.
    let v1 = br#"{"type":"OrderPlaced","order_id":"old","customer_id":"c","amount_cents":1,"items":[{"sku":"S","quantity":1}]}"#;
    let r = handle_event(
        &state,
        Delivery::new("orders", 3, v1)
            .key("old")
            .seq(1)
            .schema_version(1)
            .request(),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
    let cur: String = sqlx::query_scalar("SELECT currency FROM charges WHERE order_id = 'old'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(cur, "EUR");
    // No schema version in the envelope means version 1 as well; v2 payload shape at v1 still decodes (extra
    // field ignored).
    let r = handle_event(
        &state,
        Delivery::new("orders", 4, &placed("nov", 1))
            .key("nov")
            .seq(1)
            .request(),
    )
    .await;
    assert_eq!(parts(&r).0, 200);

    // The unordered audit topic.
    let r = handle_event(
        &state,
        Delivery::new("audit", 5, br#"{"actor":"u1","action":"login"}"#).request(),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
    assert_eq!(count(&pool, "SELECT count(*) FROM audit_log").await, 1);
    assert_eq!(
        state.registry.supported_versions("orders"),
        Some(vec![1, 2])
    );
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn producer_and_consumer_agree_on_the_example(pool: PgPool) {
    // What the producer writes is what the consumer decodes (payload and version header).
    let ev = OrderEvent::OrderPlaced(OrderPlaced {
        order_id: "p-1".into(),
        customer_id: "c".into(),
        amount_cents: 10,
        currency: "USD".into(),
        items: vec![LineItem {
            sku: "X".into(),
            quantity: 1,
        }],
    });
    let mut tx = pool.begin().await.unwrap();
    let written = outbox::enqueue(&mut tx, example::order_event(&ev).unwrap())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let (payload, headers): (String, Value) =
        sqlx::query_as("SELECT payload::text, headers FROM outbox WHERE id = $1")
            .bind(written.id)
            .fetch_one(&pool)
            .await
            .unwrap();
    let version = u32::try_from(headers["schema_version"].as_u64().unwrap()).unwrap();
    let state = consumer(&pool, example::registry());
    let r = handle_event(
        &state,
        Delivery::new("orders", written.id.get(), payload.as_bytes())
            .key("p-1")
            .seq(written.seq.unwrap())
            .schema_version(version)
            .request(),
    )
    .await;
    assert_eq!(parts(&r).0, 200, "{:?}", parts(&r));
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_duplicate_asking_for_consumer_evidence_records_it(pool: PgPool) {
    // An ordered event applied while the relay relied on the delivery callback, whose callback never came
    // (or the relay switched to RELAY_ORDERED_EVIDENCE=consumer and redelivers it): the redelivery asks the
    // consumer for the evidence. It is a duplicate — the dedupe row is the evidence — and the evidence is
    // recorded now, so the key is not stuck.
    let mut tx = pool.begin().await.unwrap();
    let written = outbox::enqueue(
        &mut tx,
        example::order_event(&OrderEvent::OrderPlaced(OrderPlaced {
            order_id: "dup-1".into(),
            customer_id: "c".into(),
            amount_cents: 10,
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
    // A second event on the key, so the key's relay state stays (an idle key's row is released).
    outbox::enqueue(
        &mut tx,
        example::order_event(&OrderEvent::OrderCancelled(OrderCancelled {
            order_id: "dup-1".into(),
            reason: None,
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let payload: String = sqlx::query_scalar("SELECT payload::text FROM outbox WHERE id = $1")
        .bind(written.id)
        .fetch_one(&pool)
        .await
        .unwrap();
    let state = consumer(&pool, example::registry());
    let delivery = || {
        Delivery::new("orders", written.id.get(), payload.as_bytes())
            .key("dup-1")
            .seq(1)
            .schema_version(2)
    };
    let evidence = async || -> (bool, i64) {
        sqlx::query_as(
            "SELECT o.delivered_at IS NOT NULL, k.done_seq FROM outbox o \
             JOIN outbox_keys k USING (topic, partition_key) WHERE o.id = $1",
        )
        .bind(written.id)
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let r = handle_event(&state, delivery().evidence_by_callback().request()).await;
    assert_eq!(parts(&r).1["status"], "processed", "{:?}", parts(&r));
    assert_eq!(evidence().await, (false, 0), "the callback's job");
    let r = handle_event(&state, delivery().evidence_by_consumer().request()).await;
    assert_eq!(
        parts(&r),
        (
            200,
            json!({"status":"duplicate","outbox_id":written.id,"events":[{"id":written.id,"outcome":"duplicate"}]})
        )
    );
    assert_eq!(evidence().await, (true, 1), "recorded on the duplicate");
    // Again: idempotent.
    let r = handle_event(&state, delivery().evidence_by_consumer().request()).await;
    assert_eq!(parts(&r).1["status"], "duplicate");
    assert_eq!(evidence().await, (true, 1));
    assert_eq!(count(&pool, "SELECT count(*) FROM charges").await, 1);
}

#[test]
fn outcome_mapping_is_one_table() {
    use outbox::consumer::Outcome;
    use outbox::internals::receiver::VerifyError;
    let cases = [
        (
            Outcome::Processed {
                outbox_id: OutboxId(1),
            },
            200,
            None,
        ),
        (
            Outcome::Duplicate {
                outbox_id: OutboxId(1),
            },
            200,
            None,
        ),
        (Outcome::Unauthorized(VerifyError::Signature), 401, None),
        (Outcome::Tampered("x".into()), 401, None),
        (Outcome::TooLarge { size: 2, max: 1 }, 413, None),
        (Outcome::Permanent("x".into()), 489, Some("true")),
        (
            Outcome::Transient {
                message: "x".into(),
                retry_after: None,
            },
            503,
            None,
        ),
    ];
    for (o, status, header) in cases {
        let r = o.into_response();
        assert_eq!(r.status().as_u16(), status);
        assert_eq!(
            r.headers()
                .get("upstash-nonretryable-error")
                .map(|v| v.to_str().unwrap()),
            header
        );
    }
}

// A route can also be declared with only upcasters and explicit versions.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn versions_and_upcasters(pool: PgPool) {
    effects_table(&pool).await;
    #[derive(serde::Deserialize)]
    struct Old {
        text: String,
    }
    let calls = Arc::new(AtomicUsize::new(0));
    let registry = Registry::new().route(
        TopicRoute::new(
            "notes",
            SlowInsert {
                calls: calls.clone(),
            },
        )
        .versions([3])
        .upcast(2, |o: Old| Note { note: o.text }),
    );
    let state: ConsumerState = consumer(&pool, registry);
    let r = handle_event(
        &state,
        Delivery::new("notes", 1, br#"{"text":"v2"}"#)
            .schema_version(2)
            .request(),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
    let r = handle_event(
        &state,
        Delivery::new("notes", 2, br#"{"note":"v3"}"#)
            .schema_version(3)
            .request(),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
    let r = handle_event(&state, note(3, br#"{"note":"v1"}"#)).await;
    let (status, json) = parts(&r);
    assert_eq!(status, 489);
    assert!(
        json["error"]
            .as_str()
            .unwrap()
            .contains("supported: [2, 3]"),
        "{json}"
    );
    let r = handle_event(
        &state,
        Delivery::new("notes", 4, br#"{"note":"v0"}"#)
            .schema_version(0)
            .request(),
    )
    .await;
    assert_eq!(parts(&r).0, 489);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// Per-subscriber trust (decision record 0028): a consumer with its own subscriber key applies a delivery the relay
/// signed with it (or with its next key); it refuses one without a subscriber signature (489: the message can
/// never gain one; the operator gives the relay the key and redrives) and one signed with another subscriber's key
/// (401: whoever holds QStash's keys and its own subscriber key cannot make another subscriber's consumer apply, or
/// dedupe away, an event), writing nothing for either. A consumer without a key takes signed and unsigned
/// deliveries alike, as before.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_subscribers_consumer_applies_only_deliveries_signed_with_its_own_key(pool: PgPool) {
    const BILLING: &str = "billing-key-0123456789abcdefghijklmnop";
    const BILLING_NEXT: &str = "billing-next-0123456789abcdefghijklmno";
    const SHIPPING: &str = "shipping-key-0123456789abcdefghijklmno";
    let mut config = outbox::config::ConsumerConfig::defaults();
    config.name = "billing".into();
    let own = outbox::internals::subscriber_keys::OwnKey::new(
        BILLING.to_owned().into(),
        Some(BILLING_NEXT.to_owned().into()),
    )
    .unwrap();
    let billing = ConsumerState::new(
        receiver(&pool, config).with_own_key(own),
        example::registry(),
    );
    let copy = |id: i64| {
        ordered(id, &placed(&format!("o{id}"), 1), &format!("o{id}"), 1).subscriber("billing")
    };
    let applied = |id: i64| {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM processed_messages WHERE consumer = 'billing' AND message_id = $1",
        )
        .bind(id.to_string())
        .fetch_one(&pool)
    };
    for (id, key) in [(40, BILLING), (41, BILLING_NEXT)] {
        let r = handle_event(&billing, copy(id).signed_for_subscriber(key).request()).await;
        let (status, json) = parts(&r);
        assert_eq!(status, 200, "{json}");
        assert_eq!(applied(id).await.unwrap(), 1);
    }
    let (status, json) = parts(&handle_event(&billing, copy(42).request()).await);
    assert_eq!(status, 489, "{json}");
    assert!(
        json["error"]
            .as_str()
            .unwrap()
            .contains("carries no subscriber signature"),
        "{json}"
    );
    let forged = copy(43).signed_for_subscriber(SHIPPING).request();
    let (status, json) = parts(&handle_event(&billing, forged).await);
    assert_eq!(status, 401, "{json}");
    for id in [42, 43] {
        assert_eq!(applied(id).await.unwrap(), 0, "event {id}");
    }
    // No key: as before fan-out's keys, signed or not.
    let mut config = outbox::config::ConsumerConfig::defaults();
    config.name = "billing".into();
    let keyless = ConsumerState::new(receiver(&pool, config), example::registry());
    for (id, d) in [
        (44, copy(44).signed_for_subscriber(SHIPPING)),
        (45, copy(45)),
    ] {
        assert_eq!(parts(&handle_event(&keyless, d.request()).await).0, 200);
        assert_eq!(applied(id).await.unwrap(), 1);
    }
}

/// A subscriber applies an event once whatever copy of it arrives (decision record 0070): the dedupe key is the
/// envelope's event, so a replayed copy (a new outbox row of the same event) is a duplicate, and an ordered one is
/// not refused as late; a copy applied under its own id before the upgrade (a dedupe row keyed by the copy) is
/// recognised too.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn every_copy_of_an_event_is_applied_once_per_subscriber(pool: PgPool) {
    let mut config = outbox::config::ConsumerConfig::defaults();
    config.name = "billing".into();
    let billing = ConsumerState::new(receiver(&pool, config), example::registry());
    let body = placed("o7", 1);
    let copy = |id: i64| {
        ordered(id, &body, "o7", 1)
            .subscriber("billing")
            .event(70)
            .request()
    };
    let (status, json) = parts(&handle_event(&billing, copy(71)).await);
    assert_eq!(status, 200, "{json}");
    assert_eq!(json["status"], "processed", "{json}");
    // Another copy of event 70 (a replay after billing was removed and added again): a duplicate, not late.
    let (status, json) = parts(&handle_event(&billing, copy(95)).await);
    assert_eq!(status, 200, "{json}");
    assert_eq!(json["status"], "duplicate", "{json}");
    assert_eq!(
        sqlx::query_scalar::<_, Vec<String>>(
            "SELECT array_agg(message_id ORDER BY message_id) FROM processed_messages WHERE consumer = 'billing'"
        )
        .fetch_one(&pool)
        .await
        .unwrap(),
        vec!["70".to_owned()]
    );
    // A dedupe row under the copy's own id (written before this version) counts as applied.
    sqlx::query("INSERT INTO processed_messages (consumer, message_id) VALUES ('billing', '81')")
        .execute(&pool)
        .await
        .unwrap();
    let old = ordered(81, &placed("o8", 1), "o8", 1)
        .subscriber("billing")
        .event(80)
        .request();
    let (status, json) = parts(&handle_event(&billing, old).await);
    assert_eq!(status, 200, "{json}");
    assert_eq!(json["status"], "duplicate", "{json}");
    // An envelope naming an event above its own id is not one the relay writes.
    let bad = ordered(5, &placed("o5", 1), "o5", 1).event(6).request();
    let (status, json) = parts(&handle_event(&billing, bad).await);
    assert_eq!(status, 489, "{json}");
    assert!(
        json["error"]
            .as_str()
            .unwrap()
            .contains("not above its own id"),
        "{json}"
    );
}
