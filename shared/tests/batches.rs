//! Batched deliveries on the receiver side (decision record 0027), through the real consumer and callback
//! handlers on real Postgres: one transaction per message with a savepoint per event, per-event outcomes and the
//! message's status, batch delivery evidence in one statement, and failure callbacks that dead-letter exactly the
//! failed events. Requests are built by the independent envelope writer of `outbox_testkit::receiving`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use outbox::OutboxId;
use outbox::consumer::{ConsumerState, Event, Handler, HandlerError, Registry, handle_event};
use outbox::internals::callbacks::handle_callback;
use outbox::producer::{NewEvent, Topic, enqueue};
use outbox_testkit::receiving::*;
use serde_json::{Value, json};
use sqlx::{PgConnection, PgPool};

#[derive(serde::Deserialize)]
struct Note {
    note: String,
}

/// Writes the note; `poison` and `rotten` are refused permanently (each with its own error), `flaky` transiently
/// while the flag is set.
#[derive(Clone)]
struct Notes {
    flaky: Arc<AtomicBool>,
}

impl Handler<Note> for Notes {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        event: &Event<Note>,
    ) -> Result<(), HandlerError> {
        event
            .statements
            .query("INSERT INTO effects (outbox_id, note) VALUES ($1, $2)")
            .bind(event.meta.outbox_id)
            .bind(&event.payload.note)
            .execute(&mut *conn)
            .await?;
        match event.payload.note.as_str() {
            "poison" => Err(HandlerError::permanent("poison refused")),
            "rotten" => Err(HandlerError::permanent("rotten note refused")),
            "flaky" if self.flaky.load(Ordering::SeqCst) => {
                Err(HandlerError::transient("downstream unavailable"))
            }
            _ => Ok(()),
        }
    }
}

