//! What `outbox-dev dev` shows and ends with: the pipeline's figures at one moment, each subscriber's, the
//! summary, and how the figures are read from the database.

use std::path::PathBuf;

use outbox::db::{Db, Statements};
use outbox::internals::housekeeping;
use serde::Serialize;
use sqlx::PgPool;

use super::dead_letters::CauseCount;

/// One subscriber's figures (`--subscribers` above 1).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SubscriberCounts {
    /// `default` or the subscriber's name.
    pub subscriber: String,
    /// Copies written for it.
    pub enqueued: i64,
    /// Applied by its consumer (its dedupe rows).
    pub applied: i64,
    /// Its dead letters.
    pub dead_lettered: i64,
}

/// Each subscriber's figures: `names` are the named ones; the default one's dedupe rows are `consumer_name`'s.
pub async fn subscriber_counts(
    pool: &PgPool,
    consumer_name: &str,
    names: &[String],
) -> anyhow::Result<Vec<SubscriberCounts>> {
    let db = Db::new(pool.clone(), Statements::Unnamed);
    let mut all = vec![String::new()];
    all.extend(names.iter().cloned());
    let rows: Vec<(String, i64, i64, i64)> = db
        .run(async |c| {
            db.query_as(outbox::schema::q(
                "SELECT s.name, \
                    (SELECT count(*) FROM {schema}.outbox o WHERE o.subscriber = s.name), \
                    (SELECT count(*) FROM {schema}.processed_messages p \
                      WHERE p.consumer = CASE WHEN s.name = '' THEN $2 ELSE s.name END), \
                    (SELECT count(*) FROM {schema}.dead_letters d WHERE d.subscriber = s.name) \
                 FROM unnest($1::text[]) WITH ORDINALITY AS s(name, ord) ORDER BY s.ord",
            ))
            .bind(&all)
            .bind(consumer_name)
            .fetch_all(c)
            .await
        })
        .await?;
    Ok(rows
        .into_iter()
        .map(
            |(name, enqueued, applied, dead_lettered)| SubscriberCounts {
                subscriber: outbox::subscribers::label(&name).to_owned(),
                enqueued,
                applied,
                dead_lettered,
            },
        )
        .collect())
}

/// Figures of the pipeline at one moment.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Progress {
    /// Events written by producers.
    pub enqueued: i64,
    /// Accepted by QStash.
    pub dispatched: i64,
    /// Applied by the consumer (dedupe rows).
    pub applied: i64,
    /// Relay-side retries (attempts beyond the first).
    pub retried: i64,
    /// Dead letters (relay and QStash).
    pub dead_lettered: i64,
    /// Pending in the outbox.
    pub pending: i64,
    /// Oldest pending age, seconds.
    pub oldest_pending_secs: f64,
    /// Ordered heads waiting for delivery evidence.
    pub awaiting_evidence: i64,
    /// Ordered keys blocked by a dead head.
    pub blocked_keys: i64,
    /// Delivery attempts QStash made (all kinds).
    pub qstash_attempts: u64,
}

/// What `outbox-dev dev` ended with.
#[derive(Debug, Clone, Serialize)]
pub struct DevSummary {
    pub progress: Progress,
    /// Demo producer counts.
    pub demo_orders: u64,
    /// Demo poison orders.
    pub demo_poison: u64,
    pub demo_cancellations: u64,
    /// Demo orders whose transaction failed (nothing written).
    pub demo_failed: u64,
    /// The demo producer ran.
    pub demo: bool,
    /// The dead letters by cause, most frequent first (the demo's poison orders apart).
    pub dead_letters_by_cause: Vec<CauseCount>,
    /// Everything in flight finished before shutdown.
    pub drained: bool,
    pub seconds: f64,
    pub log_file: PathBuf,
    /// Per subscriber, with `--subscribers` above 1 (empty otherwise).
    pub subscribers: Vec<SubscriberCounts>,
}

/// Reads the progress figures.
pub async fn progress(pool: &PgPool) -> anyhow::Result<Progress> {
    // Unnamed, in a transaction of its own: safe behind PgBouncer in transaction mode.
    let db = Db::new(pool.clone(), Statements::Unnamed);
    let (enqueued, dispatched, applied, retried, dead): (i64, i64, i64, i64, i64) = db
        .run(async |c| {
            db.query_as(outbox::schema::q(
                "SELECT (SELECT count(*) FROM {schema}.outbox), \
                (SELECT count(*) FROM {schema}.outbox WHERE dispatched_at IS NOT NULL), \
                (SELECT count(*) FROM {schema}.processed_messages), \
                (SELECT coalesce(sum(attempts - 1), 0)::bigint FROM {schema}.outbox WHERE attempts > 1), \
                (SELECT count(*) FROM {schema}.dead_letters)",
            ))
            .fetch_one(c)
            .await
        })
        .await?;
    let b = housekeeping::backlog(&db, outbox::config::AccountingConfig::default().horizon).await?;
    Ok(Progress {
        enqueued,
        dispatched,
        applied,
        retried,
        dead_lettered: dead,
        pending: b.pending,
        oldest_pending_secs: b.oldest_pending_age_secs,
        awaiting_evidence: b.awaiting_evidence,
        blocked_keys: b.blocked_keys,
        qstash_attempts: 0,
    })
}
