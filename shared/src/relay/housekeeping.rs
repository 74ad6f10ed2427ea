//! Housekeeping, run by the relay at the start of each invocation and then beside the drain while rows past
//! retention remain ([`keep_up`], decision record 0066), each pass bounded in rows and time: dispatched rows
//! whose outcome is known (delivered or applied, [`crate::accounting`]) leave the table after
//! `OUTBOX_RETENTION_HOURS` (an event still in flight stays until it is accounted for; dead-lettered rows stay
//! until their dead letter is handled), consumer dedupe rows and consumer sequence rows older than
//! `PROCESSED_TTL_HOURS` are pruned, and idle ordered keys are released. The same functions back
//! `outbox prune`, which also prunes handled dead letters and the dead outbox rows nothing refers to any more
//! ([`prune_dead_letters_batch`], [`prune_dead_events_batch`]; decision record 0061).

use std::time::{Duration, Instant};

use super::partitions::{self, PartitionSettings};
use crate::db::Db;
use serde::Serialize;

/// What one housekeeping pass removed.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct HousekeepingReport {
    /// Outbox rows deleted.
    pub outbox_deleted: u64,
    /// `processed_messages` rows deleted.
    pub processed_deleted: u64,
    /// `consumer_sequences` rows deleted.
    pub consumer_sequences_deleted: u64,
    /// Idle ordered keys released.
    pub keys_released: u64,
    /// Outbox partitions created ahead of the id sequence ([`partitions::maintain`]).
    pub partitions_created: u64,
    /// Outbox partitions dropped whole because everything in them was done.
    pub partitions_dropped: u64,
    /// Rows not done yet, moved into the DEFAULT partition before their partition was dropped.
    pub survivors_moved: u64,
    /// Done partitions kept because a replay under way has still to read rows of them.
    pub partitions_held: u64,
    /// A step stopped at the time budget with full batches still coming, or came back full: more is past
    /// retention.
    pub more: bool,
}

impl HousekeepingReport {
    fn add(&mut self, other: HousekeepingReport) {
        self.outbox_deleted += other.outbox_deleted;
        self.processed_deleted += other.processed_deleted;
        self.consumer_sequences_deleted += other.consumer_sequences_deleted;
        self.keys_released += other.keys_released;
        self.partitions_created += other.partitions_created;
        self.partitions_dropped += other.partitions_dropped;
        self.survivors_moved += other.survivors_moved;
        self.partitions_held += other.partitions_held;
        self.more = other.more;
    }
}

/// Retention settings for one pass.
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    /// Dispatched outbox rows older than this go.
    pub outbox: Duration,
    /// Consumer dedupe rows older than this go.
    pub processed: Duration,
    /// Rows per statement.
    pub batch: u32,
    /// Stop starting new statements after this long.
    pub time_budget: Duration,
}

/// Runs one bounded `DELETE` whose only parameter (`$1`) is an age in seconds; returns the rows deleted.
async fn delete_older_than(db: &Db, sql: String, older_than: Duration) -> Result<u64, sqlx::Error> {
    db.execute(
        db.query(sqlx::AssertSqlSafe(sql))
            .bind(older_than.as_secs_f64()),
    )
    .await
}

/// Deletes one batch of done outbox rows ([`partitions::DONE`]) past retention that no replay under way still has to
/// read ([`partitions::held_by_replay`]) from the partitions that are pruned
/// row by row (DEFAULT, and the pre-partitioning table while it exists; the others are dropped whole by
/// [`partitions::maintain`]); returns how many.
pub async fn prune_outbox_batch(
    db: &Db,
    older_than: Duration,
    batch: u32,
) -> Result<u64, sqlx::Error> {
    let tables = db
        .run(async |c| partitions::list(c).await)
        .await?
        .into_iter()
        .filter(partitions::Partition::row_pruned)
        .map(|p| p.name)
        .collect::<Vec<_>>();
    let mut deleted = 0;
    for t in tables {
        let left = u64::from(batch).saturating_sub(deleted);
        if left == 0 {
            break;
        }
        let t = partitions::table(&t);
        let sql = format!(
            "DELETE FROM {t} WHERE id IN (\
                SELECT o.id FROM {t} o WHERE {done} AND NOT {held} LIMIT {left} FOR UPDATE OF o SKIP LOCKED)",
            done = partitions::DONE,
            held = partitions::held_by_replay("o"),
        );
        deleted += delete_older_than(db, sql, older_than).await?;
    }
    Ok(deleted)
}

