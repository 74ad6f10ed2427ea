//! What the database's own state says about the outbox tables: the **xmin horizon** (how far back the oldest open
//! transaction holds every table's dead rows) and **bloat** (dead tuples and size of the tables the relay and the
//! consumer churn). Read by the relay on every invocation (the `OldestTransactionAge`, `XminHorizonAge` and
//! `DeadTuplePercent` metrics and their alarms) and by `outbox status`.
//!
//! | signal | why it matters here | what to do |
//! |---|---|---|
//! | oldest open transaction | Retention deletes dispatched rows and dedupe rows all day; while one transaction stays open (an `idle in transaction` session, a long report, a forgotten prepared transaction, a replication slot), vacuum can remove none of the rows deleted after it began. The claim query then walks dead index entries: claims slow down, tables grow. | end the session (`held_by` names it), set `idle_in_transaction_session_timeout` for every role, drop an unused slot |
//! | dead tuples | Deleted rows not yet vacuumed. Some are normal (autovacuum runs when about a fifth of a table is dead); a share that stays high means autovacuum is off, too slow for the table, or held back by the horizon. | check the horizon first, then the table's autovacuum settings (`docs/operations.md`, "Database health") |
//!
//! Scope: vacuum of a table in this database waits for transactions in this database, prepared transactions
//! here and replication slots (physical ones hold every database); those are what is counted. Sessions in other
//! databases of the same server are not.
//!
//! Visibility: Postgres shows other roles' sessions' transaction details only to superusers and members of
//! `pg_read_all_stats` (or `pg_monitor`). Without it, the horizon covers the relay's own role's sessions and
//! prepared transactions and replication slots (which everyone sees); [`XminHorizon::sees_all_sessions`] says
//! which, and the relay logs it once per invocation as a warning when it is false.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::db::Db;

/// The tables whose bloat is watched: what retention and the consumer's dedupe churn.
pub const WATCHED_TABLES: [&str; 4] = [
    "outbox",
    "processed_messages",
    "outbox_keys",
    "dead_letters",
];

/// Dead tuples are a share of at least this many rows in [`TableHealth::dead_percent`], so that a small table
/// with a few dead rows (20 of 30) does not look bloated.
pub const DEAD_PERCENT_FLOOR_ROWS: i64 = 10_000;

/// The oldest transaction that holds back vacuum, as the relay's role sees it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct XminHorizon {
    /// Seconds the oldest open transaction (a session's, or a prepared one) has been open; 0 when none is.
    pub oldest_transaction_age_secs: f64,
    /// Transactions begun since the oldest snapshot or transaction id still held (`age(xmin)`): how many
    /// transactions' dead rows vacuum must keep. 0 when nothing holds one.
    pub horizon_age_xids: i64,
    /// What holds the horizon: `pid 4242 (psql, idle in transaction)`, `prepared transaction 'gid'` or
    /// `replication slot 'name'`; none when nothing does.
    pub held_by: Option<String>,
    /// Whether the role sees every session's transaction (superuser, `pg_read_all_stats`, `pg_monitor`). When
    /// false, other roles' sessions are not counted.
    pub sees_all_sessions: bool,
}

/// Size and dead tuples of one watched table.
#[derive(Debug, Clone, Serialize, PartialEq, sqlx::FromRow)]
pub struct TableHealth {
    /// Table name (in the outbox schema).
    pub table: String,
    /// Live tuples (the statistics' estimate).
    pub live_tuples: i64,
    /// Dead tuples not yet vacuumed (the statistics' estimate).
    pub dead_tuples: i64,
    /// Table, indexes and TOAST, bytes. For a partitioned table (`outbox`) every figure here is the sum over
    /// its partitions.
    pub total_bytes: i64,
    /// Indexes alone, bytes.
    pub index_bytes: i64,
    /// When autovacuum last finished on it, if ever.
    pub last_autovacuum: Option<DateTime<Utc>>,
    /// How many times autovacuum has vacuumed it since the statistics were reset (over the partitions that exist
    /// now: a dropped partition takes its count with it).
    pub autovacuum_count: i64,
}

impl TableHealth {
    /// Dead tuples as a percentage of all tuples, counted as at least [`DEAD_PERCENT_FLOOR_ROWS`].
    pub fn dead_percent(&self) -> f64 {
        let all = (self.live_tuples + self.dead_tuples).max(DEAD_PERCENT_FLOOR_ROWS);
        100.0 * self.dead_tuples as f64 / all as f64
    }
}

/// Everything this module reads.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DatabaseHealth {
    /// The xmin horizon.
    pub horizon: XminHorizon,
    /// The watched tables that exist, in [`WATCHED_TABLES`] order.
    pub tables: Vec<TableHealth>,
}

impl DatabaseHealth {
    /// The largest [`TableHealth::dead_percent`] of the watched tables (the `DeadTuplePercent` metric).
    pub fn max_dead_percent(&self) -> f64 {
        self.tables
            .iter()
            .map(TableHealth::dead_percent)
            .fold(0.0, f64::max)
    }
}

