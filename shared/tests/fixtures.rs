//! The `events/` function-URL fixtures, loaded with `lambda_http::request::from_str` (what the Lambda runtime
//! does with the invoke payload) and driven through the real handlers: once with the committed tokens at the
//! time they were issued, once re-signed in memory and verified on the system clock. The fixtures follow the
//! signed wire contract (decision record 0025): deliveries carry an envelope body to `/events/orders?contract=2`,
//! callbacks name their event in the signed body (`url` with the contract version, `sourceBody` the envelope)
//! and carry no `x-outbox-id` request header.

use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use orders_example as example;
use outbox::config::ConsumerConfig;
use outbox::consumer::{ConsumerState, handle_event};
use outbox::internals::callbacks::handle_callback;
use outbox::internals::receiver::{
    Clock, DEV_SIGNING_KEYS, KeyRing, SigningKeys, VerifyOptions, decode_unverified,
    resign_function_url_event,
};
use outbox_testkit::receiving::*;
use serde_json::{Value, json};
use sqlx::PgPool;

fn fixture(name: &str) -> String {
    std::fs::read_to_string(outbox_testkit::repo_root().join("events").join(name))
        .unwrap_or_else(|e| panic!("events/{name}: {e}"))
}

/// The `iat` of the fixture's token: "now" as it was when the fixture was signed.
fn issued_at(event: &str) -> i64 {
    let v: Value = serde_json::from_str(event).unwrap();
    let token = v["headers"]["upstash-signature"].as_str().unwrap();
    decode_unverified(token).unwrap()["iat"].as_i64().unwrap()
}

