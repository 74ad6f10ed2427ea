//! A QStash outage, shared by every relay through the single row of `outbox_relay_outage` (decision record 0012).
//!
//! When every publish request of a cycle failed at request level ([`crate::qstash::request_level_failure`]:
//! QStash unreachable, 5xx, 401/403/404, an account-level 429), the relay gives its claim back without spending
//! an attempt, records the outage here and stops publishing. Until `next_probe_at` every relay skips publishing
//! (waiting for the probe within its invocation when the probe comes before its deadline, `drain.rs`); then
//! exactly one relay takes the probe (a conditional UPDATE that moves `next_probe_at` one
//! lease ahead, so a relay that dies mid-probe only delays the next one) and publishes a claim of one event per
//! kind of topic. Success clears the row; failure advances the probe backoff (capped exponential, equal jitter so a
//! probe never comes at once again).

use std::time::Duration;

use chrono::{DateTime, Utc};
use rand::Rng;
use serde::Serialize;
use sqlx::PgConnection;

use crate::db::{Db, Statements};

/// The outage row as read.
#[derive(Debug, Clone, Default, PartialEq, Serialize, sqlx::FromRow)]
pub struct OutageState {
    /// When the outage began; `None`: no outage.
    pub since: Option<DateTime<Utc>>,
    /// The last request-level error.
    pub last_error: Option<String>,
    /// Consecutive failed cycles and probes (sets the probe backoff).
    pub failures: i32,
    /// When the next probe may be taken.
    pub next_probe_at: Option<DateTime<Utc>>,
    /// The database's clock when the row was read (what `next_probe_at` is compared with).
    pub now: DateTime<Utc>,
}

impl OutageState {
    /// An outage is recorded.
    pub fn active(&self) -> bool {
        self.since.is_some()
    }

    /// An outage is recorded and its next probe is not due yet: publish nothing.
    pub fn waiting(&self) -> bool {
        self.active() && self.next_probe_at.is_some_and(|t| t > self.now)
    }

    /// How long the outage has lasted (zero without one).
    pub fn duration(&self) -> Duration {
        self.since
            .and_then(|s| (self.now - s).to_std().ok())
            .unwrap_or(Duration::ZERO)
    }

    /// How long until the next probe (zero when due or without an outage).
    pub fn until_probe(&self) -> Duration {
        self.next_probe_at
            .and_then(|t| (t - self.now).to_std().ok())
            .unwrap_or(Duration::ZERO)
    }
}

/// The probe backoff: after the n-th consecutive failure the next probe comes after a delay drawn from
/// `[w/2, w]`, `w = min(cap, base · 2^(n-1))`. Equal rather than full jitter: a probe right after a failure
/// would only fail again, while the spread still keeps a fleet of relays from probing in step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeBackoff {
    /// The first window (`RELAY_OUTAGE_PROBE_BASE_MS`).
    pub base: Duration,
    /// The largest window (`RELAY_OUTAGE_PROBE_CAP_SECS`).
    pub cap: Duration,
}

impl ProbeBackoff {
    /// The window after `failures` consecutive failures (at least one).
    pub fn window(&self, failures: u32) -> Duration {
        let n = failures.max(1) - 1;
        let factor = 2f64.powi(n.min(40) as i32);
        Duration::from_secs_f64((self.base.as_secs_f64() * factor).min(self.cap.as_secs_f64()))
    }

    /// A delay drawn from `[window/2, window]`.
    pub fn delay(&self, failures: u32, rng: &mut impl Rng) -> Duration {
        let w = self.window(failures).as_secs_f64();
        Duration::from_secs_f64(rng.random_range(w / 2.0..=w.max(f64::MIN_POSITIVE)))
    }
}

/// Reads the row (and the database clock); shared with `outbox status` (`crate::ops`).
pub(crate) const SELECT: &str = "SELECT since, last_error, failures, next_probe_at, now() AS now FROM {schema}.outbox_relay_outage";
const SELECT_FOR_UPDATE: &str = "SELECT since, last_error, failures, next_probe_at, now() AS now FROM {schema}.outbox_relay_outage FOR UPDATE";

