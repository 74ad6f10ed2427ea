//! Counting from the database: whether the pipeline is still busy, progress lines, and the verdict on every event
//! ([`verdict`], [`explained_dead_letters`]).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sqlx::PgPool;

use super::counts::Counts;
use super::report::{Reason, SoakReport, reason_of};

/// Whether any event has no outcome yet: pending, leased, or accepted by QStash with neither delivery evidence
/// nor a dead letter (an event whose failure callback was lost stays so until the reconciler records it), or an
/// ordered key awaits evidence.
pub(crate) async fn busy(db: &PgPool) -> anyhow::Result<bool> {
    Ok(sqlx::query_scalar(outbox::schema::q(
        "SELECT EXISTS (SELECT 1 FROM {schema}.outbox WHERE delivered_at IS NULL AND dead_lettered_at IS NULL) \
         OR EXISTS (SELECT 1 FROM {schema}.outbox_keys WHERE inflight_id IS NOT NULL)",
    ))
    .fetch_one(db)
    .await?)
}

/// One progress line on stderr: the outbox's and the consumer's figures, the kills so far.
pub(super) async fn progress(
    db: &PgPool,
    counts: &Counts,
    dev: &qstash_dev::Handle,
    started: Instant,
    state: &str,
) {
    let figures: Result<(i64, i64, i64, i64), _> = sqlx::query_as(outbox::schema::q(
        "SELECT (SELECT count(*) FROM {schema}.outbox), \
                (SELECT count(*) FROM {schema}.outbox WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL), \
                (SELECT count(*) FROM soak_applied), \
                (SELECT count(*) FROM {schema}.dead_letters)",
    ))
    .fetch_one(db)
    .await;
    match figures {
        Ok((enqueued, pending, applied, dead)) => eprintln!(
            "soak: {:>5.0} s {state}: enqueued {enqueued}, pending {pending}, applied {applied}, dead letters {dead}, \
             relay kills {}, consumer kills {}, callback kills {}, backend kills {}, qstash attempts {}",
            started.elapsed().as_secs_f64(),
            counts.relay_kills.load(Ordering::Relaxed),
            counts.consumer_kills.load(Ordering::Relaxed),
            counts.callback_kills.load(Ordering::Relaxed),
            counts.backend_kills.load(Ordering::Relaxed),
            dev.stats().attempts,
        ),
        Err(e) => eprintln!("soak: progress query failed: {e}"),
    }
}