/// Deletes one batch of consumer dedupe rows past their TTL; returns how many.
pub async fn prune_processed_batch(
    db: &Db,
    older_than: Duration,
    batch: u32,
) -> Result<u64, sqlx::Error> {
    let schema = crate::schema::current().quoted();
    let sql = format!(
        "DELETE FROM {schema}.processed_messages WHERE ctid = ANY(ARRAY(\
            SELECT ctid FROM {schema}.processed_messages WHERE processed_at < now() - make_interval(secs => $1) LIMIT {batch}))"
    );
    delete_older_than(db, sql, older_than).await
}

/// Deletes one batch of consumer sequence rows not updated for longer than the TTL; returns how many.
pub async fn prune_consumer_sequences_batch(
    db: &Db,
    older_than: Duration,
    batch: u32,
) -> Result<u64, sqlx::Error> {
    let schema = crate::schema::current().quoted();
    let sql = format!(
        "DELETE FROM {schema}.consumer_sequences WHERE ctid = ANY(ARRAY(\
            SELECT ctid FROM {schema}.consumer_sequences WHERE updated_at < now() - make_interval(secs => $1) LIMIT {batch}))"
    );
    delete_older_than(db, sql, older_than).await
}

/// Releases up to `batch` idle ordered keys (every event done, nothing leased, in flight or blocked). Holds
/// each key's `outbox_sequences` lock while deleting, skipping keys a producer holds (see
/// [`crate::ordering::release_idle_key`]).
pub async fn release_idle_keys(db: &Db, batch: u32) -> Result<u64, sqlx::Error> {
    let schema = crate::schema::current().quoted();
    let sql = format!(
        "WITH idle AS (\
            SELECT k.topic, k.partition_key, k.subscriber FROM {schema}.outbox_keys k \
            JOIN {schema}.outbox_sequences s ON s.topic = k.topic AND s.partition_key = k.partition_key \
            WHERE s.last_seq = k.done_seq AND k.blocked_at IS NULL AND k.inflight_id IS NULL \
              AND (k.locked_until IS NULL OR k.locked_until < now()) \
            LIMIT {batch} FOR UPDATE OF k, s SKIP LOCKED) \
         DELETE FROM {schema}.outbox_keys k USING idle \
         WHERE k.topic = idle.topic AND k.partition_key = idle.partition_key AND k.subscriber = idle.subscriber"
    );
    db.execute(db.query(sqlx::AssertSqlSafe(sql))).await
}

/// Deletes one batch of dead letters older than `older_than` that need nobody any more: redriven, or resolved
/// (delivered after all). Unhandled dead letters are never pruned: they stay until an operator redrives or purges
/// them (guarantee 4). Used by `outbox prune --dead-letters-days`, not by the relay's housekeeping.
pub async fn prune_dead_letters_batch(
    db: &Db,
    older_than: Duration,
    batch: u32,
) -> Result<u64, sqlx::Error> {
    let schema = crate::schema::current().quoted();
    let sql = format!(
        "DELETE FROM {schema}.dead_letters WHERE id IN (\
            SELECT id FROM {schema}.dead_letters \
            WHERE created_at < now() - make_interval(secs => $1) \
              AND (redriven_at IS NOT NULL OR resolved_at IS NOT NULL) \
            ORDER BY created_at LIMIT {batch} FOR UPDATE SKIP LOCKED)"
    );
    delete_older_than(db, sql, older_than).await
}

