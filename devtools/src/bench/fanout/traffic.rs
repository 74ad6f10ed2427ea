//! The events the parts of `bench fanout` write: batches through the producer's statement, and a live producer
//! at a steady rate.

use std::time::Duration;

use outbox::{NewEvent, Topic};
use serde_json::json;
use sqlx::PgPool;

use super::rig::{ORDERED, UNORDERED};

/// Writes events through the producer's statement, 1,000 per transaction.
pub(super) async fn produce(pool: &PgPool, events: Vec<NewEvent>) -> anyhow::Result<()> {
    for chunk in events.chunks(1_000) {
        let mut tx = pool.begin().await?;
        outbox::enqueue_batch(&mut tx, chunk).await?;
        tx.commit().await?;
    }
    Ok(())
}

pub(super) fn ordered_events(keys: u64, per_key: u64) -> anyhow::Result<Vec<NewEvent>> {
    let mut out = Vec::with_capacity((keys * per_key) as usize);
    for s in 1..=per_key {
        for k in 1..=keys {
            out.push(NewEvent::new(
                &ORDERED,
                format!("key-{k}"),
                &json!({"k": k, "s": s, "pad": "x".repeat(170)}),
            )?);
        }
    }
    Ok(out)
}

pub(super) fn unordered_events(n: u64) -> anyhow::Result<Vec<NewEvent>> {
    (0..n)
        .map(|i| {
            Ok(NewEvent::new(
                &UNORDERED,
                format!("k{}", i % 1000),
                &json!({"i": i, "pad": "x".repeat(170)}),
            )?)
        })
        .collect()
}

/// A live producer: one event of `topic` per 1/`rate` s over `keys` keys, each in its own transaction, until the
/// returned sender says stop; its task returns how many it wrote.
pub(super) fn steady_producer(
    pool: &PgPool,
    topic: Topic,
    rate: u64,
    keys: u64,
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<anyhow::Result<u64>>,
) {
    let (stop, rx) = tokio::sync::watch::channel(false);
    let pool = pool.clone();
    let task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
        let mut n = 0u64;
        while !*rx.borrow() {
            tick.tick().await;
            let e = NewEvent::new(&topic, format!("k{}", n % keys), &json!({"n": n}))?;
            let mut conn = pool.acquire().await?;
            outbox::enqueue(&mut conn, e).await?;
            n += 1;
        }
        anyhow::Ok(n)
    });
    (stop, task)
}
