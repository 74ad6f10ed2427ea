//! Fairness between tenants: one tenant's flood never delays another's events (decision record 0076).
//!
//! The producer may give an event a **fairness key** ([`crate::NewEvent::fairness_key`]: a tenant, an account);
//! events without one share the "no key" group (`''`). Three mechanisms use it:
//!
//! | what | how | why |
//! |---|---|---|
//! | **Fair claim** ([`FAIR_CLAIM_SQL`]) | each unordered claim walks up to [`KEYS_PER_CLAIM`] keys with waiting events from a rotating cursor ([`Cursor`]), gives each the same share of the claim (its oldest due rows), then fills what is left with the oldest due rows of anyone | a key with 100,000 waiting events and one with 10 each get their share, and no claim capacity is left unused while any key has due events |
//! | **Pause** ([`pause`], [`resume`]) | a paused key's unordered events wait at `available_at = 'infinity'` (new ones too: the producer checks), its ordered heads are not claimed; resume makes them due again, oldest first | an operator holds one noisy tenant in the outbox without touching anyone else; order within an ordered key is kept because its head simply waits |
//! | **Per-key limits at QStash** ([`crate::config::TenantLimits`]) | a topic may give each fairness key its own QStash flow-control key with a rate, period and parallelism | QStash then delivers one tenant's messages no faster than its contract, whatever the others do |
//!
//! The claim stays index scans at any number of waiting rows and tenants: one probe of `outbox_fair_claim_idx`
//! per key walked (a loose index scan), then one range of the same index per key; the fill is the unfair claim's
//! own scan of `outbox_claim_idx`, which stops at the first due rows. Paused rows sit at `'infinity'`, past every
//! due row, so no scan walks through a paused backlog.
//!
//! Ordered topics keep their order: the ordered claim is per partition key already (one run of a key per claim),
//! and a paused tenant's ordered heads wait where they are.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;

use crate::headers::validate_fairness_key;

/// At most this many fairness keys are walked per unordered claim (the rest are reached by the rotating cursor
/// in later claims, and by the fill at any time).
pub(crate) const KEYS_PER_CLAIM: u32 = 100;

/// The fair unordered claim. `$1` = lease seconds, `$2` = the cursor (the walk starts at the first key `>=` it; `''`
/// is the start). `{limit}` (rows) and `{keys}` (keys walked) are spliced in once, as in the unfair claim. Each
/// row also returns the walk's last key and how many keys it walked, from which the relay's [`Cursor`] moves on.
pub(crate) const FAIR_CLAIM_SQL: &str = concat!(
    r#"
WITH RECURSIVE tok AS (SELECT nextval('{schema}.outbox_lease_token_seq') AS t),
walk (k, n) AS (
    (SELECT fairness_key, 1 FROM {schema}.outbox
     WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL AND seq IS NULL AND fairness_key >= $2
     ORDER BY fairness_key LIMIT 1)
    UNION ALL
    SELECT (SELECT o.fairness_key FROM {schema}.outbox o
            WHERE o.dispatched_at IS NULL AND o.dead_lettered_at IS NULL AND o.seq IS NULL AND o.fairness_key > w.k
            ORDER BY o.fairness_key LIMIT 1),
           w.n + 1
    FROM walk w WHERE w.k IS NOT NULL AND w.n < {keys}
),
walked AS (SELECT count(k) AS n, max(k) AS last FROM walk),
visit AS (
    SELECT w.k FROM walk w
    WHERE w.k IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM {schema}.outbox_paused_keys p WHERE p.fairness_key = w.k)
),
-- Each visited key's share: the claim divided evenly (at least one row); what keys leave unused goes to the fill.
share AS (SELECT greatest({limit} / greatest(count(*), 1), 1)::int AS q FROM visit),
fair AS (
    SELECT c.id
    FROM visit v
    CROSS JOIN LATERAL (
        SELECT o.id FROM {schema}.outbox o
        WHERE o.fairness_key = v.k AND o.dispatched_at IS NULL AND o.dead_lettered_at IS NULL AND o.seq IS NULL
          AND o.available_at <= now()
        ORDER BY o.available_at, o.id
        LIMIT (SELECT q FROM share)
        FOR UPDATE SKIP LOCKED) c
    LIMIT {limit}
),
fill AS (
    SELECT o.id FROM {schema}.outbox o
    WHERE o.dispatched_at IS NULL AND o.dead_lettered_at IS NULL AND o.seq IS NULL AND o.available_at <= now()
      AND o.id <> ALL (ARRAY(SELECT id FROM fair))
      AND (o.fairness_key = ''
           OR NOT EXISTS (SELECT 1 FROM {schema}.outbox_paused_keys p WHERE p.fairness_key = o.fairness_key))
    ORDER BY o.available_at, o.id
    LIMIT {limit}
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.outbox o
SET attempts = o.attempts + 1,
    first_claimed_at = coalesce(o.first_claimed_at, now()),
    lease_token = (SELECT t FROM tok),
    locked_until = now() + make_interval(secs => $1),
    available_at = now() + make_interval(secs => $1)
-- A CTE is read only as far as its reader asks, so the fill locks only the rows the fair part left room for. Its
-- own LIMIT is the constant: with an expression there, the planner guesses a tenth of the table and its cost estimate
-- switches on JIT compilation (seconds per claim).
WHERE o.id = ANY (ARRAY(SELECT id FROM fair
                        UNION ALL (SELECT id FROM fill LIMIT greatest({limit} - (SELECT count(*) FROM fair), 0))))
"#,
    crate::ordering::claimed_columns!(),
    ", (SELECT n FROM walked) AS walked, (SELECT last FROM walked) AS walked_last\n"
);