/// Deletes one batch of dead outbox rows (dead-lettered longer ago than `older_than`) that nothing refers to any
/// more: no unhandled dead letter of theirs is left (it was purged, or it is resolved), and, for an ordered event,
/// its key has moved past it (a blocking or waiting head is never deleted). Used by `outbox prune
/// --dead-letters-days`. Scans the dead rows (`outbox` keeps only about `OUTBOX_RETENTION_HOURS` of history, so
/// this is a short scan; there is no index on `dead_lettered_at`).
pub async fn prune_dead_events_batch(
    db: &Db,
    older_than: Duration,
    batch: u32,
) -> Result<u64, sqlx::Error> {
    let schema = crate::schema::current().quoted();
    let sql = format!(
        "DELETE FROM {schema}.outbox WHERE id IN (\
            SELECT o.id FROM {schema}.outbox o \
            WHERE o.dead_lettered_at < now() - make_interval(secs => $1) \
              AND NOT EXISTS (SELECT 1 FROM {schema}.dead_letters d WHERE d.outbox_id = o.id \
                                AND d.redriven_at IS NULL AND d.resolved_at IS NULL) \
              AND (o.seq IS NULL OR NOT EXISTS (SELECT 1 FROM {schema}.outbox_keys k \
                     WHERE k.topic = o.topic AND k.partition_key = o.partition_key \
                       AND k.subscriber = o.subscriber AND k.done_seq < o.seq)) \
            LIMIT {batch} FOR UPDATE SKIP LOCKED)"
    );
    delete_older_than(db, sql, older_than).await
}

/// One bounded pass of everything: first the outbox's partitions ([`partitions::maintain`]: new ones ahead, old
/// ones dropped, within a quarter of the time budget; its failure is logged, never fatal), then row retention. The
/// outbox and the dedupe rows get half the time budget each, so that a backlog of one never starves the other, then
/// one statement each for consumer sequence rows and idle keys; [`HousekeepingReport::more`] says a step ran out
/// of time or came back full.
pub async fn run(db: &Db, retention: Retention) -> Result<HousekeepingReport, sqlx::Error> {
    let started = Instant::now();
    let parts = partitions::maintain(
        db,
        PartitionSettings::new(retention.outbox, retention.time_budget / 4),
    )
    .await;
    let mut report = HousekeepingReport {
        partitions_created: parts.created,
        partitions_dropped: parts.dropped,
        survivors_moved: parts.survivors_moved,
        partitions_held: parts.held,
        ..Default::default()
    };
    let full = u64::from(retention.batch);
    let half = retention.time_budget / 2;
    let mut last = full;
    while last >= full && started.elapsed() < half {
        last = prune_outbox_batch(db, retention.outbox, retention.batch).await?;
        report.outbox_deleted += last;
    }
    report.more |= last >= full;
    let step = Instant::now();
    last = full;
    while last >= full && step.elapsed() < half {
        last = prune_processed_batch(db, retention.processed, retention.batch).await?;
        report.processed_deleted += last;
    }
    report.more |= last >= full;
    // One statement each, every pass: a backlog of the two above must not starve them.
    let n = prune_consumer_sequences_batch(db, retention.processed, retention.batch).await?;
    report.consumer_sequences_deleted += n;
    report.more |= n >= full;
    let n = release_idle_keys(db, retention.batch).await?;
    report.keys_released += n;
    report.more |= n >= full;
    // A lane a producer opened for a replaying subscriber while its replay was ending waits for nothing now.
    let n = crate::subscribers::release_waiting_lanes(db).await?;
    report.keys_released += n;
    Ok(report)
}

/// The pause between two passes of [`keep_up`] once nothing more is past retention.
pub const KEEP_UP_PAUSE: Duration = Duration::from_secs(5);

