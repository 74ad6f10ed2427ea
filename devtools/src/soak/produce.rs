//! The producers: tasks writing the soak's events through the library's producer API at the configured rate.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outbox::NewEvent;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::PgPool;

use super::app::SoakPayload;
use super::args::SoakArgs;
use super::counts::Counts;
use super::topics::{ORDERED, UNORDERED};

/// A producer task: takes the next event numbers, writes 1 to 3 events per transaction through the library's
/// producer API, paced to its share of `--rate`. A failed transaction is retried (a commit whose answer was lost
/// may have written its events: the report counts what the outbox holds).
pub(super) async fn produce(
    db: PgPool,
    args: SoakArgs,
    index: usize,
    next: Arc<AtomicU64>,
    counts: Arc<Counts>,
    started: Instant,
) {
    let mut rng = StdRng::seed_from_u64(args.seed.wrapping_mul(1000).wrapping_add(index as u64));
    loop {
        let batch = rng.random_range(1..=3u64);
        let first = next.fetch_add(batch, Ordering::SeqCst);
        if first >= args.events {
            return;
        }
        let last = (first + batch).min(args.events);
        let events: Vec<(u64, bool, String)> = (first..last)
            .map(|n| {
                (
                    n,
                    args.poison_every > 0 && n % args.poison_every == args.poison_every - 1,
                    format!("k{}", rng.random_range(0..args.keys)),
                )
            })
            .collect();
        // Pace: event `first` is due at first / rate seconds after the start.
        let due = started + Duration::from_secs_f64(first as f64 / args.rate);
        tokio::time::sleep_until(due.into()).await;
        let mut tries = 0u32;
        loop {
            match write(&db, &events).await {
                Ok(()) => break,
                Err(e) => {
                    tries += 1;
                    if tries % 10 == 1 {
                        eprintln!("soak: a producer transaction failed (retrying): {e:#}");
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        counts
            .written
            .fetch_add(events.len() as u64, Ordering::Relaxed);
    }
}

async fn write(db: &PgPool, events: &[(u64, bool, String)]) -> anyhow::Result<()> {
    let mut tx = db.begin().await?;
    for (n, poison, key) in events {
        let topic = if n % 2 == 0 { &ORDERED } else { &UNORDERED };
        let event = NewEvent::new(
            topic,
            key.clone(),
            &SoakPayload {
                n: *n,
                poison: *poison,
                ..SoakPayload::default()
            },
        )?;
        outbox::enqueue(&mut tx, event).await?;
    }
    tx.commit().await?;
    Ok(())
}