/// Reads the outage row.
pub async fn load(db: &Db) -> Result<OutageState, sqlx::Error> {
    db.run(async |c| db.query_as(crate::schema::q(SELECT)).fetch_one(c).await)
        .await
}

/// Records a failed cycle or probe. The backoff advances (and `failures` grows) when the outage is new, when
/// `probe` is set (the caller held the probe), or when the next probe was already due; otherwise several relays
/// (or workers) failing in the same window only refresh `last_error`, so one bad minute does not count as many.
pub async fn record_failure(
    conn: &mut PgConnection,
    error: &str,
    probe: bool,
    backoff: ProbeBackoff,
    statements: Statements,
) -> Result<OutageState, sqlx::Error> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let cur: OutageState = statements
        .query_as(crate::schema::q(SELECT_FOR_UPDATE))
        .fetch_one(&mut *tx)
        .await?;
    let advance = probe || !cur.active() || !cur.waiting();
    let failures = if advance {
        cur.failures.saturating_add(1)
    } else {
        cur.failures
    };
    let delay = backoff.delay(failures.max(1) as u32, &mut rand::rng());
    let state: OutageState = statements
        .query_as(crate::schema::q(
            "UPDATE {schema}.outbox_relay_outage SET since = coalesce(since, now()), last_error = left($1, 2000), \
             failures = $2, \
             next_probe_at = CASE WHEN $3 THEN now() + make_interval(secs => $4) ELSE next_probe_at END, \
             updated_at = now() \
             RETURNING since, last_error, failures, next_probe_at, now() AS now",
        ))
        .bind(error)
        .bind(failures)
        .bind(advance)
        .bind(delay.as_secs_f64())
        .fetch_one(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(state)
}

/// Takes the due probe: moves `next_probe_at` one `lease` ahead if it is due. Exactly one of several concurrent
/// callers gets `true` (the others find the moved `next_probe_at` once the row lock is released).
pub async fn take_probe(db: &Db, lease: Duration) -> Result<bool, sqlx::Error> {
    let n = db
        .execute(
            db.query(crate::schema::q(
                "UPDATE {schema}.outbox_relay_outage SET next_probe_at = now() + make_interval(secs => $1), \
                 updated_at = now() \
                 WHERE since IS NOT NULL AND (next_probe_at IS NULL OR next_probe_at <= now())",
            ))
            .bind(lease.as_secs_f64()),
        )
        .await?;
    Ok(n == 1)
}

/// Ends the outage (QStash accepted a request). Returns how long it lasted, if there was one.
pub async fn clear(db: &Db) -> Result<Option<Duration>, sqlx::Error> {
    let secs: Option<f64> = db
        .run(async |c| {
            db.query_scalar(crate::schema::q(
                "UPDATE {schema}.outbox_relay_outage o SET since = NULL, last_error = NULL, failures = 0, \
                 next_probe_at = NULL, updated_at = now() \
                 FROM (SELECT since FROM {schema}.outbox_relay_outage FOR UPDATE) old \
                 WHERE o.since IS NOT NULL \
                 RETURNING extract(epoch FROM now() - old.since)::float8",
            ))
            .fetch_optional(c)
            .await
        })
        .await?;
    Ok(secs.map(|s| Duration::from_secs_f64(s.max(0.0))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    #[test]
    fn probe_backoff_doubles_to_the_cap_with_equal_jitter() {
        let b = ProbeBackoff {
            base: Duration::from_secs(2),
            cap: Duration::from_secs(300),
        };
        assert_eq!(b.window(0), Duration::from_secs(2));
        assert_eq!(b.window(1), Duration::from_secs(2));
        assert_eq!(b.window(2), Duration::from_secs(4));
        assert_eq!(b.window(8), Duration::from_secs(256));
        assert_eq!(b.window(9), Duration::from_secs(300));
        assert_eq!(b.window(u32::MAX), Duration::from_secs(300));
        let mut rng = StdRng::seed_from_u64(3);
        for n in 1..12 {
            let w = b.window(n);
            for _ in 0..500 {
                let d = b.delay(n, &mut rng);
                assert!(
                    d >= w / 2 && d <= w,
                    "failure {n}: {d:?} outside [{:?}, {w:?}]",
                    w / 2
                );
            }
        }
    }
}