/// Housekeeping beside the drain, until `until` or `stop` (the drain ended; a permit stored by `notify_one`
/// counts): another bounded pass soon while the last one ran out of time ([`HousekeepingReport::more`]),
/// otherwise every [`KEEP_UP_PAUSE`]. No pass starts unless it can end before `until`. One pass at the start of an invocation
/// deletes at most a time budget's worth of rows per invocation, whatever the write rate: at 1,000 events/s that
/// was just enough, and anything faster would grow the table without bound (decision record 0066). A failed pass
/// is logged and ends the loop; the invocation's own pass already ran.
pub async fn keep_up(
    db: &Db,
    retention: Retention,
    first: HousekeepingReport,
    until: Instant,
    stop: &tokio::sync::Notify,
) -> HousekeepingReport {
    let mut total = first;
    // After a pass that ran out of time, a pause as long as the pass: at most half of one connection's time goes
    // to deleting, the rest of the database's is the drain's.
    let mut pause = if first.more {
        retention.time_budget
    } else {
        KEEP_UP_PAUSE
    };
    loop {
        if Instant::now() + pause + retention.time_budget >= until {
            return total;
        }
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = stop.notified() => return total,
        }
        let started = Instant::now();
        match run(db, retention).await {
            Ok(r) => {
                pause = if r.more {
                    started.elapsed()
                } else {
                    KEEP_UP_PAUSE
                };
                total.add(r);
            }
            Err(e) => {
                tracing::error!(error = %e, "housekeeping beside the drain failed; the next invocation retries");
                return total;
            }
        }
    }
}

/// What waits at the end of an invocation, and for how long: pending events, blocked ordered keys, ordered heads
/// awaiting delivery evidence. The invocation summary's gauges, which the alarms read.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct BacklogGauges {
    /// Events neither dispatched nor dead.
    pub pending: i64,
    /// Age of the oldest of them, seconds (0 when none). Alarm on this, not on depth.
    pub oldest_pending_age_secs: f64,
    /// Ordered keys blocked by a dead head.
    pub blocked_keys: i64,
    /// Ordered heads accepted by QStash, waiting for delivery evidence.
    pub awaiting_evidence: i64,
    /// Longest such wait, seconds.
    pub oldest_awaiting_evidence_secs: f64,
    /// Events accepted by QStash without a recorded outcome yet ([`crate::accounting::InFlight`]).
    pub in_flight: i64,
    /// Of them, in flight past the reconciler's horizon (the `UnaccountedEvents` alarm).
    pub unaccounted: i64,
}

/// Reads the backlog gauges (index-only where possible); `horizon`: the reconciler's (`RELAY_RECONCILE_AFTER_SECS`).
pub async fn backlog(db: &Db, horizon: Duration) -> Result<BacklogGauges, sqlx::Error> {
    let (flight, row) = db
        .run(async |c| {
            let flight = crate::accounting::in_flight(c, horizon, db.statements()).await?;
            let row: (i64, f64, i64, i64, f64) = db.query_as(
                crate::schema::q("SELECT \
                    (SELECT count(*) FROM {schema}.outbox WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL), \
                    coalesce((SELECT extract(epoch FROM now() - min(created_at))::float8 FROM {schema}.outbox \
                              WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL), 0), \
                    (SELECT count(*) FROM {schema}.outbox_keys WHERE blocked_at IS NOT NULL), \
                    (SELECT count(*) FROM {schema}.outbox_keys WHERE inflight_id IS NOT NULL), \
                    coalesce((SELECT extract(epoch FROM now() - min(inflight_since))::float8 FROM {schema}.outbox_keys \
                              WHERE inflight_id IS NOT NULL), 0)"),
            )
            .fetch_one(c)
            .await?;
            Ok((flight, row))
        })
        .await?;
    Ok(BacklogGauges {
        pending: row.0,
        oldest_pending_age_secs: row.1.max(0.0),
        blocked_keys: row.2,
        awaiting_evidence: row.3,
        oldest_awaiting_evidence_secs: row.4.max(0.0),
        in_flight: flight.total,
        unaccounted: flight.unaccounted,
    })
}
