//! Retention by partition: the outbox is partitioned by ranges of `id` (decision record 0067), and the relay's
//! housekeeping keeps partitions ready ahead of the id sequence and drops each old one once everything in it is
//! done, moving the few rows that are not done into the DEFAULT partition first. Row-by-row `DELETE` remains only
//! for the partitions that are never dropped whole (the DEFAULT partition, and the pre-partitioning table that
//! became the first partition, `outbox_legacy`, until it is dropped in turn).
//!
//! | rule | why |
//! |---|---|
//! | Ranges of `id`, not of time | `id` stays the primary key (a partitioned table's key must contain the partition key), and dead letters, ordered keys and dedupe rows refer to events by it. Ids grow with time, so a range is a stretch of time too. |
//! | A DEFAULT partition | An insert never fails for want of a partition: ids no range covers (the relay did not run, or could not take its lock) land there and are pruned row by row as before. |
//! | Width = the recent rate × a quarter of the retention window | The outbox then holds between 1 and about 1.25 windows of history plus one partition ready ahead, whatever the rate; a handful of partitions, so a claim that scans all of them stays cheap. A partition in use whose newest row is past retention (a quiet outbox) goes too. |
//! | Dropped only when its newest row is past retention, it is not the one made ahead, and at most [`MAX_SURVIVORS`] rows in it are not done | Nothing pending, leased, in flight, dead-lettered or within the window is ever lost: those rows (the "survivors", the exact complement of what row retention deletes) are copied out under the outbox's and the partition's exclusive locks and re-inserted, same id and columns, into the DEFAULT partition in the same transaction as the drop. They are found through partial indexes, so the outbox is locked for milliseconds. |
//! | Every lock taken with a short `lock_timeout` | DDL on a partitioned table waits for every open statement on it; a long transaction that read the outbox would otherwise queue the DDL and every producer behind it. A lock not had in time is "busy": nothing changed, the next pass tries again. |
//! | A bloated DEFAULT partition is recycled the same way | After an incident (a long transaction that blocked the DDL, so new rows went to DEFAULT), DEFAULT is replaced by a fresh one once its rows are done, giving the space back. |
//! | Failure is never fatal | Without the privilege to create partitions (the relay's role must own `outbox`), rows go to DEFAULT and are deleted row by row: the pre-partitioning behaviour. The error is logged and reported. |

use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::{Connection, PgConnection};

use crate::db::{Db, Statements};

/// The fewest ids a new partition covers.
pub const MIN_ROWS: i64 = 1_000;
/// The most ids a new partition covers.
pub const MAX_ROWS: i64 = 50_000_000;
/// A partition with more rows that are not done than this is not dropped yet (moving them holds the outbox's
/// lock for as long as the copy takes).
pub const MAX_SURVIVORS: i64 = 10_000;
/// The DEFAULT partition is recycled once it is at least this large and its rows are done.
pub const DEFAULT_RECYCLE_BYTES: i64 = 16 * 1024 * 1024;
/// How long a partition operation waits for a lock before it gives up for this pass.
pub const LOCK_TIMEOUT: Duration = Duration::from_millis(100);

/// The name of the DEFAULT partition.
pub const DEFAULT_PARTITION: &str = "outbox_default";

/// What is done, and may go: dispatched longer ago than `$1` seconds, delivered (or applied) and not dead. Row
/// retention ([`super::housekeeping::prune_outbox_batch`]) deletes exactly this, less what a replay still needs
/// ([`held_by_replay`]); a drop keeps exactly the rest ([`survivors_sql`], checked against this on every
/// combination by `partitions::survivors_are_exactly_the_rows_row_retention_would_keep`) and does not happen while
/// a replay still needs a row of the partition ([`replay_holds`]).
pub const DONE: &str = "dispatched_at < now() - make_interval(secs => $1) AND dead_lettered_at IS NULL \
                        AND delivered_at IS NOT NULL";

