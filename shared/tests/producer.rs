//! Guarantee 1 at write time, and the producer side of per-key order.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::time::Duration;

use outbox::InvalidEvent;
use outbox::producer::{
    DEFAULT_MAX_PAYLOAD_BYTES, EnqueueError, NewEvent, Producer, Topic, enqueue, enqueue_batch,
};
use rand::Rng;
use serde_json::json;
use sqlx::{PgPool, Row};

const ORDERS: Topic = Topic::ordered("orders");
const AUDIT: Topic = Topic::unordered("audit");

async fn business_table(pool: &PgPool) {
    sqlx::query("CREATE TABLE business_orders (id bigserial PRIMARY KEY, customer text NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn business_row_and_event_commit_or_roll_back_together(pool: PgPool) {
    business_table(&pool).await;

    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO business_orders (customer) VALUES ('c-1')")
        .execute(&mut *tx)
        .await
        .unwrap();
    enqueue(
        &mut tx,
        NewEvent::new(&ORDERS, "c-1", &json!({"order": 1})).unwrap(),
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(
        count(&pool, "SELECT count(*) FROM business_orders").await,
        0
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM outbox").await,
        0,
        "rolled back event must not exist"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM outbox_sequences").await,
        0,
        "sequence returned on rollback"
    );

    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO business_orders (customer) VALUES ('c-1')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let ev = enqueue(
        &mut tx,
        NewEvent::new(&ORDERS, "c-1", &json!({"order": 1}))
            .unwrap()
            .traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            .correlation_id("req-9")
            .schema_version(2),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        count(&pool, "SELECT count(*) FROM business_orders").await,
        1
    );
    assert_eq!(
        ev.seq,
        Some(1),
        "a rolled-back transaction leaves no gap in the key's sequence"
    );
    let row =
        sqlx::query("SELECT topic, partition_key, payload, headers FROM outbox WHERE id = $1")
            .bind(ev.id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(row.get::<String, _>("topic"), "orders");
    assert_eq!(
        row.get::<serde_json::Value, _>("payload"),
        json!({"order": 1})
    );
    assert_eq!(
        row.get::<serde_json::Value, _>("headers"),
        json!({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "correlation_id": "req-9", "schema_version": 2})
    );
    // The key is active for the relay, starting after nothing.
    let done: i64 = sqlx::query_scalar(
        "SELECT done_seq FROM outbox_keys WHERE topic = 'orders' AND partition_key = 'c-1'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(done, 0);
}

/// Producers on one ordered key commit in an order unrelated to the order they started or inserted their
/// business rows; the key's sequence must follow commit order. A second producer's enqueue waits for the first
/// producer's commit (the row lock), which is what makes this hold.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn per_key_sequence_follows_commit_order(pool: PgPool) {
    business_table(&pool).await;

    // Reverse order: T1 inserts its business row first, T2 second; T2 enqueues and commits first.
    let mut t1 = pool.begin().await.unwrap();
    let mut t2 = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO business_orders (customer) VALUES ('first-insert')")
        .execute(&mut *t1)
        .await
        .unwrap();
    sqlx::query("INSERT INTO business_orders (customer) VALUES ('second-insert')")
        .execute(&mut *t2)
        .await
        .unwrap();
    let e2 = enqueue(
        &mut t2,
        NewEvent::new(&ORDERS, "k", &json!({"by": "t2"})).unwrap(),
    )
    .await
    .unwrap();
    t2.commit().await.unwrap();
    let e1 = enqueue(
        &mut t1,
        NewEvent::new(&ORDERS, "k", &json!({"by": "t1"})).unwrap(),
    )
    .await
    .unwrap();
    t1.commit().await.unwrap();
    assert_eq!((e2.seq, e1.seq), (Some(1), Some(2)));

    // Concurrent: a second enqueue on the same key blocks until the first transaction ends. Shown by state, not
    // by time: the second producer is seen waiting on a lock, and its enqueue returns only after the first
    // producer has started to commit.
    let mut first = pool.begin().await.unwrap();
    let a = enqueue(
        &mut first,
        NewEvent::new(&ORDERS, "k", &json!({"n": "a"})).unwrap(),
    )
    .await
    .unwrap();
    let committing = Arc::new(AtomicBool::new(false));
    let pool2 = pool.clone();
    let committing2 = committing.clone();
    let second = tokio::spawn(async move {
        let mut tx = pool2.begin().await.unwrap();
        let b = enqueue(
            &mut tx,
            NewEvent::new(&ORDERS, "k", &json!({"n": "b"})).unwrap(),
        )
        .await
        .unwrap();
        let after_first = committing2.load(AtomicOrdering::SeqCst);
        tx.commit().await.unwrap();
        (b, after_first)
    });
    // However long the second producer takes to get there; the limit only stops a hung test.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        assert!(
            !second.is_finished(),
            "second producer must wait for the first one's commit"
        );
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if waiting == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the second producer never waited on the key's row lock ({waiting} lock waiters)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !second.is_finished(),
        "second producer must wait for the first one's commit"
    );
    committing.store(true, AtomicOrdering::SeqCst);
    first.commit().await.unwrap();
    let (b, after_first) = second.await.unwrap();
    assert!(
        after_first,
        "the second enqueue returned before the first producer committed"
    );
    assert_eq!((a.seq, b.seq), (Some(3), Some(4)));

    // Many producers with random timing: sort by commit order, the sequence must be 5, 6, 7, … Commit order is
    // recorded under a lock held across the commit, so a task that is slow to count its commit cannot be
    // overtaken by one that committed after it.
    let commits = Arc::new(tokio::sync::Mutex::new(0usize));
    let mut tasks = Vec::new();
    for i in 0..8 {
        let pool = pool.clone();
        let commits = commits.clone();
        tasks.push(tokio::spawn(async move {
            let (pre, post) = {
                let mut r = rand::rng();
                (r.random_range(0..40u64), r.random_range(15..50u64))
            };
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("INSERT INTO business_orders (customer) VALUES ($1)")
                .bind(format!("p{i}"))
                .execute(&mut *tx)
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(pre)).await;
            let ev = enqueue(
                &mut tx,
                NewEvent::new(&ORDERS, "k", &json!({"p": i})).unwrap(),
            )
            .await
            .unwrap();
            tokio::time::sleep(Duration::from_millis(post)).await;
            let mut n = commits.lock().await;
            tx.commit().await.unwrap();
            *n += 1;
            (*n, ev.seq.unwrap())
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    results.sort();
    let seqs: Vec<i64> = results.iter().map(|(_, s)| *s).collect();
    assert_eq!(
        seqs,
        (5..=12).collect::<Vec<i64>>(),
        "sequence in commit order: {results:?}"
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn batch_of_a_thousand_in_one_call(pool: PgPool) {
    let events: Vec<NewEvent> = (0..1000)
        .map(|i| {
            let topic = if i % 2 == 0 { &ORDERS } else { &AUDIT };
            NewEvent::new(
                topic,
                format!("key-{}", i % 7),
                &json!({"i": i, "pad": "x".repeat(150)}),
            )
            .unwrap()
        })
        .collect();
    let mut tx = pool.begin().await.unwrap();
    let out = enqueue_batch(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(out.len(), 1000);
    assert!(
        out.windows(2).all(|w| w[0].id < w[1].id),
        "ids follow input order"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox").await, 1000);
    // Result i is input i.
    for (i, ev) in out.iter().enumerate().step_by(97) {
        let p: serde_json::Value = sqlx::query_scalar("SELECT payload FROM outbox WHERE id = $1")
            .bind(ev.id)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(p["i"], json!(i));
        assert_eq!(ev.seq.is_some(), i % 2 == 0);
    }
    // Ordered events: per key, contiguous sequence 1..n in input order.
    let rows = sqlx::query("SELECT partition_key, array_agg(seq ORDER BY id) AS seqs FROM outbox WHERE seq IS NOT NULL GROUP BY 1")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(rows.len(), 7);
    for r in rows {
        let seqs: Vec<i64> = r.get("seqs");
        assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
    }
    // Another batch continues the sequences.
    let mut tx = pool.begin().await.unwrap();
    let more = enqueue_batch(
        &mut tx,
        &[NewEvent::new(&ORDERS, "key-0", &json!({})).unwrap()],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let n0: i64 = count(
        &pool,
        "SELECT count(*) FROM outbox WHERE partition_key = 'key-0' AND seq IS NOT NULL",
    )
    .await;
    assert_eq!(more[0].seq, Some(n0));
}

fn invalid(err: EnqueueError) -> (Option<usize>, InvalidEvent) {
    match err {
        EnqueueError::Invalid { index, problem } => (index, problem),
        other => panic!("expected a validation error, got {other:?}"),
    }
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn invalid_inputs_are_named_errors_and_write_nothing(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    type Check = fn(&InvalidEvent) -> bool;
    let cases: Vec<(NewEvent, Check)> = vec![
        (
            NewEvent::new(&Topic::unordered(""), "k", &1).unwrap(),
            |p| *p == InvalidEvent::EmptyTopic,
        ),
        (
            NewEvent::new(&Topic::unordered("a b"), "k", &1).unwrap(),
            |p| matches!(p, InvalidEvent::InvalidTopic(_)),
        ),
        (NewEvent::new(&ORDERS, "", &1).unwrap(), |p| {
            *p == InvalidEvent::EmptyKey
        }),
        (NewEvent::new(&ORDERS, "k".repeat(600), &1).unwrap(), |p| {
            matches!(p, InvalidEvent::KeyTooLong { len: 600, .. })
        }),
        (NewEvent::new(&ORDERS, "a\nb", &1).unwrap(), |p| {
            matches!(
                p,
                InvalidEvent::InvalidHeader {
                    name: "partition_key",
                    ..
                }
            )
        }),
        (
            NewEvent::new(&ORDERS, "k", &"x".repeat(DEFAULT_MAX_PAYLOAD_BYTES)).unwrap(),
            |p| matches!(p, InvalidEvent::PayloadTooLarge { .. }),
        ),
        (NewEvent::from_json(&ORDERS, "k", "{not json"), |p| {
            matches!(p, InvalidEvent::NotJson(_))
        }),
        (NewEvent::from_json_bytes(&ORDERS, "k", b"\xff\xfe"), |p| {
            *p == InvalidEvent::NotUtf8 { valid_up_to: 0 }
        }),
        (
            NewEvent::new(&ORDERS, "k", &json!({"s": "a\u{0}b"})).unwrap(),
            |p| *p == InvalidEvent::NulInPayload,
        ),
        (
            NewEvent::new(&ORDERS, "k", &1)
                .unwrap()
                .traceparent("not-a-traceparent"),
            |p| {
                matches!(
                    p,
                    InvalidEvent::InvalidHeader {
                        name: "traceparent",
                        ..
                    }
                )
            },
        ),
        (
            NewEvent::new(&ORDERS, "k", &1)
                .unwrap()
                .correlation_id("has space"),
            |p| {
                matches!(
                    p,
                    InvalidEvent::InvalidHeader {
                        name: "correlation_id",
                        ..
                    }
                )
            },
        ),
        (
            NewEvent::new(&ORDERS, "k", &1).unwrap().schema_version(0),
            |p| {
                matches!(
                    p,
                    InvalidEvent::InvalidHeader {
                        name: "schema_version",
                        ..
                    }
                )
            },
        ),
        (
            NewEvent::new(&ORDERS, "k", &1)
                .unwrap()
                .delay(Duration::from_secs(400 * 24 * 3600)),
            |p| matches!(p, InvalidEvent::DelayTooLong(_)),
        ),
    ];
    for (event, check) in cases {
        let (index, problem) = invalid(enqueue(&mut conn, event).await.unwrap_err());
        assert_eq!(index, None);
        assert!(check(&problem), "unexpected problem: {problem}");
    }
    // A typed payload that cannot be serialised.
    let mut bad_map = std::collections::HashMap::new();
    bad_map.insert(vec![1u8], 1);
    assert!(matches!(
        NewEvent::new(&ORDERS, "k", &bad_map),
        Err(EnqueueError::Serialize(_))
    ));

    // One bad event in a batch: its index is named and nothing of the batch is written.
    let mut batch: Vec<NewEvent> = (0..500)
        .map(|i| NewEvent::new(&ORDERS, "k", &json!({"i": i})).unwrap())
        .collect();
    batch.push(NewEvent::from_json(&ORDERS, "k", "[1,"));
    let err = enqueue_batch(&mut conn, &batch).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "event #500 rejected: payload is not valid JSON: EOF while parsing a value at line 1 column 3"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox").await, 0);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM outbox_sequences").await,
        0
    );

    // A smaller configured limit applies.
    let small = Producer::new().max_payload_bytes(10);
    let (_, p) = invalid(
        small
            .enqueue(
                &mut conn,
                NewEvent::new(&AUDIT, "k", &"0123456789").unwrap(),
            )
            .await
            .unwrap_err(),
    );
    assert_eq!(p, InvalidEvent::PayloadTooLarge { size: 12, max: 10 });
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn user_headers_are_stored_on_the_row_or_refused_naming_header_and_rule(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let ev = enqueue(
        &mut conn,
        NewEvent::new(&AUDIT, "k", &json!({"a": 1}))
            .unwrap()
            .correlation_id("req-9")
            .header("Tenant", "acme")
            .header("causation-id", "order-7"),
    )
    .await
    .unwrap();
    let headers: serde_json::Value = sqlx::query_scalar("SELECT headers FROM outbox WHERE id = $1")
        .bind(ev.id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        headers,
        json!({"correlation_id": "req-9", "user": {"tenant": "acme", "causation-id": "order-7"}}),
        "stored beside the pipeline's own fields, names lower-cased"
    );

    // A reserved name in a batch: the event and the header are named, nothing is written.
    let batch = [
        NewEvent::new(&ORDERS, "k", &1)
            .unwrap()
            .header("tenant", "a"),
        NewEvent::new(&ORDERS, "k", &2)
            .unwrap()
            .header("X-Outbox-Seq", "1"),
    ];
    let err = enqueue_batch(&mut conn, &batch).await.unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with("event #1 rejected: header \"X-Outbox-Seq\" refused: the name is reserved"),
        "{msg}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM outbox WHERE seq IS NOT NULL").await,
        0
    );
    let (index, problem) = invalid(
        enqueue(
            &mut conn,
            NewEvent::new(&AUDIT, "k", &1)
                .unwrap()
                .header("tenant", "a\r\nx-outbox-id: 1"),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(index, None);
    assert_eq!(
        problem,
        InvalidEvent::Header {
            name: "tenant".into(),
            rule: outbox::headers::HeaderRule::ControlCharacter
        }
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox").await, 1);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn delay_sets_available_at(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let ev = enqueue(
        &mut conn,
        NewEvent::new(&AUDIT, "k", &1)
            .unwrap()
            .delay(Duration::from_secs(3600)),
    )
    .await
    .unwrap();
    let secs: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM available_at - created_at)::float8 FROM outbox WHERE id = $1",
    )
    .bind(ev.id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!((secs - 3600.0).abs() < 1.0, "{secs}");
}
