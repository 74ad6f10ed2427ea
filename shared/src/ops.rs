//! Operator figures: `outbox status`. The three status queries — (1) backlog depth, oldest pending age and
//! "flapping" rows, (2) dispatched per minute over the last hour, (3) stuck leases — plus blocked ordered
//! keys, ordered heads awaiting delivery evidence, events in flight by age with the unaccounted ones
//! ([`crate::accounting`]), the reconciler's totals, dead-letter counts by topic and source, and the database's
//! health: the xmin horizon and the outbox tables' bloat ([`crate::health`]).
//!
//! Every query runs on an index that covers only live rows (`outbox_pending_created_idx`, the BRIN on
//! `dispatched_at`, the small `outbox_keys` table), and every list has a `LIMIT`: the command stays cheap on a
//! table with millions of rows of history. The dead-letter counts group the whole `dead_letters` table, which
//! `outbox prune --dead-letters-days` keeps small (handled dead letters go; unhandled ones need an operator). Alarm on the oldest pending age, not on depth: 10,000 pending that
//! drain in ten seconds is healthy; 3 pending that are twenty minutes old means no relay is running.

pub mod actions;
pub mod fanout;
pub mod keys;
/// Per-subscriber figures: they live in [`crate::subscribers::status`], below the relay, which prints them as
/// metrics.
pub use crate::subscribers::status as subscribers;
pub mod timeline;
pub mod topics;

use std::time::Duration;

use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use serde::Serialize;
use sqlx::{PgConnection, PgPool};

use crate::db::Statements;
use crate::ids::{OutboxId, PartitionKey, TopicName};

/// How many rows each list shows.
pub(crate) const LIST_LIMIT: i64 = 10;

/// Attempts above which a pending row counts as "flapping": it keeps failing transiently and coming back after
/// backoff, which a healthy backlog does not (glossary: `docs/glossary.md`).
pub const FLAPPING_ATTEMPTS: i32 = 3;

/// Everything `outbox status` shows.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// When the figures were read (database clock).
    pub at: DateTime<Utc>,
    /// (1) The backlog.
    pub backlog: PendingEvents,
    /// (2) Throughput.
    pub throughput: Throughput,
    /// (3) Stuck leases.
    pub stuck_leases: StuckLeases,
    /// Ordered keys blocked by a dead head.
    pub blocked_keys: BlockedKeys,
    /// Ordered heads accepted by QStash, waiting for their delivery callback.
    pub awaiting_evidence: AwaitingEvidence,
    /// Dead letters by topic and source.
    pub dead_letters: Vec<DeadLetterCounts>,
    /// The relays' shared record of a QStash outage (decision record 0012): since when, the last error, the next
    /// probe. `since` is null when QStash is not known to be out.
    pub qstash_outage: crate::relay::outage::OutageState,
    /// Events accepted by QStash with no outcome yet, by age, and how many are past the reconciler's horizon
    /// (`unaccounted`; decision record 0015).
    pub in_flight: crate::accounting::InFlight,
    /// What the reconciler did, summed over every relay invocation.
    pub reconciler: crate::accounting::AccountingTotals,
    /// The xmin horizon and the outbox tables' size and dead tuples ([`crate::health`]).
    pub database: crate::health::DatabaseHealth,
    /// Per subscriber, for the topics with named subscribers ([`subscribers::SubscriberStatus`]; empty when every
    /// topic has only the default one).
    pub subscribers: Vec<subscribers::SubscriberStatus>,
}

/// (1) Events neither dispatched nor dead: how many, how old, and which keep failing.
#[derive(Debug, Clone, Serialize)]
pub struct PendingEvents {
    pub pending: i64,
    /// `max(now() - created_at)` over them, seconds (0 when none).
    pub oldest_pending_age_secs: f64,
    /// Of them, rows with more than [`FLAPPING_ATTEMPTS`] attempts.
    pub flapping: i64,
    /// The most-attempted flapping rows.
    pub flapping_rows: Vec<EventLine>,
}