/// A subscriber's replay that is under way: asked for, not finished, the subscriber not removed (a removed
/// subscriber's replay never resumes; adding it again starts a new one). Over `outbox_subscribers` aliased `r`.
const REPLAY_UNDER_WAY: &str =
    "r.replay_from IS NOT NULL AND r.replay_done_at IS NULL AND r.removed_at IS NULL";

/// The event ids a replay under way has still to read: after its cursor, up to its end (every later id while its
/// end is not fixed yet). Over `outbox_subscribers` aliased `r`; `{ev}` is the event id expression.
fn replay_still_reads(ev: &str) -> String {
    format!(
        "{ev} > coalesce(r.replayed_to, r.replay_from - 1) \
         AND {ev} <= coalesce(r.replay_to, 9223372036854775807)"
    )
}

/// Whether an unfinished replay still has to read outbox row `{o}` (its alias): retained history is what a replay
/// copies, so a row it has not read yet is not done, however old (an interrupted `subscribers add --from` resumed
/// later would otherwise find some of a key's events gone, and the subscriber's lane for that key would wait
/// forever at the gap). A replay never resumed holds these rows until its subscriber is removed.
pub fn held_by_replay(o: &str) -> String {
    format!(
        "EXISTS (SELECT 1 FROM {s} r WHERE r.topic = {o}.topic AND {REPLAY_UNDER_WAY} AND {reads})",
        s = crate::schema::current().table("outbox_subscribers"),
        reads = replay_still_reads(&format!("coalesce({o}.event_id, {o}.id)")),
    )
}

/// Whether a replay under way still has to read a row of partition `p` (any row, done or not: one index probe per
/// replay under way, `outbox_event_idx`). Such a partition is not dropped until the replay has read past it.
async fn replay_holds(conn: &mut PgConnection, p: &Partition) -> Result<bool, sqlx::Error> {
    Statements::Unnamed
        .query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT EXISTS (SELECT 1 FROM {s} r WHERE {REPLAY_UNDER_WAY} \
               AND EXISTS (SELECT 1 FROM {t} o WHERE o.topic = r.topic AND {reads}))",
            s = crate::schema::current().table("outbox_subscribers"),
            t = table(&p.name),
            reads = replay_still_reads("coalesce(o.event_id, o.id)"),
        )))
        .fetch_one(conn)
        .await
}

/// The rows of partition `{t}` that are not [`DONE`] (`$1` = retention in seconds), the survivors of a drop: the
/// exact complement of [`DONE`], written as four branches that the partition's partial indexes serve (pending;
/// in flight; dead-lettered, `outbox_dead_idx`; done but dispatched within the window, the `dispatched_at` BRIN),
/// so that finding them under the outbox's lock reads the few survivors, not the whole partition.
pub fn survivors_sql(t: &str) -> String {
    format!(
        "SELECT * FROM {t} WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL \
         UNION ALL SELECT * FROM {t} WHERE dispatched_at IS NOT NULL AND delivered_at IS NULL AND dead_lettered_at IS NULL \
         UNION ALL SELECT * FROM {t} WHERE dead_lettered_at IS NOT NULL \
         UNION ALL SELECT * FROM {t} WHERE dispatched_at >= now() - make_interval(secs => $1) \
                                       AND delivered_at IS NOT NULL AND dead_lettered_at IS NULL"
    )
}

/// Settings of one maintenance pass.
#[derive(Debug, Clone, Copy)]
pub struct PartitionSettings {
    /// Rows dispatched longer ago than this are done (`OUTBOX_RETENTION_HOURS`).
    pub retention: Duration,
    /// Bounds of a new partition's width, in ids.
    pub min_rows: i64,
    /// See `min_rows`.
    pub max_rows: i64,
    /// See [`MAX_SURVIVORS`].
    pub max_survivors: i64,
    /// See [`DEFAULT_RECYCLE_BYTES`].
    pub default_recycle_bytes: i64,
    /// Stop starting drops after this long.
    pub time_budget: Duration,
}