/// What holds the xmin horizon back the most: a session (`pid …`), a prepared transaction or a replication slot
/// of this database, with its age in transactions and, for a transaction, in seconds.
const HOLDER_SQL: &str = "SELECT who, xids, secs FROM (\
        SELECT format('pid %s (%s, %s)', pid, \
                   coalesce(nullif(application_name, ''), usename::text, 'unknown'), \
                   coalesce(state, 'unknown')) AS who, \
               greatest(age(backend_xmin), age(backend_xid))::int8 AS xids, \
               coalesce(extract(epoch FROM now() - xact_start), 0)::float8 AS secs \
        FROM pg_stat_activity \
        WHERE pid <> pg_backend_pid() AND datname = current_database() \
          AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) \
        UNION ALL \
        SELECT format('prepared transaction %L', gid), age(transaction)::int8, \
               extract(epoch FROM now() - prepared)::float8 \
        FROM pg_prepared_xacts WHERE database = current_database() \
        UNION ALL \
        SELECT format('replication slot %L', slot_name), \
               greatest(age(xmin), age(catalog_xmin))::int8, 0::float8 \
        FROM pg_replication_slots \
        WHERE (xmin IS NOT NULL OR catalog_xmin IS NOT NULL) \
          AND (database IS NULL OR database = current_database())\
     ) h ORDER BY xids DESC NULLS LAST, secs DESC LIMIT 1";

/// The oldest open transaction's age in seconds (a session's or a prepared one), and whether the role sees every
/// session's (superuser, `pg_read_all_stats`).
const OLDEST_SQL: &str = "SELECT coalesce((SELECT max(extract(epoch FROM now() - ts))::float8 FROM (\
                SELECT xact_start AS ts FROM pg_stat_activity \
                WHERE pid <> pg_backend_pid() AND datname = current_database() \
                  AND xact_start IS NOT NULL \
                  AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) \
                UNION ALL \
                SELECT prepared FROM pg_prepared_xacts WHERE database = current_database()) t), 0), \
            (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) \
              OR pg_has_role(current_user, 'pg_read_all_stats', 'MEMBER')";

/// The watched tables' (`$2`, in the schema `$1`) size and dead tuples, a partitioned table's summed over its
/// partitions, in `$2`'s order.
const TABLES_SQL: &str = "SELECT c.relname::text AS table, \
            sum(coalesce(s.n_live_tup, 0))::int8 AS live_tuples, \
            sum(coalesce(s.n_dead_tup, 0))::int8 AS dead_tuples, \
            sum(pg_total_relation_size(l.relid))::int8 AS total_bytes, \
            sum(pg_indexes_size(l.relid))::int8 AS index_bytes, \
            max(s.last_autovacuum) AS last_autovacuum, \
            sum(coalesce(s.autovacuum_count, 0))::int8 AS autovacuum_count \
     FROM pg_class c \
     JOIN pg_namespace n ON n.oid = c.relnamespace \
     CROSS JOIN LATERAL (SELECT c.oid AS relid WHERE c.relkind = 'r' \
                         UNION ALL SELECT relid FROM pg_partition_tree(c.oid) \
                         WHERE isleaf AND c.relkind = 'p') l \
     LEFT JOIN pg_stat_all_tables s ON s.relid = l.relid \
     WHERE n.nspname = $1 AND c.relname = ANY($2) AND c.relkind IN ('r', 'p') \
     GROUP BY c.relname \
     ORDER BY array_position($2, c.relname::text)";

/// Reads the horizon and the watched tables' figures (catalog and statistics views only: no table is scanned).
pub async fn read(db: &Db) -> Result<DatabaseHealth, sqlx::Error> {
    let schema = crate::schema::current().name().to_owned();
    db.run(async |c| {
        let holder: Option<(String, i64, f64)> =
            db.query_as(HOLDER_SQL).fetch_optional(&mut *c).await?;
        let (oldest_secs, sees_all): (f64, bool) =
            db.query_as(OLDEST_SQL).fetch_one(&mut *c).await?;
        let tables: Vec<TableHealth> = db
            .query_as(TABLES_SQL)
            .bind(&schema)
            .bind(&WATCHED_TABLES[..])
            .fetch_all(&mut *c)
            .await?;
        Ok(DatabaseHealth {
            horizon: horizon_of(holder, oldest_secs, sees_all),
            tables,
        })
    })
    .await
}

/// The [`XminHorizon`] of what [`HOLDER_SQL`] and [`OLDEST_SQL`] read.
fn horizon_of(holder: Option<(String, i64, f64)>, oldest_secs: f64, sees_all: bool) -> XminHorizon {
    let (held_by, horizon_age_xids) = match holder {
        Some((who, xids, _)) => (Some(who), xids.max(0)),
        None => (None, 0),
    };
    XminHorizon {
        oldest_transaction_age_secs: oldest_secs.max(0.0),
        horizon_age_xids,
        held_by,
        sees_all_sessions: sees_all,
    }
}