/// One outbox row in a list.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct EventLine {
    /// Outbox id.
    pub id: OutboxId,
    pub topic: TopicName,
    pub partition_key: PartitionKey,
    /// The subscriber the row is the copy for (`''`: the default one; fan-out, [`crate::subscribers`]).
    pub subscriber: String,
    /// Attempts so far.
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    /// Lease end (stuck leases).
    pub locked_until: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
}

/// (2) Rows dispatched per minute over the last hour.
#[derive(Debug, Clone, Serialize)]
pub struct Throughput {
    /// In the last 60 minutes.
    pub last_hour: i64,
    /// Per minute, oldest first: 60 buckets (the current, partial minute last); minutes without dispatches are 0.
    pub per_minute: Vec<MinuteCount>,
}

/// One minute's dispatches.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct MinuteCount {
    /// The minute's start.
    pub minute: DateTime<Utc>,
    /// Dispatched in it.
    pub dispatched: i64,
}

/// (3) Undispatched rows whose lease ended without a settle (a relay stopped mid-attempt). They are claimed again
/// by the next relay cycle; many of them, or old ones, mean no relay is running.
#[derive(Debug, Clone, Serialize)]
pub struct StuckLeases {
    pub count: i64,
    /// Oldest lease end first.
    pub oldest: Vec<EventLine>,
}

/// Ordered keys blocked by a dead head.
#[derive(Debug, Clone, Serialize)]
pub struct BlockedKeys {
    pub count: i64,
    /// Longest blocked first.
    pub keys: Vec<BlockedKey>,
}

/// One blocked key.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct BlockedKey {
    pub topic: TopicName,
    pub partition_key: PartitionKey,
    /// Whose lane it is (`''`: the default subscriber's; fan-out blocks one subscriber's lane only).
    pub subscriber: String,
    /// Blocked since.
    pub since: DateTime<Utc>,
    /// Why (the dead head's error).
    pub reason: Option<String>,
    /// The dead head (outbox id).
    pub blocking_event: Option<OutboxId>,
    /// Its newest unhandled dead letter (what to redrive).
    pub dead_letter_id: Option<i64>,
    /// Events of the key waiting behind it.
    pub waiting: Option<i64>,
}

/// Ordered heads accepted by QStash without delivery evidence yet.
#[derive(Debug, Clone, Serialize)]
pub struct AwaitingEvidence {
    pub count: i64,
    /// Longest wait, seconds (0 when none).
    pub oldest_secs: f64,
}

/// Dead letters of one topic and source.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, PartialEq)]
pub struct DeadLetterCounts {
    /// Topic (`None` when unknown: an unparseable failure callback).
    pub topic: Option<String>,
    /// `relay` or `qstash`.
    pub source: String,
    /// Not redriven and not resolved: needs an operator.
    pub unresolved: i64,
    pub redriven: i64,
    /// Delivered after all: delivery evidence came after the dead letter.
    pub resolved: i64,
    /// Applied after all: QStash gave up, but the consumer's dedupe row shows the event applied (every response
    /// was lost on the way back). Needs no operator.
    pub applied: i64,
    /// The oldest unresolved one.
    pub oldest_unresolved: Option<DateTime<Utc>>,
}

impl Status {
    /// Unresolved dead letters in total.
    pub fn unresolved_dead_letters(&self) -> i64 {
        self.dead_letters.iter().map(|d| d.unresolved).sum()
    }
}

/// Reads every figure (a handful of short read-only queries), with the default reconciler horizon
/// ([`crate::config::AccountingConfig`]); [`status_with_horizon`] takes the deployment's.
pub async fn status(pool: &PgPool) -> Result<Status, sqlx::Error> {
    status_with_horizon(pool, crate::config::AccountingConfig::default().horizon).await
}