impl PartitionSettings {
    /// The defaults for a retention window and a time budget.
    pub fn new(retention: Duration, time_budget: Duration) -> Self {
        PartitionSettings {
            retention,
            min_rows: MIN_ROWS,
            max_rows: MAX_ROWS,
            max_survivors: MAX_SURVIVORS,
            default_recycle_bytes: DEFAULT_RECYCLE_BYTES,
            time_budget,
        }
    }
}

/// What one pass did.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct PartitionReport {
    /// Partitions created ahead of the id sequence.
    pub created: u64,
    /// Partitions dropped (the DEFAULT partition's recycling counts as one).
    pub dropped: u64,
    /// Rows that were not done, moved into the DEFAULT partition before their partition was dropped.
    pub survivors_moved: u64,
    /// Operations skipped because a lock was not had within [`LOCK_TIMEOUT`].
    pub busy: u64,
    /// Drops put off because a replay under way has still to read rows of the partition ([`held_by_replay`]).
    pub held: u64,
    /// The first error that stopped the pass (privileges, say); rows then stay where they are.
    pub error: Option<String>,
}

impl PartitionReport {
    /// Adds another pass's counts.
    pub fn add(&mut self, other: &PartitionReport) {
        self.created += other.created;
        self.dropped += other.dropped;
        self.survivors_moved += other.survivors_moved;
        self.busy += other.busy;
        self.held += other.held;
        if self.error.is_none() {
            self.error.clone_from(&other.error);
        }
    }
}

/// One partition of the outbox.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Partition {
    /// Its table name (in the outbox's schema).
    pub name: String,
    /// First id it holds; `None` for `FROM (MINVALUE)` and for the DEFAULT partition.
    pub lo: Option<i64>,
    /// One past the last id it holds; `None` for the DEFAULT partition.
    pub hi: Option<i64>,
}

impl Partition {
    /// Whether this is the DEFAULT partition.
    pub fn is_default(&self) -> bool {
        self.hi.is_none()
    }

    /// Whether rows in it are deleted row by row (DEFAULT, and the first partition, which starts at MINVALUE).
    pub fn row_pruned(&self) -> bool {
        self.lo.is_none()
    }
}

fn outbox_name() -> String {
    crate::schema::current().table("outbox")
}

/// Partition `name` of the outbox, schema-qualified and quoted for SQL.
pub(crate) fn table(name: &str) -> String {
    crate::schema::current().table(&format!("\"{}\"", name.replace('"', "\"\"")))
}

/// The outbox's partitions, ranges first in id order, DEFAULT last. Empty when the outbox is not partitioned.
/// Catalog only (row retention reads it for every batch).
pub async fn list(conn: &mut PgConnection) -> Result<Vec<Partition>, sqlx::Error> {
    Statements::Unnamed
        .query_as(
            "SELECT * FROM (\
                SELECT c.relname::text AS name, \
                       substring(pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \\(''(-?[0-9]+)''\\)')::int8 AS lo, \
                       substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \\(''(-?[0-9]+)''\\)')::int8 AS hi \
                FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
                WHERE i.inhparent = to_regclass($1)) p \
             ORDER BY hi IS NULL, hi",
        )
        .bind(outbox_name())
        .fetch_all(conn)
        .await
}

/// The last id the sequence handed out (0 before the first).
async fn last_id(conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
    let v: Option<i64> = Statements::Unnamed
        .query_scalar("SELECT pg_sequence_last_value(pg_get_serial_sequence($1, 'id')::regclass)")
        .bind(outbox_name())
        .fetch_one(conn)
        .await?;
    Ok(v.unwrap_or(0))
}

