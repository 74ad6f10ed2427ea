//! Bulk redrive: every unhandled dead letter a [`Filter`] matches, one [`redrive`] (and one transaction) each,
//! so one refusal or database error does not stop the rest.

use serde::Serialize;
use sqlx::Row;

use crate::ids::DeadLetterId;

use super::redrive::{RedriveError, RedriveOptions, Redriven, redrive};
use super::{FILTER_SQL, Filter, UNHANDLED_SQL, bind_filter};

/// The outcome of one dead letter in a bulk redrive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum BulkOutcome {
    Redriven(Redriven),
    /// Left as it is (with why): a middle event without `out_of_order`, an event that is live again, a dead letter
    /// that cannot be redriven.
    Skipped {
        dead_letter_id: DeadLetterId,
        /// A middle ordered event (would need `--out-of-order`).
        out_of_order: bool,
        reason: String,
    },
    /// A database error on this item (the others go on).
    Failed {
        dead_letter_id: DeadLetterId,
        error: String,
    },
}

/// Totals of a bulk redrive.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct BulkReport {
    pub redriven: u64,
    /// Skipped (of which `out_of_order` would need `--out-of-order`).
    pub skipped: u64,
    /// Middle events skipped.
    pub out_of_order: u64,
    pub failed: u64,
}

/// Redrives every unhandled dead letter matching `filter` (at least one field set), oldest first, each in its
/// own transaction; dead letters recorded after the start are left alone. `on_item` sees each outcome as it
/// happens (progress).
pub async fn redrive_matching(
    pool: &sqlx::PgPool,
    filter: &Filter,
    opts: RedriveOptions,
    mut on_item: impl FnMut(&BulkOutcome),
) -> Result<BulkReport, RedriveError> {
    if filter.is_empty() {
        return Err(RedriveError::FilterRequired);
    }
    let mut conn = pool.acquire().await?;
    let upto: i64 = sqlx::query_scalar(crate::schema::q(
        "SELECT coalesce(max(id), 0) FROM {schema}.dead_letters",
    ))
    .fetch_one(&mut *conn)
    .await?;
    let schema = crate::schema::current().quoted();
    let sql = format!(
        "SELECT d.id FROM {schema}.dead_letters d WHERE {FILTER_SQL} AND {UNHANDLED_SQL} AND d.id > $10 AND d.id <= $11 \
         ORDER BY d.id LIMIT 500"
    );
    let mut report = BulkReport::default();
    let mut after = DeadLetterId(0);
    loop {
        let ids: Vec<DeadLetterId> =
            bind_filter(sqlx::query(sqlx::AssertSqlSafe(sql.clone())), filter)
                .bind(after)
                .bind(upto)
                .fetch_all(&mut *conn)
                .await?
                .iter()
                .map(|r| r.try_get(0))
                .collect::<Result<_, _>>()?;
        let Some(last) = ids.last().copied() else {
            break;
        };
        after = last;
        for id in ids {
            let outcome = match redrive(&mut conn, id, opts).await {
                Ok(r) => {
                    report.redriven += 1;
                    BulkOutcome::Redriven(r)
                }
                Err(RedriveError::Database(e)) => {
                    report.failed += 1;
                    BulkOutcome::Failed {
                        dead_letter_id: id,
                        error: e.to_string(),
                    }
                }
                Err(e) => {
                    report.skipped += 1;
                    let out_of_order = e.is_out_of_order();
                    report.out_of_order += u64::from(out_of_order);
                    BulkOutcome::Skipped {
                        dead_letter_id: id,
                        out_of_order,
                        reason: e.to_string(),
                    }
                }
            };
            on_item(&outcome);
        }
    }
    Ok(report)
}
