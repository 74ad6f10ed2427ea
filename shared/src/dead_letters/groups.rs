//! Dead letters grouped by their normalised error (the `error_group` column: runs of digits as `N`, the first
//! 200 characters), for the operator console: which failures there are and how many of each, before looking at
//! one of them or acting on a whole group.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgConnection, Row};

use super::{FILTER_SQL, Filter, UNHANDLED_SQL, bind_filter};

/// Dead letters sharing one normalised error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct ErrorGroup {
    /// The normalised error (the value of [`Filter::error_group`] that selects this group).
    pub error_group: String,
    /// Dead letters in it (of those the filter matched).
    pub count: i64,
    /// Its oldest dead letter (an example to show).
    pub first_id: i64,
    /// Its newest dead letter.
    pub last_id: i64,
    /// Topics among them.
    pub topics: i64,
    pub first_at: DateTime<Utc>,
    pub last_at: DateTime<Utc>,
}

/// The groups of the dead letters `filter` matches (unhandled ones only unless `include_handled`), the largest
/// first, at most `limit` of them; and how many dead letters matched in total.
pub async fn error_groups(
    conn: &mut PgConnection,
    filter: &Filter,
    include_handled: bool,
    limit: u32,
) -> Result<(Vec<ErrorGroup>, i64), sqlx::Error> {
    let schema = crate::schema::current().quoted();
    let sql = format!(
        "SELECT d.error_group, count(*) AS count, min(d.id) AS first_id, max(d.id) AS last_id, \
                count(DISTINCT d.topic) AS topics, min(d.created_at) AS first_at, max(d.created_at) AS last_at, \
                sum(count(*)) OVER ()::bigint AS total \
         FROM {schema}.dead_letters d WHERE {FILTER_SQL} AND ($9 OR ({UNHANDLED_SQL})) \
         GROUP BY d.error_group ORDER BY count(*) DESC, d.error_group LIMIT $10"
    );
    let rows = bind_filter(sqlx::query(sqlx::AssertSqlSafe(sql)), filter)
        .bind(include_handled)
        .bind(i64::from(limit.clamp(1, 1000)))
        .fetch_all(&mut *conn)
        .await?;
    let total = match rows.first() {
        Some(r) => r.try_get("total")?,
        None => 0,
    };
    let groups = rows
        .iter()
        .map(<ErrorGroup as sqlx::FromRow<_>>::from_row)
        .collect::<Result<Vec<_>, _>>()?;
    Ok((groups, total))
}

/// The largest dead-letter id now (0 when there is none): the bound ([`Filter::max_id`]) a confirmed bulk
/// action keeps to.
pub async fn max_id(conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(crate::schema::q(
        "SELECT coalesce(max(id), 0) FROM {schema}.dead_letters",
    ))
    .fetch_one(&mut *conn)
    .await
}