/// Ids per second lately: from the newest row and the row about 10,000 ids before it (or the oldest). `None`
/// without history.
async fn recent_rate(conn: &mut PgConnection) -> Result<Option<f64>, sqlx::Error> {
    let o = outbox_name();
    let newest: Option<(i64, f64)> = Statements::Unnamed
        .query_as(sqlx::AssertSqlSafe(format!(
            "SELECT id, extract(epoch FROM created_at)::float8 FROM {o} ORDER BY id DESC LIMIT 1"
        )))
        .fetch_optional(&mut *conn)
        .await?;
    let Some((n_id, n_t)) = newest else {
        return Ok(None);
    };
    let older: Option<(i64, f64)> = Statements::Unnamed
        .query_as(sqlx::AssertSqlSafe(format!(
            "SELECT id, extract(epoch FROM created_at)::float8 FROM {o} WHERE id <= $1 ORDER BY id DESC LIMIT 1"
        )))
        .bind(n_id - 10_000)
        .fetch_optional(&mut *conn)
        .await?;
    // Fewer than 10,000 ids yet: from the oldest row (a quiet outbox must get narrow partitions, or one would
    // hold its events far past retention until its ids are used up).
    let older = match older {
        Some(o) => Some(o),
        None => Statements::Unnamed
            .query_as(sqlx::AssertSqlSafe(format!(
                "SELECT id, extract(epoch FROM created_at)::float8 FROM {o} ORDER BY id LIMIT 1"
            )))
            .fetch_optional(&mut *conn)
            .await?
            .filter(|&(o_id, _): &(i64, f64)| o_id < n_id),
    };
    Ok(older.map(|(o_id, o_t)| (n_id - o_id) as f64 / (n_t - o_t).max(1.0)))
}

/// Whether `e` means "not now, and nothing changed": a lock not had in time (55P03), a deadlock (40P01), a DEFAULT
/// partition that already holds ids of the new range because a producer raced the bound (23514), or another relay
/// that did the same thing first (a partition already dropped, 42P01; already created or overlapping, 42P07,
/// 42P17). The next pass looks again.
fn is_busy(e: &sqlx::Error) -> bool {
    matches!(
        e.as_database_error().and_then(|d| d.code()).as_deref(),
        Some("55P03" | "40P01" | "23514" | "42P01" | "42P07" | "42P17")
    )
}

/// One maintenance pass: create partitions so that at least one full partition lies ahead of the id sequence,
/// then drop (or recycle) what is done, oldest first, until the time budget is spent. Never fails: an error stops
/// the pass and is reported (and logged) in [`PartitionReport::error`].
pub async fn maintain(db: &Db, settings: PartitionSettings) -> PartitionReport {
    let mut report = PartitionReport::default();
    if let Err(e) = maintain_inner(db, settings, &mut report).await {
        tracing::warn!(error = %e, "outbox partition maintenance failed; rows stay where they are and row retention goes on");
        report.error = Some(crate::telemetry::error_chain(&e));
    }
    report
}