/// [`status`], counting in-flight events older than `horizon` (`RELAY_RECONCILE_AFTER_SECS`) as unaccounted.
pub async fn status_with_horizon(pool: &PgPool, horizon: Duration) -> Result<Status, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let (at, backlog) = backlog(&mut conn).await?;
    let throughput = throughput(&mut conn, at).await?;
    let stuck_leases = stuck_leases(&mut conn).await?;
    let (blocked_keys, awaiting_evidence) = ordered_keys(&mut conn).await?;
    let dead_letters = dead_letter_counts(&mut conn).await?;
    let qstash_outage = sqlx::query_as(crate::schema::q(crate::relay::outage::SELECT))
        .fetch_one(&mut *conn)
        .await?;
    let in_flight = crate::accounting::in_flight(&mut conn, horizon, Statements::Prepared).await?;
    let reconciler = crate::accounting::totals(&mut conn, Statements::Prepared).await?;
    let subscribers = subscribers::read(&mut conn, Statements::Prepared).await?;
    drop(conn);
    let database =
        crate::health::read(&crate::db::Db::new(pool.clone(), Statements::Prepared)).await?;

    Ok(Status {
        subscribers,
        database,
        in_flight,
        reconciler,
        qstash_outage,
        at,
        backlog,
        throughput,
        stuck_leases,
        blocked_keys,
        awaiting_evidence,
        dead_letters,
    })
}

/// (1) Backlog depth, oldest pending age and flapping rows, on the partial index of pending rows; with the
/// database clock's now.
async fn backlog(conn: &mut PgConnection) -> Result<(DateTime<Utc>, PendingEvents), sqlx::Error> {
    let (at, pending, oldest, flapping): (DateTime<Utc>, i64, f64, i64) = sqlx::query_as(
        crate::schema::q("SELECT now(), count(*), coalesce(extract(epoch FROM max(now() - created_at))::float8, 0), \
                count(*) FILTER (WHERE attempts > $1) \
         FROM {schema}.outbox WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL"),
    )
    .bind(FLAPPING_ATTEMPTS)
    .fetch_one(&mut *conn)
    .await?;
    let flapping_rows: Vec<EventLine> = sqlx::query_as(
        crate::schema::q("SELECT id, topic, partition_key, subscriber, attempts, created_at, locked_until, last_error FROM {schema}.outbox \
         WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL AND attempts > $1 \
         ORDER BY attempts DESC, id LIMIT $2"),
    )
    .bind(FLAPPING_ATTEMPTS)
    .bind(LIST_LIMIT)
    .fetch_all(&mut *conn)
    .await?;
    let backlog = PendingEvents {
        pending,
        oldest_pending_age_secs: oldest.max(0.0),
        flapping,
        flapping_rows,
    };
    Ok((at, backlog))
}

/// (2) Dispatched per minute over the hour up to `at` (BRIN on dispatched_at).
async fn throughput(conn: &mut PgConnection, at: DateTime<Utc>) -> Result<Throughput, sqlx::Error> {
    let start = (at - TimeDelta::minutes(59))
        .duration_trunc(TimeDelta::minutes(1))
        .unwrap_or(at);
    let minutes: Vec<(DateTime<Utc>, i64)> = sqlx::query_as(crate::schema::q(
        "SELECT date_trunc('minute', dispatched_at) AS m, count(*) FROM {schema}.outbox \
         WHERE dispatched_at >= $1 GROUP BY 1 ORDER BY 1",
    ))
    .bind(start)
    .fetch_all(&mut *conn)
    .await?;
    let per_minute: Vec<MinuteCount> = (0..60)
        .map(|i| {
            let minute = start + TimeDelta::minutes(i);
            let dispatched = minutes
                .iter()
                .find(|(m, _)| *m == minute)
                .map_or(0, |(_, n)| *n);
            MinuteCount { minute, dispatched }
        })
        .collect();
    let last_hour = per_minute.iter().map(|m| m.dispatched).sum();
    Ok(Throughput {
        last_hour,
        per_minute,
    })
}