/// Where the next fair claim starts its walk over the fairness keys, shared by a relay's concurrent cycles, and
/// how many keys a walk takes. A walk that reached that many keys leaves the cursor just past its last key; a
/// shorter one (it reached the end) sends the next walk back to the start.
#[derive(Debug)]
pub(crate) struct Cursor {
    next: std::sync::Mutex<String>,
    keys: u32,
}

impl Cursor {
    /// A cursor at the start, for walks of `keys` keys.
    pub(crate) fn new(keys: u32) -> Self {
        Cursor {
            next: std::sync::Mutex::default(),
            keys,
        }
    }

    /// Keys per walk (the claim's `{keys}`).
    pub(crate) fn keys(&self) -> u32 {
        self.keys
    }

    /// Where the next walk starts.
    pub(crate) fn start(&self) -> String {
        self.next
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Moves on after a walk of `walked` keys whose last key was `last`. An empty claim (nothing was due
    /// anywhere) sends it back to the start too.
    pub(crate) fn advance(&self, walked: i64, last: Option<&str>) {
        let next = match last {
            // The smallest string after `last` in byte order: keys hold no control characters.
            Some(last) if walked >= i64::from(self.keys) => format!("{last}\u{1}"),
            _ => String::new(),
        };
        *self
            .next
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = next;
    }
}

/// What [`pause`] or [`resume`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PauseOutcome {
    /// The key was not paused before [`pause`] / was paused before [`resume`] (`false`: nothing to do).
    pub changed: bool,
    /// Unordered events moved to wait (pause) or made due again (resume).
    pub events: u64,
}

/// Why a pause or resume was refused.
#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    /// The key cannot be a fairness key (the producer would refuse it too).
    #[error(transparent)]
    InvalidKey(#[from] crate::headers::InvalidEvent),
    /// The database failed; nothing was changed.
    #[error("database error while pausing or resuming a fairness key")]
    Database(#[from] sqlx::Error),
}

/// Pauses a fairness key: its waiting unordered events and every later one wait in the outbox, its ordered heads
/// are not claimed, until [`resume`]. Events already published stay with QStash (pause their flow-control key
/// there, when the topic has per-key limits, see [`crate::config::TenantLimits`]). One transaction.
pub async fn pause(
    conn: &mut PgConnection,
    key: &str,
    by: &str,
    reason: Option<&str>,
) -> Result<PauseOutcome, PauseError> {
    validate_fairness_key(key)?;
    let mut tx = sqlx::Connection::begin(conn).await?;
    let inserted = sqlx::query(crate::schema::q(
        "INSERT INTO {schema}.outbox_paused_keys (fairness_key, paused_by, reason) VALUES ($1, $2, $3) \
         ON CONFLICT (fairness_key) DO NOTHING",
    ))
    .bind(key)
    .bind(by)
    .bind(reason)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    // Rows leased right now are left alone: their publish settles them as usual.
    let events = sqlx::query(crate::schema::q(
        "UPDATE {schema}.outbox SET available_at = 'infinity' \
         WHERE fairness_key = $1 AND dispatched_at IS NULL AND dead_lettered_at IS NULL AND seq IS NULL \
           AND available_at <> 'infinity' \
           AND (locked_until IS NULL OR locked_until <= now())",
    ))
    .bind(key)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    tracing::info!(fairness_key = key, by, events, "fairness key paused");
    Ok(PauseOutcome {
        changed: inserted == 1,
        events,
    })
}

/// Resumes a paused fairness key: its waiting events are due again, in the order they were written.
pub async fn resume(conn: &mut PgConnection, key: &str) -> Result<PauseOutcome, PauseError> {
    validate_fairness_key(key)?;
    let mut tx = sqlx::Connection::begin(conn).await?;
    let deleted = sqlx::query(crate::schema::q(
        "DELETE FROM {schema}.outbox_paused_keys WHERE fairness_key = $1",
    ))
    .bind(key)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    let events = sqlx::query(crate::schema::q(
        "UPDATE {schema}.outbox SET available_at = now() \
         WHERE fairness_key = $1 AND dispatched_at IS NULL AND dead_lettered_at IS NULL AND seq IS NULL \
           AND available_at = 'infinity'",
    ))
    .bind(key)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    tracing::info!(fairness_key = key, events, "fairness key resumed");
    Ok(PauseOutcome {
        changed: deleted == 1,
        events,
    })
}

/// One fairness key's waiting events and its pause ([`backlog`]).
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct KeyBacklog {
    /// The key (`''`: events without one).
    pub fairness_key: String,
    /// Events neither dispatched nor dead-lettered (every subscriber's copy counts).
    pub pending: i64,
    /// Seconds since the oldest of them was written: the key's lag (0 with nothing pending).
    pub oldest_age_secs: f64,
    /// Since when the key is paused ([`pause`]); `None`: it is not.
    pub paused_at: Option<DateTime<Utc>>,
    /// Who paused it (a console token's name, `cli`, …).
    pub paused_by: Option<String>,
    /// Why, as they said.
    pub paused_reason: Option<String>,
}

/// The `limit` fairness keys with the oldest waiting events, of one topic or of all, then every paused key: where
/// a noisy tenant shows (its backlog), who waits because of it (their lag), and who is held. Groups the pending rows
/// only: cheap while the relay keeps up, one pass over the backlog while it does not.
pub async fn backlog(
    conn: &mut PgConnection,
    topic: Option<&str>,
    limit: i64,
) -> Result<Vec<KeyBacklog>, sqlx::Error> {
    sqlx::query_as(crate::schema::q(
        "WITH waiting AS ( \
           SELECT o.fairness_key, count(*) AS pending, min(o.created_at) AS oldest \
           FROM {schema}.outbox o \
           WHERE o.dispatched_at IS NULL AND o.dead_lettered_at IS NULL AND ($1::text IS NULL OR o.topic = $1) \
           GROUP BY o.fairness_key \
           ORDER BY min(o.created_at), o.fairness_key \
           LIMIT $2) \
         SELECT coalesce(w.fairness_key, p.fairness_key) AS fairness_key, coalesce(w.pending, 0) AS pending, \
                coalesce(extract(epoch FROM now() - w.oldest)::float8, 0) AS oldest_age_secs, \
                p.paused_at, p.paused_by, p.reason AS paused_reason \
         FROM waiting w FULL JOIN {schema}.outbox_paused_keys p ON p.fairness_key = w.fairness_key \
         ORDER BY w.oldest NULLS LAST, p.paused_at, 1",
    ))
    .bind(topic)
    .bind(limit)
    .fetch_all(conn)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_walk_moves_the_cursor_past_its_last_key_and_a_short_one_starts_over() {
        let c = Cursor::new(100);
        assert_eq!(c.start(), "");
        c.advance(100, Some("tenant-42"));
        assert_eq!(c.start(), "tenant-42\u{1}");
        assert!(c.start().as_str() > "tenant-42" && c.start().as_str() < "tenant-42.");
        c.advance(7, Some("tenant-99"));
        assert_eq!(c.start(), "");
        c.advance(0, None);
        assert_eq!(c.start(), "");
    }
}
