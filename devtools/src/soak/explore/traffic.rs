//! The explorer's producers: tasks writing events through the library's producer API at the rate of the current
//! traffic phase ([`super::schedule::Op::Traffic`]), every transaction recorded in the history with its times and
//! whether it committed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::NewEvent;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::PgPool;
use tokio::sync::watch;

use super::history::{History, Written};
use super::schedule::{KEYS, SUBSCRIBERS, TOPICS};
use crate::soak::SoakPayload;

/// The current traffic phase.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Phase {
    /// Events per second, all producers together.
    pub rate: f64,
    pub poison: f64,
    pub delayed: f64,
}

/// Producer tasks of a run.
pub const PRODUCERS: usize = 3;

/// One producer: 1 to 3 events per transaction at its share of the phase's rate, each with a fresh number; a
/// failed transaction is retried with new numbers (its commit may have happened: the checker finds out from the
/// outbox).
pub async fn produce(
    db: PgPool,
    seed: u64,
    index: usize,
    phase: watch::Receiver<Phase>,
    next: Arc<AtomicU64>,
    history: Arc<Mutex<History>>,
    stop: watch::Receiver<bool>,
) {
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(1000).wrapping_add(index as u64));
    loop {
        if *stop.borrow() {
            return;
        }
        let p = *phase.borrow();
        if p.rate <= 0.01 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let batch = rng.random_range(1..=3u32);
        let per_producer = p.rate / PRODUCERS as f64;
        let pause = Duration::from_secs_f64((f64::from(batch) / per_producer).min(2.0));
        tokio::time::sleep(pause).await;
        let events: Vec<(usize, u32, Vec<usize>, bool)> = (0..batch)
            .map(|_| {
                let topic = rng.random_range(0..TOPICS.len());
                let key = rng.random_range(0..KEYS);
                let poison_for = if rng.random_bool(p.poison.clamp(0.0, 1.0)) {
                    let mut v: Vec<usize> = (0..SUBSCRIBERS.len())
                        .filter(|_| rng.random_bool(0.5))
                        .collect();
                    if v.is_empty() {
                        v.push(rng.random_range(0..SUBSCRIBERS.len()));
                    }
                    v
                } else {
                    Vec::new()
                };
                let delayed = rng.random_bool(p.delayed.clamp(0.0, 1.0));
                (topic, key, poison_for, delayed)
            })
            .collect();
        let delays: Vec<u64> = events
            .iter()
            .map(|_| rng.random_range(1000..5000))
            .collect();
        loop {
            let first = next.fetch_add(events.len() as u64, Ordering::SeqCst);
            let start = chrono::Utc::now();
            let result = write(&db, first, &events, &delays).await;
            let end = chrono::Utc::now();
            let committed = match &result {
                Ok(()) => Some(true),
                Err(WriteError::BeforeCommit) => Some(false),
                Err(WriteError::Commit) => None,
            };
            {
                let mut h = history.lock().unwrap_or_else(|e| e.into_inner());
                for (i, (topic, key, poison_for, delayed)) in events.iter().enumerate() {
                    h.written.push(Written {
                        n: first + i as u64,
                        topic: *topic,
                        key: *key,
                        poison_for: poison_for.clone(),
                        delayed: *delayed,
                        start,
                        end,
                        committed,
                    });
                }
            }
            if result.is_ok() || *stop.borrow() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

enum WriteError {
    BeforeCommit,
    Commit,
}

async fn write(
    db: &PgPool,
    first: u64,
    events: &[(usize, u32, Vec<usize>, bool)],
    delays: &[u64],
) -> Result<(), WriteError> {
    let before = |_| WriteError::BeforeCommit;
    let mut tx = db.begin().await.map_err(before)?;
    for (i, (topic, key, poison_for, delayed)) in events.iter().enumerate() {
        let payload = SoakPayload {
            n: first + i as u64,
            poison: false,
            poison_for: poison_for
                .iter()
                .map(|&s| SUBSCRIBERS[s].to_owned())
                .collect(),
        };
        let mut event = NewEvent::new(&TOPICS[*topic], format!("k{key}"), &payload)
            .map_err(|_| WriteError::BeforeCommit)?;
        if *delayed {
            event = event.delay(Duration::from_millis(delays[i]));
        }
        outbox::enqueue(&mut tx, event)
            .await
            .map_err(|_| WriteError::BeforeCommit)?;
    }
    tx.commit().await.map_err(|_| WriteError::Commit)
}