async fn maintain_inner(
    db: &Db,
    settings: PartitionSettings,
    report: &mut PartitionReport,
) -> Result<(), sqlx::Error> {
    let started = Instant::now();
    let mut conn = db.pool().acquire().await?;
    // Every statement in a transaction, DDL or not: unnamed statements outside one fail behind a pooler in
    // transaction mode (see `crate::db::Autocommit`).
    let (parts, last, rate) = read(&mut conn, async |c| {
        Ok((list(c).await?, last_id(c).await?, recent_rate(c).await?))
    })
    .await?;
    if parts.is_empty() {
        return Ok(());
    }
    create_ahead(&mut conn, &parts, last, rate, settings, report).await?;
    for p in &parts {
        if started.elapsed() >= settings.time_budget {
            break;
        }
        if !may_go(p, last) || !read(&mut conn, async |c| droppable(c, p, settings).await).await? {
            continue;
        }
        if read(&mut conn, async |c| replay_holds(c, p).await).await? {
            report.held += 1;
            continue;
        }
        match recycle(&mut conn, p, settings).await {
            // A replay started between the read above and the locks.
            Ok(None) => report.held += 1,
            Ok(Some(moved)) => {
                report.dropped += 1;
                report.survivors_moved += moved;
                tracing::info!(partition = %p.name, survivors_moved = moved, "outbox partition dropped");
            }
            // The next partition would very likely wait on the same holder: each attempt queues the producers
            // behind it for up to the lock timeout, so one per pass is enough.
            Err(e) if is_busy(&e) => {
                report.busy += 1;
                break;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn create_ahead(
    conn: &mut PgConnection,
    parts: &[Partition],
    last: i64,
    rate: Option<f64>,
    s: PartitionSettings,
    report: &mut PartitionReport,
) -> Result<(), sqlx::Error> {
    let window = s.retention.as_secs_f64() / 4.0;
    let width = rate
        .map(|r| (r * window) as i64)
        .unwrap_or(0)
        .clamp(s.min_rows, s.max_rows);
    // Ids handed out while a new bound is being set land in DEFAULT: start far enough ahead of the sequence.
    let gap = rate.map(|r| (r * 10.0) as i64).unwrap_or(0).max(100);
    let mut covered = parts.iter().filter_map(|p| p.hi).max().unwrap_or(1);
    for _ in 0..4 {
        if covered > last + width {
            break;
        }
        let mut lo = covered.max(last + 1);
        if lo > covered {
            lo += gap;
        }
        // DEFAULT may hold ids at or past the bound (rows that came while no range covered them).
        let in_default: Option<i64> = read(conn, async |c| {
            Statements::Unnamed
                .query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT max(id) FROM {}",
                    table(DEFAULT_PARTITION)
                )))
                .fetch_one(c)
                .await
        })
        .await?;
        if let Some(d) = in_default.filter(|&d| d >= lo) {
            lo = d + 1 + gap;
        }
        let hi = lo + width;
        let sql = format!(
            "CREATE TABLE {} PARTITION OF {} FOR VALUES FROM ({lo}) TO ({hi}) WITH (fillfactor = 85)",
            table(&format!("outbox_p{lo}")),
            outbox_name()
        );
        match in_transaction(conn, async |c| execute(c, sql).await).await {
            Ok(_) => {
                report.created += 1;
                covered = hi;
            }
            Err(e) if is_busy(&e) => {
                report.busy += 1;
                break;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Whether `p` may go at all, from its bounds alone: not the partition made ahead. One in use may go once its
/// newest row is past retention ([`droppable`]): no event came for a whole window (a quiet outbox), and later ids
/// land in DEFAULT until the next one is made ahead.
fn may_go(p: &Partition, last: i64) -> bool {
    p.lo.is_none_or(|lo| lo <= last)
}

/// Whether `p` may go now: DEFAULT when it is large and nearly all done; a range when its newest row is past
/// retention and at most `max_survivors` rows in it are not done (read without a lock; [`recycle`] selects the
/// survivors again under the lock).
async fn droppable(
    conn: &mut PgConnection,
    p: &Partition,
    s: PartitionSettings,
) -> Result<bool, sqlx::Error> {
    let t = table(&p.name);
    let secs = s.retention.as_secs_f64();
    if p.is_default() {
        let bytes: i64 = Statements::Unnamed
            .query_scalar("SELECT coalesce(pg_total_relation_size(to_regclass($1)), 0)::int8")
            .bind(&t)
            .fetch_one(&mut *conn)
            .await?;
        if bytes < s.default_recycle_bytes {
            return Ok(false);
        }
    } else {
        let newest_recent: Option<bool> = Statements::Unnamed
            .query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT created_at >= now() - make_interval(secs => $1) FROM {t} ORDER BY id DESC LIMIT 1"
            )))
            .bind(secs)
            .fetch_optional(&mut *conn)
            .await?;
        if newest_recent == Some(true) {
            return Ok(false);
        }
    }
    let survivors: i64 = Statements::Unnamed
        .query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM (SELECT 1 FROM ({}) s LIMIT $2) s",
            survivors_sql(&t)
        )))
        .bind(secs)
        .bind(s.max_survivors + 1)
        .fetch_one(&mut *conn)
        .await?;
    Ok(survivors <= s.max_survivors)
}

