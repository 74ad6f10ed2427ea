//! The applied sweep: an in-flight event whose consumer dedupe row exists was applied. Reading that in bulk costs
//! the relay one index range scan and one primary-key probe per event and QStash nothing (decision record 0015);
//! the events found are marked delivered with the same statement delivery evidence uses
//! ([`crate::ordering::record_delivery_batch`]: an ordered key moves on, a dead letter of the event resolves).

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::Row;

use crate::db::Db;
use crate::ids::OutboxId;

/// Rows read per statement.
const PAGE: i64 = 2000;

/// One page of in-flight events older than the grace, after the cursor, with whether a dedupe row exists for
/// each: in the namespace `$2` (`CONSUMER_NAME`) for the default subscriber's copies, in the subscriber's name for
/// a named subscriber's ([`crate::subscribers`]); keyed by the copy's event, or by the copy's own id for a row
/// written before decision record 0070 ([`crate::once::DedupeKey`]).
const PAGE_SQL: &str = concat!(
    "SELECT o.id, o.dispatched_at, ",
    crate::once::applied_sql!("o", "$2"),
    " AS applied",
    r#"
FROM {schema}.outbox o
WHERE o.dispatched_at IS NOT NULL AND o.delivered_at IS NULL AND o.dead_lettered_at IS NULL
  AND o.dispatched_at < now() - make_interval(secs => $1)
  AND (o.dispatched_at, o.id) > ($3, $4)
ORDER BY o.dispatched_at, o.id
LIMIT $5
"#
);

/// Dead-lettered events whose dedupe row shows them applied after all: a relay that dead-lettered a copy whose
/// publish it never saw answered ("no destination" once its subscriber was being removed, a retry budget spent on
/// lost answers) while QStash delivered it. Read over the dead rows (`outbox_dead_idx`), a primary-key probe each;
/// their dead letters are resolved as "applied", then the rows recorded delivered like late delivery evidence.
const DEAD_APPLIED_SQL: &str = concat!(
    "SELECT o.id FROM {schema}.outbox o \
     WHERE o.dead_lettered_at IS NOT NULL AND o.delivered_at IS NULL AND ",
    crate::once::applied_sql!("o", "$1"),
    " ORDER BY o.id LIMIT $2"
);

const RESOLVE_APPLIED_SQL: &str = r#"
UPDATE {schema}.dead_letters SET resolved_at = now(), resolution = 'applied'
WHERE outbox_id = ANY ($1::bigint[]) AND resolved_at IS NULL AND redriven_at IS NULL
"#;

/// Marks in-flight events (accepted by QStash more than `grace` ago) that the dedupe rows of `consumer` show
/// applied as delivered, oldest first, page by page until none is left or `budget` is spent; then dead-lettered
/// events the dedupe rows show applied (their dead letters resolved "applied": nothing for an operator to do).
/// Returns how many events it marked.
pub async fn sweep_applied(
    db: &Db,
    consumer: &str,
    grace: Duration,
    budget: Duration,
) -> Result<u64, sqlx::Error> {
    let started = Instant::now();
    let mut cursor: (DateTime<Utc>, i64) = (DateTime::<Utc>::UNIX_EPOCH, 0);
    let mut marked = 0u64;
    loop {
        let q = db
            .query(crate::schema::q(PAGE_SQL))
            .bind(grace.as_secs_f64())
            .bind(consumer)
            .bind(cursor.0)
            .bind(cursor.1)
            .bind(PAGE);
        let rows = db.run(async |c| q.fetch_all(c).await).await?;
        let mut applied = Vec::new();
        for r in &rows {
            let id: OutboxId = r.try_get("id")?;
            cursor = (r.try_get("dispatched_at")?, id.get());
            if r.try_get::<bool, _>("applied")? {
                applied.push(id);
            }
        }
        if !applied.is_empty() {
            let mut conn = db.pool().acquire().await?;
            let recorded =
                crate::ordering::record_delivery_batch(&mut conn, &applied, db.statements())
                    .await?;
            marked += recorded.found.len() as u64;
        }
        if (rows.len() as i64) < PAGE || started.elapsed() >= budget {
            break;
        }
    }
    let q = db
        .query(crate::schema::q(DEAD_APPLIED_SQL))
        .bind(consumer)
        .bind(PAGE);
    let dead: Vec<OutboxId> = db
        .run(async |c| q.fetch_all(c).await)
        .await?
        .iter()
        .map(|r| r.try_get("id"))
        .collect::<Result<_, _>>()?;
    if !dead.is_empty() {
        let mut tx = db.pool().begin().await?;
        db.statements()
            .query(crate::schema::q(RESOLVE_APPLIED_SQL))
            .bind(&dead)
            .execute(&mut *tx)
            .await?;
        let recorded =
            crate::ordering::record_delivery_batch(&mut tx, &dead, db.statements()).await?;
        tx.commit().await?;
        marked += recorded.found.len() as u64;
    }
    Ok(marked)
}