/// The single event of a contract-2 envelope, read with plain serde_json (not `outbox::internals::contract`).
fn envelope_event(body: &[u8], topic: &str) -> Value {
    let v: Value = serde_json::from_slice(body).expect("envelope is JSON");
    assert_eq!(v["contract"], 2, "{v}");
    assert_eq!(v["topic"], topic, "{v}");
    let events = v["events"].as_array().expect("events");
    assert_eq!(events.len(), 1, "{v}");
    events[0].clone()
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn consumer_at(pool: &PgPool, clock: Clock) -> ConsumerState {
    let mut st = consumer(pool, example::registry());
    st.receiver.clock = clock;
    st
}

#[tokio::test]
async fn fixtures_are_function_url_events_signed_with_the_dev_key() {
    assert_eq!(DEV_SIGNING_KEYS.0, KEY);
    for name in [
        "consumer-order-placed.json",
        "consumer-order-placed-poison.json",
        "failure-callback.json",
        "delivery-callback.json",
    ] {
        let text = fixture(name);
        let req = request_from_event(&text);
        assert_eq!(req.method(), "POST", "{name}");
        let claims = decode_unverified(
            req.headers()
                .get("upstash-signature")
                .unwrap()
                .to_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(claims["iss"], "Upstash", "{name}");
        assert_eq!(
            claims["exp"].as_i64().unwrap() - claims["iat"].as_i64().unwrap(),
            300
        );
        assert_eq!(
            claims["sub"].as_str().unwrap(),
            outbox::internals::receiver::request_url(
                &req,
                outbox::internals::receiver::UrlSource::FunctionUrl
            ),
            "{name}: sub is the URL rebuilt from the event"
        );
        // The committed token verifies (body hash included) at the time it was issued.
        KeyRing::fixed(SigningKeys::new(KEY, None))
            .verify(
                req.headers()
                    .get("upstash-signature")
                    .unwrap()
                    .to_str()
                    .unwrap(),
                req.body().as_ref(),
                claims["sub"].as_str().unwrap(),
                VerifyOptions {
                    now: claims["iat"].as_i64().unwrap(),
                    clock_tolerance_secs: 0,
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }

    // Deliveries: envelope body at /events/orders?contract=2 (the query is in sub), the x-outbox-id header only
    // an informational copy of the envelope's id, no other x-outbox-* header.
    for (name, id, order) in [
        ("consumer-order-placed.json", 1, "order-1001"),
        ("consumer-order-placed-poison.json", 2, "order-1002"),
    ] {
        let req = request_from_event(&fixture(name));
        assert_eq!(req.uri().query(), Some("contract=2"), "{name}");
        let ev = envelope_event(req.body().as_ref(), "orders");
        assert_eq!(
            (&ev["id"], &ev["key"], &ev["seq"], &ev["schema_version"]),
            (&json!(id), &json!(order), &json!(1), &json!(2)),
            "{name}"
        );
        assert_eq!(ev["payload"]["order_id"], order, "{name}");
        assert_eq!(
            req.headers().get("x-outbox-id").unwrap(),
            &id.to_string(),
            "{name}"
        );
        for h in req.headers().keys() {
            assert!(
                !h.as_str().starts_with("x-outbox-") || h == "x-outbox-id",
                "{name}: {h} is not part of the contract any more"
            );
        }
    }

    // Callbacks: the event is named by the signed body only.
    for name in ["failure-callback.json", "delivery-callback.json"] {
        let req = request_from_event(&fixture(name));
        assert!(
            req.headers().get("x-outbox-id").is_none(),
            "{name}: a callback request header names no event"
        );
        let body: Value = serde_json::from_slice(req.body().as_ref()).unwrap();
        assert!(
            body["url"]
                .as_str()
                .unwrap()
                .ends_with("/events/orders?contract=2"),
            "{name}"
        );
        let source = STANDARD
            .decode(body["sourceBody"].as_str().unwrap())
            .unwrap();
        assert_eq!(envelope_event(&source, "orders")["id"], 1, "{name}");
        // The delivery the callback is about is the consumer fixture's.
        let delivered = request_from_event(&fixture("consumer-order-placed.json"));
        assert_eq!(source, delivered.body().as_ref(), "{name}");
    }
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn order_placed_fixture_is_applied(pool: PgPool) {
    let text = fixture("consumer-order-placed.json");
    let st = consumer_at(&pool, Clock::Fixed(issued_at(&text)));
    let r = handle_event(&st, request_from_event(&text)).await;
    assert_eq!(
        parts(&r),
        (
            200,
            json!({"status":"processed","outbox_id":1,"events":[{"id":1,"outcome":"processed"}]})
        )
    );
    let (order, amount): (String, i64) =
        sqlx::query_as("SELECT order_id, amount_cents FROM charges")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((order.as_str(), amount), ("order-1001", 4999));
    assert_eq!(count(&pool, "SELECT count(*) FROM shipments").await, 1);
    // Key and sequence from the envelope.
    let (key, seq): (String, i64) =
        sqlx::query_as("SELECT partition_key, last_seq FROM consumer_sequences")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((key.as_str(), seq), ("order-1001", 1));
    // The same fixture again: a duplicate.
    let r = handle_event(&st, request_from_event(&text)).await;
    assert_eq!(parts(&r).1["status"], "duplicate");

    // Verified on the real clock, the committed token has long expired: 401, nothing else happens.
    let late = consumer_at(&pool, Clock::Fixed(issued_at(&text) + 301));
    let r = handle_event(&late, request_from_event(&text)).await;
    assert_eq!(parts(&r).1["check"], "expired");
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn poison_fixture_is_489(pool: PgPool) {
    let text = fixture("consumer-order-placed-poison.json");
    let st = consumer_at(&pool, Clock::Fixed(issued_at(&text)));
    let r = handle_event(&st, request_from_event(&text)).await;
    assert_eq!(parts(&r).0, 489);
    assert_eq!(
        r.headers().get("upstash-nonretryable-error").unwrap(),
        "true"
    );
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn fixtures_re_signed_in_memory_verify_on_the_system_clock(pool: PgPool) {
    let text = resign_function_url_event(
        &fixture("consumer-order-placed.json"),
        KEY,
        None,
        now(),
        300,
    )
    .unwrap();
    let st = consumer_at(&pool, Clock::System);
    let r = handle_event(&st, request_from_event(&text)).await;
    assert_eq!(parts(&r).0, 200);

    // Re-signing only swaps the token: the rest of the file is byte for byte the same.
    let original = fixture("consumer-order-placed.json");
    let strip = |s: &str| -> String {
        s.lines()
            .filter(|l| !l.contains("upstash-signature"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(strip(&original), strip(&text));

    // Re-signed for a public base URL, it needs PUBLIC_BASE_URL on the receiving side.
    let public = resign_function_url_event(
        &fixture("failure-callback.json"),
        KEY,
        Some("https://hooks.example.com"),
        now(),
        300,
    )
    .unwrap();
    let mut cb = receiver(&pool, ConsumerConfig::defaults());
    cb.clock = Clock::System;
    let r = handle_callback(&cb, request_from_event(&public)).await;
    assert_eq!(parts(&r).1["check"], "subject");
    cb.config.public_base_url = Some("https://hooks.example.com".into());
    let r = handle_callback(&cb, request_from_event(&public)).await;
    assert_eq!(parts(&r).0, 200);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn callback_fixtures_are_handled(pool: PgPool) {
    // Put event 1 in the outbox (the ordered head of key order-1001) so the callbacks have something to link to.
    let mut tx = pool.begin().await.unwrap();
    let ev = outbox::enqueue(
        &mut tx,
        example::order_event(&example::OrderEvent::OrderPlaced(example::OrderPlaced {
            order_id: "order-1001".into(),
            customer_id: "customer-7".into(),
            amount_cents: 4999,
            currency: "EUR".into(),
            items: vec![example::LineItem {
                sku: "BOOK-1".into(),
                quantity: 1,
            }],
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(ev.id, 1, "a fresh database starts at outbox id 1");

    let delivered = fixture("delivery-callback.json");
    let mut st = receiver(&pool, ConsumerConfig::defaults());
    st.clock = Clock::Fixed(issued_at(&delivered));
    let r = handle_callback(&st, request_from_event(&delivered)).await;
    assert_eq!(
        parts(&r),
        (
            200,
            json!({"status":"delivered","outbox_id":1,"key_advanced":true})
        )
    );

    let failure = fixture("failure-callback.json");
    st.clock = Clock::Fixed(issued_at(&failure));
    let r = handle_callback(&st, request_from_event(&failure)).await;
    let (status, body) = parts(&r);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "recorded");
    assert_eq!(body["outbox_id"], 1);
    let (dlq, status, resolved): (String, i32, bool) = sqlx::query_as(
        "SELECT dlq_id, status, resolved_at IS NOT NULL FROM dead_letters WHERE outbox_id = 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((dlq.as_str(), status), ("1795939201000-0", 503));
    assert!(
        resolved,
        "it was delivered after all (evidence came first): stored resolved"
    );

    // A pruned event (no outbox row) keeps what the signed envelope says: its payload (not the whole
    // envelope), key and headers.
    sqlx::query("DELETE FROM dead_letters")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM outbox")
        .execute(&pool)
        .await
        .unwrap();
    let r = handle_callback(&st, request_from_event(&failure)).await;
    assert_eq!(parts(&r).1["outbox_id"], 1);
    let (key, payload, headers): (String, Value, Value) = sqlx::query_as(
        "SELECT partition_key, payload, headers FROM dead_letters WHERE outbox_id = 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(key, "order-1001");
    assert_eq!(payload["order_id"], "order-1001");
    assert!(payload.get("contract").is_none(), "{payload}");
    assert_eq!(headers["x-correlation-id"], json!(["req-42"]), "{headers}");
    assert_eq!(headers["x-schema-version"], json!(["2"]), "{headers}");
}
