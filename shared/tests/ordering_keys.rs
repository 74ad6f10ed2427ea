//! The life of an ordered key's relay state: created by the first producer, advanced by delivery evidence,
//! released when idle (never while a producer holds the key), re-created by a later producer after the last
//! finished event, and claimed head by head.

use outbox::OutboxId;
use outbox::db::Statements;
use outbox::internals::claim::ClaimStatements;
use outbox::internals::ordering::{DeliveryRecorded, record_delivery};
use outbox::producer::{NewEvent, Topic, enqueue};
use serde_json::json;
use sqlx::PgPool;

const T: Topic = Topic::ordered("orders");

async fn key_row(pool: &PgPool) -> Option<(i64, Option<i64>)> {
    sqlx::query_as("SELECT done_seq, inflight_id FROM outbox_keys WHERE topic = 'orders' AND partition_key = 'k'")
        .fetch_optional(pool)
        .await
        .unwrap()
}

async fn put(pool: &PgPool, n: i32) -> i64 {
    let mut conn = pool.acquire().await.unwrap();
    enqueue(&mut conn, NewEvent::new(&T, "k", &json!({"n": n})).unwrap())
        .await
        .unwrap()
        .id
        .get()
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn keys_advance_release_and_come_back(pool: PgPool) {
    let claims = ClaimStatements::new(10, Statements::Prepared);
    let a = put(&pool, 1).await;
    let b = put(&pool, 2).await;
    assert_eq!(key_row(&pool).await, Some((0, None)));

    let mut conn = pool.acquire().await.unwrap();
    let heads = claims.claim_ordered(&mut conn, 30.0).await.unwrap();
    assert_eq!(
        heads.iter().map(|e| e.id).collect::<Vec<_>>(),
        vec![a],
        "only the head is claimed"
    );
    // Evidence for the head advances the key; a successor exists, so the key stays.
    assert_eq!(
        record_delivery(&mut conn, OutboxId(a), Statements::Prepared)
            .await
            .unwrap(),
        DeliveryRecorded::Recorded { key_advanced: true }
    );
    assert_eq!(key_row(&pool).await, Some((1, None)));
    // Repeated evidence changes nothing.
    assert_eq!(
        record_delivery(&mut conn, OutboxId(a), Statements::Prepared)
            .await
            .unwrap(),
        DeliveryRecorded::Recorded {
            key_advanced: false
        }
    );
    assert_eq!(key_row(&pool).await, Some((1, None)));
    assert_eq!(
        record_delivery(&mut conn, OutboxId(999_999), Statements::Prepared)
            .await
            .unwrap(),
        DeliveryRecorded::UnknownEvent
    );

    let heads = claims.claim_ordered(&mut conn, 30.0).await.unwrap();
    assert_eq!(heads.iter().map(|e| e.id).collect::<Vec<_>>(), vec![b]);

    // A producer is about to add event 3 (holds the key's sequence lock): the last evidence must not release the
    // key, or event 3 would have no relay state.
    let mut producer = pool.begin().await.unwrap();
    let c = enqueue(
        &mut producer,
        NewEvent::new(&T, "k", &json!({"n": 3})).unwrap(),
    )
    .await
    .unwrap();
    record_delivery(&mut conn, OutboxId(b), Statements::Prepared)
        .await
        .unwrap();
    assert_eq!(
        key_row(&pool).await,
        Some((2, None)),
        "released while a producer held the key"
    );
    producer.commit().await.unwrap();
    let heads = claims.claim_ordered(&mut conn, 30.0).await.unwrap();
    assert_eq!(heads.iter().map(|e| e.id).collect::<Vec<_>>(), vec![c.id]);

    // The last event delivered with no producer around: the key is released.
    record_delivery(&mut conn, c.id, Statements::Prepared)
        .await
        .unwrap();
    assert_eq!(key_row(&pool).await, None, "an idle key is released");

    // A later producer brings it back, starting after the last finished event.
    let d = put(&pool, 4).await;
    assert_eq!(key_row(&pool).await, Some((3, None)));
    let heads = claims.claim_ordered(&mut conn, 30.0).await.unwrap();
    assert_eq!(
        heads
            .iter()
            .map(|e| (e.id.get(), e.seq))
            .collect::<Vec<_>>(),
        vec![(d, Some(4))]
    );
}

/// Evidence out of order: the next event delivered and recorded before the one before it (a Postgres crash lost
/// the relay's asynchronous settle of event 1 after QStash had event 2; the explorer's seed 113). When event 1's
/// evidence comes, the key moves over both. Before, it moved to 1 only and waited forever for 2, already
/// delivered: every later event of the key stayed pending.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn evidence_that_comes_out_of_order_moves_the_key_over_both(pool: PgPool) {
    let a = put(&pool, 1).await;
    let b = put(&pool, 2).await;
    let c = put(&pool, 3).await;
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(
        record_delivery(&mut conn, OutboxId(b), Statements::Prepared)
            .await
            .unwrap(),
        DeliveryRecorded::Recorded {
            key_advanced: false
        }
    );
    assert_eq!(key_row(&pool).await, Some((0, None)));
    assert_eq!(
        record_delivery(&mut conn, OutboxId(a), Statements::Prepared)
            .await
            .unwrap(),
        DeliveryRecorded::Recorded { key_advanced: true }
    );
    assert_eq!(key_row(&pool).await, Some((2, None)), "moved over 1 and 2");
    let heads = ClaimStatements::new(10, Statements::Prepared)
        .claim_ordered(&mut conn, 30.0)
        .await
        .unwrap();
    assert_eq!(
        heads.iter().map(|e| e.id.get()).collect::<Vec<_>>(),
        vec![c]
    );
}