/// Drops `p` in one transaction, moving its rows that are not done into DEFAULT first (a new DEFAULT when `p` is
/// DEFAULT); returns how many moved. The outbox is locked first, then `p`: every statement on the outbox takes the
/// outbox's lock before its partitions', so the other order would deadlock with any claim that started between the
/// two (and, with the lock timeout, make every drop under load fail). Under the two locks nobody else reads or
/// writes `p`, so the copy is exact; it reads the survivors through their indexes ([`survivors_sql`]), so the
/// outbox stays locked for milliseconds. `None`: a replay under way still has to read a row of `p` (looked at again
/// under the locks: a replay asked for after the caller's look), nothing changed.
async fn recycle(
    conn: &mut PgConnection,
    p: &Partition,
    s: PartitionSettings,
) -> Result<Option<u64>, sqlx::Error> {
    let t = table(&p.name);
    let o = outbox_name();
    let secs = s.retention.as_secs_f64();
    let default = p.is_default();
    in_transaction(conn, async move |c| {
        execute(c, format!("LOCK TABLE ONLY {o} IN ACCESS EXCLUSIVE MODE")).await?;
        execute(c, format!("LOCK TABLE {t} IN ACCESS EXCLUSIVE MODE")).await?;
        if replay_holds(c, p).await? {
            return Ok(None);
        }
        Statements::Unnamed
            .query(sqlx::AssertSqlSafe(format!(
                "CREATE TEMP TABLE outbox_survivors ON COMMIT DROP AS {}",
                survivors_sql(&t)
            )))
            .bind(secs)
            .execute(&mut *c)
            .await?;
        let columns: String = Statements::Unnamed
            .query_scalar(
                "SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) FROM pg_attribute \
                     WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped",
            )
            .bind(&o)
            .fetch_one(&mut *c)
            .await?;
        execute(c, format!("ALTER TABLE {o} DETACH PARTITION {t}")).await?;
        let next = table("outbox_default_next");
        if default {
            execute(
                c,
                format!("CREATE TABLE {next} PARTITION OF {o} DEFAULT WITH (fillfactor = 85)"),
            )
            .await?;
        }
        let moved = execute(
            c,
            format!(
                "INSERT INTO {o} ({columns}) OVERRIDING SYSTEM VALUE \
                     SELECT {columns} FROM outbox_survivors"
            ),
        )
        .await?;
        execute(c, format!("DROP TABLE {t}")).await?;
        if default {
            execute(
                c,
                format!("ALTER TABLE {next} RENAME TO {DEFAULT_PARTITION}"),
            )
            .await?;
        }
        Ok(Some(moved))
    })
    .await
}

async fn execute(c: &mut PgConnection, sql: String) -> Result<u64, sqlx::Error> {
    Ok(Statements::Unnamed
        .query(sqlx::AssertSqlSafe(sql))
        .execute(c)
        .await?
        .rows_affected())
}

/// Runs read-only `work` in a short transaction of its own.
async fn read<T>(
    conn: &mut PgConnection,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error> {
    let mut tx = conn.begin().await?;
    let out = work(&mut tx).await?;
    tx.commit().await?;
    Ok(out)
}

/// Runs `work` in a transaction whose locks wait at most [`LOCK_TIMEOUT`].
async fn in_transaction<T>(
    conn: &mut PgConnection,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error> {
    let mut tx = conn.begin().await?;
    execute(
        &mut tx,
        format!("SET LOCAL lock_timeout = '{}ms'", LOCK_TIMEOUT.as_millis()),
    )
    .await?;
    let out = work(&mut tx).await?;
    tx.commit().await?;
    Ok(out)
}
