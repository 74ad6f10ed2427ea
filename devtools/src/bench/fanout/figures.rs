//! What the parts of `bench fanout` measure with: the median of a figure over rounds, the live subscriber's
//! commit → applied latency, the database's clock.

use outbox_testkit::median;
use serde_json::{Value, json};
use sqlx::PgPool;

/// The median over `runs` of the number at `path` (keys into each run's JSON); NaN when no run has one.
pub(super) fn median_at(runs: &[Value], path: &[&str]) -> f64 {
    let values: Vec<f64> = runs
        .iter()
        .filter_map(|r| path.iter().fold(r, |v, k| &v[*k]).as_f64())
        .collect();
    median(&values)
}

/// The live subscriber's latency over the live topic's events applied by `consumer` between `from` and `to`
/// (database clock).
pub(super) struct LiveLatency {
    pub(super) events: i64,
    /// Commit → applied, ms.
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    /// Commit → accepted by QStash (the part spent in the outbox and the relay), ms.
    pub(super) relay_p50_ms: f64,
    pub(super) relay_p99_ms: f64,
}

impl LiveLatency {
    pub(super) fn json(&self) -> Value {
        json!({
            "events": self.events,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "relay_p50_ms": self.relay_p50_ms,
            "relay_p99_ms": self.relay_p99_ms,
        })
    }
}

/// Commit → applied (and commit → accepted by QStash) of `topic`'s events written between `from` and `to`
/// (database clock) and applied by the default subscriber `consumer`.
pub(super) async fn latency(
    pool: &PgPool,
    topic: &str,
    consumer: &str,
    from: chrono::DateTime<chrono::Utc>,
    to: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<LiveLatency> {
    let r: (i64, Option<f64>, Option<f64>, Option<f64>, Option<f64>) = sqlx::query_as(
        "WITH l AS (SELECT extract(epoch FROM p.processed_at - o.created_at) * 1000 AS applied, \
                           extract(epoch FROM o.dispatched_at - o.created_at) * 1000 AS relayed \
                    FROM processed_messages p JOIN outbox o ON o.id = p.message_id::bigint \
                    WHERE p.consumer = $4 AND o.topic = $1 AND o.created_at >= $2 AND o.created_at < $3) \
         SELECT count(*), \
                percentile_cont(0.5) WITHIN GROUP (ORDER BY applied)::float8, \
                percentile_cont(0.99) WITHIN GROUP (ORDER BY applied)::float8, \
                percentile_cont(0.5) WITHIN GROUP (ORDER BY relayed)::float8, \
                percentile_cont(0.99) WITHIN GROUP (ORDER BY relayed)::float8 \
         FROM l",
    )
    .bind(topic)
    .bind(from)
    .bind(to)
    .bind(consumer)
    .fetch_one(pool)
    .await?;
    let nan = |v: Option<f64>| v.unwrap_or(f64::NAN);
    Ok(LiveLatency {
        events: r.0,
        p50_ms: nan(r.1),
        p99_ms: nan(r.2),
        relay_p50_ms: nan(r.3),
        relay_p99_ms: nan(r.4),
    })
}

/// The database's clock now (the producers' `created_at` and the consumers' `processed_at` are on it).
pub(super) async fn clock(pool: &PgPool) -> Result<chrono::DateTime<chrono::Utc>, sqlx::Error> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await
}
