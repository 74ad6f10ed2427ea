//! Dead letters grouped by their normalised error (the `error_group` column: runs of digits as `N`, the first
//! 200 characters), for the operator console: which failures there are and how many of each, before looking at
//! one of them or acting on a whole group.

use crate::ids::DeadLetterId;
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgConnection, Row};

use super::query::Listing;
use super::{FILTER_SQL, Filter, UNHANDLED_SQL, bind_filter};

/// Dead letters sharing one normalised error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErrorGroup {
    /// The normalised error (the value of [`Filter::error_group`] that selects this group).
    pub error_group: String,
    /// Dead letters in it (of those the filter matched).
    pub count: i64,
    /// Its oldest dead letter, and when it was recorded.
    pub first_id: DeadLetterId,
    pub first_at: Option<DateTime<Utc>>,
    /// Its newest dead letter (an example to show), and when it was recorded.
    pub last_id: DeadLetterId,
    pub last_at: Option<DateTime<Utc>>,
}

/// The groups of the dead letters `filter` matches (the unhandled ones, or all: `listing`), the largest
/// first, at most `limit` of them; and how many dead letters matched in total. Without other filters the counts
/// come from `dead_letters_group_idx` alone (no table read); the first and last dead letter of each group shown are
/// then read by id.
pub async fn error_groups(
    conn: &mut PgConnection,
    filter: &Filter,
    listing: Listing,
    limit: u32,
) -> Result<(Vec<ErrorGroup>, i64), sqlx::Error> {
    let schema = crate::schema::current().quoted();
    let sql = format!(
        "SELECT d.error_group, count(*), min(d.id), max(d.id), sum(count(*)) OVER ()::bigint \
         FROM {schema}.dead_letters d WHERE {FILTER_SQL} AND ($10 OR ({UNHANDLED_SQL})) \
         GROUP BY d.error_group ORDER BY count(*) DESC, d.error_group LIMIT $11"
    );
    let rows = bind_filter(sqlx::query(sqlx::AssertSqlSafe(sql)), filter)
        .bind(listing == Listing::All)
        .bind(i64::from(limit.clamp(1, 1000)))
        .fetch_all(&mut *conn)
        .await?;
    let mut total = 0;
    let mut groups = Vec::with_capacity(rows.len());
    for r in &rows {
        total = r.try_get(4)?;
        groups.push(ErrorGroup {
            error_group: r.try_get(0)?,
            count: r.try_get(1)?,
            first_id: r.try_get(2)?,
            first_at: None,
            last_id: r.try_get(3)?,
            last_at: None,
        });
    }
    let ids: Vec<DeadLetterId> = groups
        .iter()
        .flat_map(|g| [g.first_id, g.last_id])
        .collect();
    let times: Vec<(DeadLetterId, DateTime<Utc>)> = sqlx::query_as(crate::schema::q(
        "SELECT id, created_at FROM {schema}.dead_letters WHERE id = ANY ($1)",
    ))
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await?;
    let at = |id: DeadLetterId| times.iter().find(|(i, _)| *i == id).map(|(_, t)| *t);
    for g in &mut groups {
        g.first_at = at(g.first_id);
        g.last_at = at(g.last_id);
    }
    Ok((groups, total))
}

/// The largest dead-letter id now (0 when there is none): the bound ([`Filter::max_id`]) a confirmed bulk
/// action keeps to.
pub async fn max_id(conn: &mut PgConnection) -> Result<DeadLetterId, sqlx::Error> {
    sqlx::query_scalar(crate::schema::q(
        "SELECT coalesce(max(id), 0) FROM {schema}.dead_letters",
    ))
    .fetch_one(&mut *conn)
    .await
}
