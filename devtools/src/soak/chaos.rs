//! The chaos: at random moments (seeded), SIGKILL a relay, the consumer or the callback receiver and start it
//! again, or terminate the relays' or the receivers' Postgres backends.

use std::sync::atomic::Ordering;
use std::time::Duration;

use rand::Rng;
use rand::rngs::StdRng;
use sqlx::PgPool;

use super::counts::Counts;
use super::supervisor::{Kind, Spawner, Worker, kill};

pub(super) fn chaos_pause(rng: &mut StdRng, mean_ms: u64) -> Duration {
    let mean = mean_ms.max(1) as f64;
    Duration::from_millis(rng.random_range(mean * 0.5..=mean * 1.5) as u64)
}

/// One chaos action, chosen at random: SIGKILL a relay, the consumer or the callback receiver (and start it
/// again), or terminate the relays' or the receivers' Postgres backends.
pub(super) async fn chaos(
    rng: &mut StdRng,
    spawner: &Spawner,
    workers: &mut [Worker],
    db: &PgPool,
    counts: &Counts,
) {
    let roll = rng.random_range(0..8u32);
    let kind = match roll {
        0..=2 => Some(Kind::Relay),
        3 | 4 => Some(Kind::Consumer),
        5 => Some(Kind::Callback),
        _ => None,
    };
    match kind {
        Some(kind) => {
            let candidates: Vec<usize> = (0..workers.len())
                .filter(|&i| workers[i].kind == kind)
                .collect();
            let i = candidates[rng.random_range(0..candidates.len())];
            let w = &mut workers[i];
            kill(w).await;
            match kind {
                Kind::Relay => &counts.relay_kills,
                Kind::Consumer => &counts.consumer_kills,
                Kind::Callback => &counts.callback_kills,
            }
            .fetch_add(1, Ordering::Relaxed);
            // The receivers stay down a moment (QStash retries meanwhile); a relay comes back at once, and its
            // killed claims wait for their lease to end.
            if kind != Kind::Relay {
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..300))).await;
            }
            match spawner.spawn(w) {
                Ok(()) => {
                    counts.restarts.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => eprintln!("soak: restarting a worker failed: {e:#}"),
            }
        }
        None => {
            let pattern = if roll == 6 { "soak-relay%" } else { "soak-c%" };
            let killed: Result<i64, _> = sqlx::query_scalar(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE datname = current_database() AND application_name LIKE $1 AND pid <> pg_backend_pid()",
            )
            .bind(pattern)
            .fetch_one(db)
            .await;
            match killed {
                Ok(n) => {
                    counts.backend_kills.fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(e) => eprintln!("soak: pg_terminate_backend failed: {e}"),
            }
        }
    }
}