/// Counts every event's fate from the database ([`verdict`]), retrying while Postgres comes back from a restart.
pub(super) async fn account(db: &PgPool) -> anyhow::Result<SoakReport> {
    let mut tries = 0;
    loop {
        match verdict(db).await {
            Ok(r) => return Ok(r),
            // Postgres may still be coming back from a restart.
            Err(e) if tries < 20 => {
                tries += 1;
                eprintln!("soak: counting failed (retrying): {e:#}");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The soak's verdict on a database (the library's tables and `soak_applied`, [`create_table`](super::create_table)): every figure of
/// [`SoakReport`] that the database holds — enqueued, poison, applied once and twice, poison applied,
/// dead-lettered (poison, other, the unexpected events' ids, the reasons), lost, order violations, left leased —
/// in one transaction. The rest (kills, the dead letters the dev server explains, `ok`) is the caller's.
pub async fn verdict(db: &PgPool) -> anyhow::Result<SoakReport> {
    let mut tx = db.begin().await?;
    sqlx::query(outbox::schema::q(
        "CREATE TEMP TABLE soak_fate ON COMMIT DROP AS
         SELECT o.id, o.topic, coalesce((o.payload->>'poison')::boolean, false) AS poison,
                coalesce(a.applied, 0) AS applied,
                EXISTS (SELECT 1 FROM {schema}.dead_letters d WHERE d.outbox_id = o.id) AS dead
           FROM {schema}.outbox o
           LEFT JOIN (SELECT outbox_id, count(*) AS applied FROM soak_applied GROUP BY 1) a ON a.outbox_id = o.id
          WHERE o.topic IN ('soak_ordered', 'soak_unordered')",
    ))
    .execute(&mut *tx)
    .await?;
    let (enqueued, poison, once, twice, poison_applied, dead_poison, dead_other, lost): (
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
    ) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE poison),
                count(*) FILTER (WHERE applied = 1), count(*) FILTER (WHERE applied > 1),
                count(*) FILTER (WHERE poison AND applied > 0),
                count(*) FILTER (WHERE dead AND applied = 0 AND poison),
                count(*) FILTER (WHERE dead AND applied = 0 AND NOT poison),
                count(*) FILTER (WHERE NOT dead AND applied = 0)
           FROM soak_fate",
    )
    .fetch_one(&mut *tx)
    .await?;
    let unexpected: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM soak_fate WHERE dead AND applied = 0 AND NOT poison ORDER BY id",
    )
    .fetch_all(&mut *tx)
    .await?;
    let dead_letters: Vec<(bool, i64, String, Option<String>)> = sqlx::query_as(outbox::schema::q(
        "SELECT f.poison, f.id, d.error, d.response_body
           FROM soak_fate f JOIN {schema}.dead_letters d ON d.outbox_id = f.id
          WHERE f.applied = 0",
    ))
    .fetch_all(&mut *tx)
    .await?;
    // Ordered topic: in application order, each key's sequence must rise (a skipped dead head is just absent).
    let violations: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (
             SELECT seq, lag(seq) OVER (PARTITION BY partition_key ORDER BY ord) AS prev
               FROM soak_applied WHERE topic = 'soak_ordered') s
          WHERE prev IS NOT NULL AND seq <= prev",
    )
    .fetch_one(&mut *tx)
    .await?;
    let leased: i64 = sqlx::query_scalar(outbox::schema::q(
        "SELECT (SELECT count(*) FROM {schema}.outbox
                  WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL)
              + (SELECT count(*) FROM {schema}.outbox_keys
                  WHERE locked_until > now() OR inflight_id IS NOT NULL)",
    ))
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    // Grouped by normalised reason, counting distinct events (an event may carry several dead letters).
    let mut merged: BTreeMap<(bool, String), std::collections::BTreeSet<i64>> = BTreeMap::new();
    for (poison, id, error, response_body) in dead_letters {
        merged
            .entry((poison, reason_of(&error, response_body.as_deref(), id)))
            .or_default()
            .insert(id);
    }
    let mut dead_letter_reasons: Vec<Reason> = merged
        .into_iter()
        .map(|((poison, reason), ids)| Reason {
            poison,
            reason,
            count: ids.len() as i64,
        })
        .collect();
    dead_letter_reasons.sort_by_key(|r| std::cmp::Reverse(r.count));
    Ok(SoakReport {
        enqueued,
        poison,
        applied_once: once,
        applied_twice: twice,
        poison_applied,
        dead_lettered_poison: dead_poison,
        dead_lettered_other: dead_other,
        unexpected_dead_letters: unexpected,
        dead_letter_reasons,
        lost,
        order_violations: violations,
        left_leased: leased,
        ..SoakReport::default()
    })
}

/// The events the dev server's DLQ (`dlq`, its own record) says QStash gave up on after faults, less the ones the
/// soak's consumer applied (`soak_applied`) and the poison ones: what [`SoakReport::explained_dead_letters`]
/// holds (`outbox_testkit::given_up`).
pub async fn explained_dead_letters(
    db: &PgPool,
    dlq: &[qstash_dev::DlqEntryInfo],
) -> anyhow::Result<Vec<i64>> {
    let given_up = outbox_testkit::given_up::given_up(dlq);
    let ids: Vec<i64> = given_up
        .iter()
        .flat_map(|m| m.events.iter().copied())
        .collect();
    let applied: std::collections::BTreeSet<i64> =
        sqlx::query_scalar("SELECT DISTINCT outbox_id FROM soak_applied WHERE outbox_id = ANY($1)")
            .bind(&ids)
            .fetch_all(db)
            .await?
            .into_iter()
            .collect();
    let poison: std::collections::BTreeSet<i64> = sqlx::query_scalar(outbox::schema::q(
        "SELECT id FROM {schema}.outbox WHERE id = ANY($1) AND coalesce((payload->>'poison')::boolean, false)",
    ))
    .bind(&ids)
    .fetch_all(db)
    .await?
    .into_iter()
    .collect();
    Ok(outbox_testkit::given_up::explained_dead_letters(
        &given_up,
        |id| applied.contains(&id),
        |id| poison.contains(&id),
    )
    .into_iter()
    .collect())
}