async fn setup(pool: &PgPool) -> (ConsumerState, Arc<AtomicBool>) {
    sqlx::query("CREATE TABLE effects (outbox_id bigint PRIMARY KEY, note text NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    let flaky = Arc::new(AtomicBool::new(true));
    let h = Notes {
        flaky: flaky.clone(),
    };
    let registry = Registry::new().on("notes", h.clone()).on("ledger", h);
    (consumer(pool, registry), flaky)
}

fn payload(note: &str) -> Vec<u8> {
    json!({ "note": note }).to_string().into_bytes()
}

/// Unordered `notes` events `ids` with the given notes.
fn notes(ids: &[i64], texts: &[&str]) -> Batch {
    Batch::new(
        ids.iter()
            .zip(texts)
            .map(|(id, t)| Delivery::new("notes", *id, &payload(t)).key("k"))
            .collect(),
    )
}

/// Ordered `ledger` events of key `key`, sequences from `first_seq`.
fn ledger(ids: &[i64], texts: &[&str], key: &str, first_seq: i64) -> Batch {
    Batch::new(
        ids.iter()
            .zip(texts)
            .enumerate()
            .map(|(i, (id, t))| {
                Delivery::new("ledger", *id, &payload(t))
                    .key(key)
                    .seq(first_seq + i as i64)
                    .evidence_by_callback()
            })
            .collect(),
    )
}

fn outcomes(body: &Value) -> Vec<(i64, String)> {
    body["events"]
        .as_array()
        .expect("an events list")
        .iter()
        .map(|e| {
            (
                e["id"].as_i64().unwrap(),
                e["outcome"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn expect(pairs: &[(i64, &str)]) -> Vec<(i64, String)> {
    pairs.iter().map(|(i, o)| (*i, (*o).to_owned())).collect()
}

async fn effects(pool: &PgPool) -> Vec<i64> {
    sqlx::query_scalar("SELECT outbox_id FROM effects ORDER BY outbox_id")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_batch_of_five_is_applied_in_one_request_and_then_is_all_duplicates(pool: PgPool) {
    let (state, _) = setup(&pool).await;
    let b = notes(&[1, 2, 3, 4, 5], &["a", "b", "c", "d", "e"]);
    let r = handle_event(&state, b.request()).await;
    let (status, body) = parts(&r);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "processed");
    assert_eq!(
        outcomes(&body),
        expect(&[
            (1, "processed"),
            (2, "processed"),
            (3, "processed"),
            (4, "processed"),
            (5, "processed")
        ])
    );
    assert_eq!(effects(&pool).await, vec![1, 2, 3, 4, 5]);
    let r = handle_event(&state, b.request()).await;
    let (status, body) = parts(&r);
    assert_eq!((status, body["status"].as_str()), (200, Some("duplicate")));
    assert!(
        outcomes(&body).iter().all(|(_, o)| o == "duplicate"),
        "{body}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_messages").await,
        5
    );
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn duplicates_across_batches_are_skipped_per_event(pool: PgPool) {
    let (state, _) = setup(&pool).await;
    // A single delivery first, then two overlapping batches (a different composition after a crash).
    let r = handle_event(
        &state,
        Delivery::new("notes", 3, &payload("c")).key("k").request(),
    )
    .await;
    let (status, body) = parts(&r);
    assert_eq!(status, 200);
    assert_eq!(body["outbox_id"], 3, "k = 1 keeps its top-level fields");
    assert_eq!(outcomes(&body), expect(&[(3, "processed")]));
    let r = handle_event(&state, notes(&[1, 2, 3], &["a", "b", "c"]).request()).await;
    let (status, body) = parts(&r);
    assert_eq!((status, body["status"].as_str()), (200, Some("processed")));
    assert_eq!(
        outcomes(&body),
        expect(&[(1, "processed"), (2, "processed"), (3, "duplicate")])
    );
    let r = handle_event(
        &state,
        notes(&[2, 3, 4, 5], &["b", "c", "d", "e"]).request(),
    )
    .await;
    assert_eq!(
        outcomes(&parts(&r).1),
        expect(&[
            (2, "duplicate"),
            (3, "duplicate"),
            (4, "processed"),
            (5, "processed")
        ])
    );
    assert_eq!(effects(&pool).await, vec![1, 2, 3, 4, 5]);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn overlapping_batches_delivered_at_once_apply_each_event_once(pool: PgPool) {
    // A redelivery racing the first delivery, and a batch re-formed after a crash racing both: the dedupe rows of
    // a batch are inserted in one statement, so the racers wait on each other's rows and skip what committed. A
    // second application would hit `effects`' primary key: a 503 here.
    let (state, _) = setup(&pool).await;
    let state = Arc::new(state);
    let first = notes(&[1, 2, 3, 4, 5], &["a", "b", "c", "d", "e"]);
    let reformed = notes(&[3, 4, 5, 6, 7, 8], &["c", "d", "e", "f", "g", "h"]);
    let mut racers = Vec::new();
    for b in [&first, &reformed, &first, &reformed, &first, &reformed] {
        let (state, req) = (state.clone(), b.request());
        racers.push(tokio::spawn(async move {
            let r = handle_event(&state, req).await;
            parts(&r)
        }));
    }
    let mut processed = Vec::new();
    for r in racers {
        let (status, body) = r.await.unwrap();
        assert_eq!(status, 200, "{body}");
        processed.extend(
            outcomes(&body)
                .into_iter()
                .filter(|(_, o)| o == "processed")
                .map(|(id, _)| id),
        );
    }
    processed.sort_unstable();
    assert_eq!(
        processed,
        (1..=8).collect::<Vec<i64>>(),
        "each event processed by exactly one racer"
    );
    assert_eq!(effects(&pool).await, (1..=8).collect::<Vec<i64>>());
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_transient_failure_commits_the_events_before_it_and_the_retry_applies_the_rest(
    pool: PgPool,
) {
    let (state, flaky) = setup(&pool).await;
    let b = notes(&[1, 2, 3, 4, 5], &["a", "b", "flaky", "d", "e"]);
    let r = handle_event(&state, b.request()).await;
    let (status, body) = parts(&r);
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["status"], "partial");
    assert!(
        body["error"].as_str().unwrap().contains("event 3"),
        "{body}"
    );
    assert_eq!(
        outcomes(&body),
        expect(&[
            (1, "processed"),
            (2, "processed"),
            (3, "retry"),
            (4, "not_attempted"),
            (5, "not_attempted")
        ])
    );
    assert_eq!(effects(&pool).await, vec![1, 2], "event 3 was undone alone");
    flaky.store(false, Ordering::SeqCst);
    let r = handle_event(&state, b.request()).await;
    let (status, body) = parts(&r);
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        outcomes(&body),
        expect(&[
            (1, "duplicate"),
            (2, "duplicate"),
            (3, "processed"),
            (4, "processed"),
            (5, "processed")
        ])
    );
    assert_eq!(effects(&pool).await, vec![1, 2, 3, 4, 5]);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_permanent_failure_on_an_ordered_key_stops_there(pool: PgPool) {
    let (state, _) = setup(&pool).await;
    let b = ledger(
        &[11, 12, 13, 14, 15],
        &["a", "b", "poison", "d", "e"],
        "acct-1",
        1,
    );
    let r = handle_event(&state, b.request()).await;
    let (status, body) = parts(&r);
    assert_eq!(status, 489, "{body}");
    assert_eq!(
        r.headers().get("upstash-nonretryable-error").unwrap(),
        "true"
    );
    assert_eq!(
        outcomes(&body),
        expect(&[
            (11, "processed"),
            (12, "processed"),
            (13, "failed"),
            (14, "not_attempted"),
            (15, "not_attempted")
        ])
    );
    assert_eq!(body["events"][2]["error"], "poison refused");
    assert_eq!(effects(&pool).await, vec![11, 12]);
    let last: i64 = sqlx::query_scalar(
        "SELECT last_seq FROM consumer_sequences WHERE topic = 'ledger' AND partition_key = 'acct-1'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        last, 2,
        "the failed event's sequence step was undone with it"
    );
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_permanent_failure_on_an_unordered_topic_does_not_stop_the_others(pool: PgPool) {
    let (state, _) = setup(&pool).await;
    let b = notes(&[1, 2, 3, 4, 5], &["a", "b", "poison", "d", "e"]);
    let r = handle_event(&state, b.request()).await;
    let (status, body) = parts(&r);
    assert_eq!(status, 489, "{body}");
    assert_eq!(body["status"], "partial");
    assert_eq!(
        outcomes(&body),
        expect(&[
            (1, "processed"),
            (2, "processed"),
            (3, "failed"),
            (4, "processed"),
            (5, "processed")
        ])
    );
    assert_eq!(effects(&pool).await, vec![1, 2, 4, 5]);
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn batches_of_the_wrong_shape_are_refused_with_a_clear_message(pool: PgPool) {
    let (state, _) = setup(&pool).await;
    let gap = Batch::new(vec![
        Delivery::new("ledger", 1, &payload("a")).key("k").seq(1),
        Delivery::new("ledger", 2, &payload("b")).key("k").seq(3),
    ]);
    let keys = Batch::new(vec![
        Delivery::new("ledger", 1, &payload("a")).key("k").seq(1),
        Delivery::new("ledger", 2, &payload("b")).key("j").seq(2),
    ]);
    let mixed = Batch::new(vec![
        Delivery::new("ledger", 1, &payload("a")).key("k").seq(1),
        Delivery::new("ledger", 2, &payload("b")).key("k"),
    ]);
    let twice = notes(&[7, 7], &["a", "a"]);
    for (b, want) in [
        (gap, "not consecutive"),
        (keys, "mixes partition keys"),
        (mixed, "mixes ordered and unordered"),
        (twice, "appears twice"),
    ] {
        let r = handle_event(&state, b.request()).await;
        let (status, body) = parts(&r);
        assert_eq!(status, 489, "{body}");
        assert!(body["error"].as_str().unwrap().contains(want), "{body}");
    }
    assert!(effects(&pool).await.is_empty());
    // The informational id copy must name the signed ids in order.
    let b = notes(&[1, 2], &["a", "b"]);
    let r = handle_event(&state, b.request_with_id_copy("2,1")).await;
    assert_eq!(parts(&r).0, 401);
    let r = handle_event(&state, b.request_with_id_copy("1")).await;
    assert_eq!(parts(&r).0, 401);
    assert!(effects(&pool).await.is_empty());
}

// ---- callbacks ---------------------------------------------------------------------------------------------

/// Enqueues `n` events of `topic` (ordered: key `key`), notes from `texts`; their ids.
async fn enqueue_n(pool: &PgPool, topic: &Topic, key: &str, texts: &[&str]) -> Vec<i64> {
    let mut tx = pool.begin().await.unwrap();
    let mut ids = Vec::new();
    for t in texts {
        let ev = enqueue(
            &mut tx,
            NewEvent::new(topic, key, &json!({ "note": t })).unwrap(),
        )
        .await
        .unwrap();
        ids.push(ev.id.get());
    }
    tx.commit().await.unwrap();
    // As the relay leaves them: dispatched in one message.
    sqlx::query("UPDATE outbox SET dispatched_at = now(), qstash_message_id = 'msg_batch' WHERE id = ANY($1)")
        .bind(&ids)
        .execute(pool)
        .await
        .unwrap();
    ids
}

fn post(path: &str, body: &Value) -> lambda_http::Request {
    signed_post(
        path,
        body.to_string().as_bytes(),
        &[("upstash-message-id", "msg_callback")],
    )
}

/// QStash's callback body for batch `b` with the consumer's last `status` and response `response`.
fn callback_body(b: &Batch, status: i32, response: &[u8], dlq: Option<&str>) -> Value {
    let mut v = json!({
        "status": status,
        "body": STANDARD.encode(response),
        "retried": 0,
        "maxRetries": 3,
        "sourceMessageId": "msg_batch",
        "url": b.signed_url(),
        "method": "POST",
        "sourceHeader": {"Content-Type": ["application/json"]},
        "sourceBody": STANDARD.encode(b.body()),
    });
    if let Some(d) = dlq {
        v["dlqId"] = json!(d);
    }
    v
}

async fn flags(pool: &PgPool, id: i64) -> (bool, bool, bool) {
    sqlx::query_as(
        "SELECT delivered_at IS NOT NULL, dead_lettered_at IS NOT NULL, dispatched_at IS NOT NULL FROM outbox WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn dead_letters(pool: &PgPool) -> Vec<(i64, String, Option<String>)> {
    sqlx::query_as("SELECT outbox_id, natural_id, resolution FROM dead_letters ORDER BY outbox_id")
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn key_state(pool: &PgPool, key: &str) -> (i64, Option<i64>, Option<i64>) {
    sqlx::query_as(
        "SELECT done_seq, blocked_id, inflight_id FROM outbox_keys WHERE topic = 'ledger' AND partition_key = $1",
    )
    .bind(key)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn the_delivery_callback_of_a_batch_advances_the_key_once_to_its_last_sequence(pool: PgPool) {
    let (state, _) = setup(&pool).await;
    let ordered = Topic::ordered("ledger");
    // Four events; the relay published the first three in one message (the fourth keeps the key row alive).
    let ids = enqueue_n(&pool, &ordered, "acct-1", &["a", "b", "c", "d"]).await;
    sqlx::query(
        "UPDATE outbox_keys SET inflight_id = $1, inflight_since = now() WHERE topic = 'ledger'",
    )
    .bind(ids[2])
    .execute(&pool)
    .await
    .unwrap();
    let b = ledger(&ids[..3], &["a", "b", "c"], "acct-1", 1);
    let r = handle_callback(
        &state.receiver,
        post("/delivered", &callback_body(&b, 200, b"{}", None)),
    )
    .await;
    let (status, body) = parts(&r);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["keys_advanced"], 1);
    assert_eq!(body["outbox_ids"], json!(ids[..3]));
    for id in &ids[..3] {
        assert!(flags(&pool, *id).await.0, "event {id} delivered");
    }
    assert!(!flags(&pool, ids[3]).await.0);
    assert_eq!(key_state(&pool, "acct-1").await, (3, None, None));
    // Repeated evidence: nothing moves.
    let r = handle_callback(
        &state.receiver,
        post("/delivered", &callback_body(&b, 200, b"{}", None)),
    )
    .await;
    assert_eq!(parts(&r).1["keys_advanced"], 0);
    // A failed attempt is noted on every event of the message.
    let b4 = ledger(&ids[3..], &["d"], "acct-1", 4);
    let r = handle_callback(
        &state.receiver,
        post("/delivered", &callback_body(&b4, 503, b"{}", None)),
    )
    .await;
    assert_eq!(parts(&r).1["status"], "attempt_failed");
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn the_failure_callback_of_an_ordered_batch_dead_letters_the_failed_event_only(pool: PgPool) {
    let (state, _) = setup(&pool).await;
    let ids = enqueue_n(
        &pool,
        &Topic::ordered("ledger"),
        "acct-1",
        &["a", "b", "poison", "d", "e"],
    )
    .await;
    let b = ledger(&ids, &["a", "b", "poison", "d", "e"], "acct-1", 1);
    let r = handle_event(&state, b.request()).await;
    assert_eq!(r.status().as_u16(), 489);
    let response: Vec<u8> = r.body().as_ref().to_vec();
    let cb = callback_body(&b, 489, &response, Some("dlq-1"));
    let r = handle_callback(&state.receiver, post("/failure", &cb)).await;
    let (status, body) = parts(&r);
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        dead_letters(&pool).await,
        vec![(ids[2], format!("dlq-1/{}", ids[2]), None)],
        "exactly one dead letter, the failed event's"
    );
    assert_eq!(flags(&pool, ids[0]).await, (true, false, true));
    assert_eq!(flags(&pool, ids[1]).await, (true, false, true));
    assert_eq!(flags(&pool, ids[2]).await, (false, true, true));
    for id in &ids[3..] {
        assert_eq!(
            flags(&pool, *id).await,
            (false, false, true),
            "left behind the dead head"
        );
    }
    assert_eq!(key_state(&pool, "acct-1").await, (2, Some(ids[2]), None));
    // QStash retries the callback: nothing new.
    let r = handle_callback(&state.receiver, post("/failure", &cb)).await;
    assert_eq!(parts(&r).0, 200);
    assert_eq!(dead_letters(&pool).await.len(), 1);
    // The operator sees and redrives that one event; its key is unblocked.
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
    assert_eq!(page.items.len(), 1);
    let dl = outbox::dead_letters::get(&mut conn, page.items[0].id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(dl.outbox_id, Some(OutboxId(ids[2])));
    assert!(dl.error.contains("poison refused"), "{}", dl.error);
    let redriven = outbox::dead_letters::redrive(&mut conn, page.items[0].id, Default::default())
        .await
        .unwrap();
    assert_eq!(redriven.outbox_id, ids[2]);
    assert_eq!(key_state(&pool, "acct-1").await.1, None, "unblocked");
    assert_eq!(
        flags(&pool, ids[2]).await,
        (false, false, false),
        "pending again"
    );
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn the_failure_callback_of_an_unordered_batch_dead_letters_the_failed_event_only(
    pool: PgPool,
) {
    let (state, _) = setup(&pool).await;
    let ids = enqueue_n(
        &pool,
        &Topic::unordered("notes"),
        "k",
        &["a", "b", "poison", "d", "e"],
    )
    .await;
    let b = notes(&ids, &["a", "b", "poison", "d", "e"]);
    let r = handle_event(&state, b.request()).await;
    assert_eq!(r.status().as_u16(), 489);
    let cb = callback_body(&b, 489, r.body().as_ref(), Some("dlq-2"));
    let r = handle_callback(&state.receiver, post("/failure", &cb)).await;
    assert_eq!(parts(&r).0, 200, "{}", parts(&r).1);
    assert_eq!(
        dead_letters(&pool).await,
        vec![(ids[2], format!("dlq-2/{}", ids[2]), None)]
    );
    for i in [0, 1, 3, 4] {
        assert_eq!(
            flags(&pool, ids[i]).await,
            (true, false, true),
            "event {i} applied: delivered"
        );
    }
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn an_unordered_batch_given_up_on_retries_dead_letters_the_retried_event_and_requeues_the_rest(
    pool: PgPool,
) {
    let (state, _) = setup(&pool).await;
    let ids = enqueue_n(
        &pool,
        &Topic::unordered("notes"),
        "k",
        &["a", "b", "flaky", "d", "e"],
    )
    .await;
    let b = notes(&ids, &["a", "b", "flaky", "d", "e"]);
    let r = handle_event(&state, b.request()).await;
    assert_eq!(r.status().as_u16(), 503);
    let cb = callback_body(&b, 503, r.body().as_ref(), Some("dlq-3"));
    let r = handle_callback(&state.receiver, post("/failure", &cb)).await;
    let (status, body) = parts(&r);
    assert_eq!(status, 200, "{body}");
    // The event the consumer kept answering 503 for is the one QStash gave up on: its own dead letter, as a
    // single event's would be. The ones after it were never tried: due again for the relay.
    assert_eq!(
        dead_letters(&pool).await,
        vec![(ids[2], format!("dlq-3/{}", ids[2]), None)]
    );
    assert_eq!(body["requeued"], json!(ids[3..]));
    assert_eq!(flags(&pool, ids[0]).await, (true, false, true));
    assert_eq!(flags(&pool, ids[2]).await, (false, true, true));
    for id in &ids[3..] {
        assert_eq!(
            flags(&pool, *id).await,
            (false, false, false),
            "due again for the relay"
        );
    }
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn without_a_verdict_the_first_unapplied_ordered_event_or_every_unapplied_unordered_one_dies(
    pool: PgPool,
) {
    let (state, flaky) = setup(&pool).await;
    // Ordered: the consumer applied the first two, then its responses were lost (QStash reports status 0).
    let ids = enqueue_n(
        &pool,
        &Topic::ordered("ledger"),
        "acct-9",
        &["a", "b", "flaky", "d"],
    )
    .await;
    let b = ledger(&ids, &["a", "b", "flaky", "d"], "acct-9", 1);
    assert_eq!(
        handle_event(&state, b.request()).await.status().as_u16(),
        503
    );
    let r = handle_callback(
        &state.receiver,
        post("/failure", &callback_body(&b, 0, b"", Some("dlq-4"))),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
    assert_eq!(
        dead_letters(&pool).await,
        vec![(ids[2], format!("dlq-4/{}", ids[2]), None)]
    );
    assert_eq!(flags(&pool, ids[3]).await, (false, false, true));
    assert_eq!(key_state(&pool, "acct-9").await.0, 2);

    // Unordered: every unapplied event dies, each with its own dead letter.
    flaky.store(true, Ordering::SeqCst);
    let un = enqueue_n(&pool, &Topic::unordered("notes"), "k", &["a", "flaky", "c"]).await;
    let b = notes(&un, &["a", "flaky", "c"]);
    assert_eq!(
        handle_event(&state, b.request()).await.status().as_u16(),
        503
    );
    let r = handle_callback(
        &state.receiver,
        post(
            "/failure",
            &callback_body(&b, 0, b"<html>gateway timeout</html>", Some("dlq-5")),
        ),
    )
    .await;
    assert_eq!(parts(&r).0, 200);
    let dls: Vec<i64> = dead_letters(&pool)
        .await
        .into_iter()
        .map(|d| d.0)
        .filter(|id| un.contains(id))
        .collect();
    assert_eq!(dls, vec![un[1], un[2]]);
    assert!(flags(&pool, un[0]).await.0);
}

/// A batch member's dead letter says what the consumer said about *that* event (decision record 0027), never the
/// consumer's whole response (which names the other events and their errors: that stays in `response_body`).
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_dead_batch_members_error_is_its_own_error_not_the_whole_response(pool: PgPool) {
    let (state, _) = setup(&pool).await;
    let texts = ["a", "poison", "b", "rotten", "c"];
    let ids = enqueue_n(&pool, &Topic::unordered("notes"), "k", &texts).await;
    let b = notes(&ids, &texts);
    let r = handle_event(&state, b.request()).await;
    assert_eq!(r.status().as_u16(), 489);
    let response = String::from_utf8(r.body().as_ref().to_vec()).unwrap();
    let cb = callback_body(&b, 489, response.as_bytes(), Some("dlq-own"));
    let r = handle_callback(&state.receiver, post("/failure", &cb)).await;
    assert_eq!(parts(&r).0, 200, "{}", parts(&r).1);
    let dead: Vec<(i64, String, Option<String>)> = sqlx::query_as(
        "SELECT outbox_id, error, response_body FROM dead_letters WHERE resolved_at IS NULL ORDER BY outbox_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        dead.iter().map(|d| d.0).collect::<Vec<_>>(),
        vec![ids[1], ids[3]],
        "the two refused events, each its own dead letter"
    );
    for (id, error, response_body) in &dead {
        let (own, other, other_id) = if *id == ids[1] {
            ("poison refused", "rotten note refused", ids[3])
        } else {
            ("rotten note refused", "poison refused", ids[1])
        };
        assert!(error.contains(own), "event {id}: its own error: {error}");
        assert!(
            error.starts_with("QStash gave up after 1 attempt(s); last status 489"),
            "event {id}: the message-level prefix stays: {error}"
        );
        assert!(
            !error.contains(other) && !error.contains(&format!("event {other_id}:")),
            "event {id}: nothing of the other refused event: {error}"
        );
        assert!(
            !error.contains('{') && !error.contains("\"events\"") && !error.contains("outcome"),
            "event {id}: no JSON of the consumer's response: {error}"
        );
        assert_eq!(
            response_body.as_deref(),
            Some(response.as_str()),
            "event {id}: the whole response stays in response_body"
        );
    }
}
