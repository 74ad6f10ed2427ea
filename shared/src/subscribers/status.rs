//! Per-subscriber figures of `outbox status` and of the relay's per-subscriber metrics (fan-out): for each live
//! subscriber of a topic that has named subscribers, its backlog, what is in flight, its blocked keys and
//! unhandled dead letters. A topic with only the default subscriber is not listed: the overall figures are its
//! figures. Here, below the relay in the crate's layout, because the relay prints them (`ops` re-exports them).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;

use crate::db::{Db, Statements};

/// One subscriber of one topic.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct SubscriberStatus {
    pub topic: String,
    /// `''` for the default subscriber (the relay's `CONSUMER_URL`).
    pub subscriber: String,
    /// Its copies neither dispatched nor dead.
    pub pending: i64,
    /// Age of the oldest of them, seconds (0 when none).
    pub oldest_pending_age_secs: f64,
    /// Its copies accepted by QStash with no outcome yet.
    pub in_flight: i64,
    /// Age of the oldest of them since QStash accepted it, seconds (0 when none).
    pub oldest_in_flight_age_secs: f64,
    /// Its ordered lanes blocked by a dead head.
    pub blocked_keys: i64,
    /// Its dead letters neither redriven nor resolved.
    pub dead_letters: i64,
    /// Its history is still being copied (`outbox subscribers replay`); until then its ordered keys wait.
    pub replaying: bool,
    /// When it was added (`None` for the default subscriber).
    pub added_at: Option<DateTime<Utc>>,
}

/// Reads the figures of every live subscriber of the topics that have named subscribers, by topic and name, with
/// statements sent as `statements` says.
pub async fn read(
    conn: &mut PgConnection,
    statements: Statements,
) -> Result<Vec<SubscriberStatus>, sqlx::Error> {
    statements.query_as(crate::schema::q(
        r#"
WITH subs AS (
    SELECT topic, name, added_at, (replay_from IS NOT NULL AND replay_done_at IS NULL) AS replaying
    FROM {schema}.outbox_subscribers WHERE removed_at IS NULL
    UNION ALL
    SELECT DISTINCT t.topic, '', NULL::timestamptz, false FROM {schema}.outbox_subscribers t
    WHERE NOT EXISTS (SELECT 1 FROM {schema}.outbox_subscribers d WHERE d.topic = t.topic AND d.name = '')
)
SELECT s.topic, s.name AS subscriber, s.replaying, s.added_at,
       p.pending, coalesce(extract(epoch FROM now() - p.oldest)::float8, 0) AS oldest_pending_age_secs,
       f.in_flight, coalesce(extract(epoch FROM now() - f.oldest)::float8, 0) AS oldest_in_flight_age_secs,
       (SELECT count(*) FROM {schema}.outbox_keys k
         WHERE k.topic = s.topic AND k.subscriber = s.name AND k.blocked_at IS NOT NULL) AS blocked_keys,
       (SELECT count(*) FROM {schema}.dead_letters d
         WHERE d.topic = s.topic AND d.subscriber = s.name AND d.redriven_at IS NULL AND d.resolved_at IS NULL)
           AS dead_letters
FROM subs s
CROSS JOIN LATERAL (
    SELECT count(*) AS pending, min(o.created_at) AS oldest FROM {schema}.outbox o
    WHERE o.dispatched_at IS NULL AND o.dead_lettered_at IS NULL AND o.topic = s.topic AND o.subscriber = s.name
) p
CROSS JOIN LATERAL (
    SELECT count(*) AS in_flight, min(o.dispatched_at) AS oldest FROM {schema}.outbox o
    WHERE o.dispatched_at IS NOT NULL AND o.delivered_at IS NULL AND o.dead_lettered_at IS NULL
      AND o.topic = s.topic AND o.subscriber = s.name
) f
ORDER BY s.topic, s.name
"#,
    ))
    .fetch_all(&mut *conn)
    .await
}

/// [`read`] on a connection of `db`, in a short transaction whose statements the database cancels after `timeout`
/// (`statement_timeout`, local to the transaction): what the relay reads at the end of every invocation, where a
/// large backlog must not make monitoring eat the time left before the Lambda deadline. A timeout is an error
/// like any other (the caller logs it and goes on without the figures).
pub async fn read_within(db: &Db, timeout: Duration) -> Result<Vec<SubscriberStatus>, sqlx::Error> {
    let statements = db.statements();
    let mut tx = db.pool().begin().await?;
    statements
        .query("SELECT set_config('statement_timeout', $1, true)")
        .bind(format!("{}ms", timeout.as_millis().max(1)))
        .execute(&mut *tx)
        .await?;
    let rows = read(&mut tx, statements).await?;
    tx.commit().await?;
    Ok(rows)
}