/// (3) Stuck leases, oldest first.
async fn stuck_leases(conn: &mut PgConnection) -> Result<StuckLeases, sqlx::Error> {
    let count: i64 = sqlx::query_scalar(crate::schema::q(
        "SELECT count(*) FROM {schema}.outbox \
         WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL AND locked_until < now()",
    ))
    .fetch_one(&mut *conn)
    .await?;
    let oldest: Vec<EventLine> = sqlx::query_as(
        crate::schema::q("SELECT id, topic, partition_key, subscriber, attempts, created_at, locked_until, last_error FROM {schema}.outbox \
         WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL AND locked_until < now() \
         ORDER BY locked_until, id LIMIT $1"),
    )
    .bind(LIST_LIMIT)
    .fetch_all(&mut *conn)
    .await?;
    Ok(StuckLeases { count, oldest })
}

/// Ordered keys (one small row per active key): the blocked ones, and the heads awaiting delivery evidence.
async fn ordered_keys(
    conn: &mut PgConnection,
) -> Result<(BlockedKeys, AwaitingEvidence), sqlx::Error> {
    let (blocked_count, awaiting, awaiting_oldest): (i64, i64, f64) = sqlx::query_as(
        crate::schema::q("SELECT count(*) FILTER (WHERE blocked_at IS NOT NULL), count(*) FILTER (WHERE inflight_id IS NOT NULL), \
                coalesce(extract(epoch FROM now() - min(inflight_since))::float8, 0) \
         FROM {schema}.outbox_keys"),
    )
    .fetch_one(&mut *conn)
    .await?;
    let blocked: Vec<BlockedKey> = sqlx::query_as(
        crate::schema::q("SELECT k.topic, k.partition_key, k.subscriber, k.blocked_at AS since, k.blocked_reason AS reason, \
                k.blocked_id AS blocking_event, \
                (SELECT max(d.id) FROM {schema}.dead_letters d WHERE d.outbox_id = k.blocked_id \
                   AND d.redriven_at IS NULL AND d.resolved_at IS NULL) AS dead_letter_id, \
                (SELECT s.last_seq - k.done_seq - 1 FROM {schema}.outbox_sequences s \
                  WHERE s.topic = k.topic AND s.partition_key = k.partition_key) AS waiting \
         FROM {schema}.outbox_keys k WHERE k.blocked_at IS NOT NULL ORDER BY k.blocked_at, k.topic, k.partition_key, k.subscriber LIMIT $1"),
    )
    .bind(LIST_LIMIT)
    .fetch_all(&mut *conn)
    .await?;
    let blocked_keys = BlockedKeys {
        count: blocked_count,
        keys: blocked,
    };
    let awaiting_evidence = AwaitingEvidence {
        count: awaiting,
        oldest_secs: awaiting_oldest.max(0.0),
    };
    Ok((blocked_keys, awaiting_evidence))
}

/// Dead letters by topic and source, the topics with the most unresolved first.
async fn dead_letter_counts(conn: &mut PgConnection) -> Result<Vec<DeadLetterCounts>, sqlx::Error> {
    sqlx::query_as(
        crate::schema::q("SELECT topic, source, \
                count(*) FILTER (WHERE redriven_at IS NULL AND resolved_at IS NULL) AS unresolved, \
                count(*) FILTER (WHERE redriven_at IS NOT NULL) AS redriven, \
                count(*) FILTER (WHERE redriven_at IS NULL AND resolved_at IS NOT NULL \
                                   AND resolution IS DISTINCT FROM 'applied') AS resolved, \
                count(*) FILTER (WHERE redriven_at IS NULL AND resolution = 'applied') AS applied, \
                min(created_at) FILTER (WHERE redriven_at IS NULL AND resolved_at IS NULL) AS oldest_unresolved \
         FROM {schema}.dead_letters GROUP BY topic, source \
         ORDER BY count(*) FILTER (WHERE redriven_at IS NULL AND resolved_at IS NULL) DESC, topic NULLS LAST, source"),
    )
    .fetch_all(&mut *conn)
    .await
}
