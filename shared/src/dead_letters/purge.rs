//! Purge: deletes dead letters an operator no longer needs. It never touches the outbox, and keeps the dead
//! letters of events that block an ordered key (decision record 0061).

use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, Row};

use super::{FILTER_SQL, Filter, UNHANDLED_SQL, bind_filter};

/// The condition that keeps a dead letter from being purged: it is unhandled and its event blocks an ordered
/// key (purging it would leave a blocked key with nothing to redrive).
const BLOCKING_SQL: &str = "(d.redriven_at IS NULL AND d.resolved_at IS NULL AND d.outbox_id IS NOT NULL \
     AND EXISTS (SELECT 1 FROM {schema}.outbox_keys k WHERE k.blocked_id = d.outbox_id))";

/// Which of the dead letters a filter matches a purge takes, by whether they still need an operator.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PurgeScope {
    /// All of them (`outbox dead-letters purge`).
    #[default]
    Any,
    /// Only those already redriven or resolved (`--handled-only`).
    Handled,
    /// Only those neither redriven nor resolved: what the console's list shows unless it includes handled ones,
    /// so that "purge the matching" purges what the list matched.
    Unhandled,
}

impl PurgeScope {
    /// `any`, `handled` or `unhandled`.
    pub fn as_str(self) -> &'static str {
        match self {
            PurgeScope::Any => "any",
            PurgeScope::Handled => "handled",
            PurgeScope::Unhandled => "unhandled",
        }
    }
}

impl std::str::FromStr for PurgeScope {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "any" => Ok(PurgeScope::Any),
            "handled" => Ok(PurgeScope::Handled),
            "unhandled" => Ok(PurgeScope::Unhandled),
            other => Err(format!(
                "unknown purge scope {other:?}: expected any, handled or unhandled"
            )),
        }
    }
}

/// The scope as SQL over `dead_letters d`, parameter `$10` ([`PurgeScope::as_str`]).
const SCOPE_SQL: &str = "CASE $10::text WHEN 'handled' THEN NOT ({UNHANDLED}) WHEN 'unhandled' THEN ({UNHANDLED}) \
     ELSE true END";

/// [`SCOPE_SQL`] with the unhandled condition in place.
fn scope_sql() -> String {
    SCOPE_SQL.replace("{UNHANDLED}", UNHANDLED_SQL)
}

/// Why a purge did not run (or stopped: batches deleted before a database error stay deleted).
#[derive(Debug, thiserror::Error)]
pub enum PurgeError {
    /// No filter field is set.
    #[error(
        "a purge needs at least one filter (--topic, --subscriber, --source, --key, --since, --until), so that it \
         cannot delete every dead letter by accident"
    )]
    FilterRequired,
    #[error("database error: {0} (is Postgres reachable? the purge is safe to run again)")]
    Database(#[from] sqlx::Error),
}

/// What a purge would do / did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PurgeCounts {
    /// Dead letters deleted (or that would be).
    pub deleted: i64,
    /// Matching dead letters kept because their event blocks an ordered key (redrive them instead).
    pub kept_blocking: i64,
}

/// Counts what [`purge`] would delete: the matching dead letters, less those kept because their event blocks an
/// ordered key — found from the blocked keys' side (`outbox_keys.blocked_id`, a handful), so the count reads the
/// matching dead letters once, from an index where the filter allows, instead of probing the keys per dead letter.
pub async fn count_purge(
    conn: &mut PgConnection,
    filter: &Filter,
    scope: PurgeScope,
) -> Result<PurgeCounts, sqlx::Error> {
    let schema = crate::schema::current().quoted();
    let in_scope = scope_sql();
    let sql = format!(
        "SELECT (SELECT count(*) FROM {schema}.dead_letters d \
                 WHERE {FILTER_SQL} AND {in_scope}), \
                (SELECT count(*) FROM {schema}.dead_letters d \
                 WHERE {FILTER_SQL} AND $10::text <> 'handled' AND {UNHANDLED_SQL} \
                   AND d.outbox_id = ANY (ARRAY(SELECT k.blocked_id FROM {schema}.outbox_keys k \
                                                WHERE k.blocked_id IS NOT NULL)))"
    );
    let row = bind_filter(sqlx::query(sqlx::AssertSqlSafe(sql)), filter)
        .bind(scope.as_str())
        .fetch_one(&mut *conn)
        .await?;
    let (matching, kept): (i64, i64) = (row.try_get(0)?, row.try_get(1)?);
    Ok(PurgeCounts {
        deleted: matching - kept,
        kept_blocking: kept,
    })
}

/// Deletes the dead letters matching `filter` (at least one field set) in `scope`, in batches of `batch`, calling `on_batch` with the running total. **The outbox rows are not touched**:
/// a dead event stays in `outbox` (dead) until `outbox prune` removes it. Dead letters whose event blocks an
/// ordered key are kept (counted in `kept_blocking`): redrive them instead.
pub async fn purge(
    pool: &sqlx::PgPool,
    filter: &Filter,
    scope: PurgeScope,
    batch: u32,
    mut on_batch: impl FnMut(i64),
) -> Result<PurgeCounts, PurgeError> {
    if filter.is_empty() {
        return Err(PurgeError::FilterRequired);
    }
    let mut conn = pool.acquire().await?;
    let kept = count_purge(&mut conn, filter, scope).await?.kept_blocking;
    let schema = crate::schema::current().quoted();
    let in_scope = scope_sql();
    let sql = format!(
        "DELETE FROM {schema}.dead_letters WHERE id IN (SELECT d.id FROM {schema}.dead_letters d \
         WHERE {FILTER_SQL} AND {in_scope} AND NOT {BLOCKING_SQL} \
         ORDER BY d.id LIMIT {} FOR UPDATE SKIP LOCKED)",
        batch.clamp(1, 100_000)
    );
    // BLOCKING_SQL is a template of its own.
    let sql = crate::schema::sql(&sql);
    let mut deleted = 0i64;
    loop {
        let n = bind_filter(sqlx::query(sqlx::AssertSqlSafe(sql.clone())), filter)
            .bind(scope.as_str())
            .execute(&mut *conn)
            .await?
            .rows_affected();
        if n == 0 {
            break;
        }
        deleted += n as i64;
        on_batch(deleted);
    }
    tracing::info!(deleted, kept_blocking = kept, "dead letters purged");
    Ok(PurgeCounts {
        deleted,
        kept_blocking: kept,
    })
}
