//! Guarantee 4 to the end — **every event accounted for**: the system knows, for each event, which of these states
//! it is in, and nothing stays in flight unnoticed when a callback never arrives (decision record 0015).
//!
//! | state | how it is known | how long it can last | what alarms |
//! |---|---|---|---|
//! | pending | `dispatched_at IS NULL` (not yet accepted by QStash) | until a relay claims it; retries with backoff, then a relay dead letter | `OldestPendingAge` |
//! | in flight | accepted by QStash (`dispatched_at`), no outcome yet (`outbox_inflight_idx`) | until QStash delivers it or gives up: at most the horizon [`crate::config::reconcile_horizon`] | `UnaccountedEvents` once past the horizon |
//! | applied | ordered: delivery evidence (consumer transaction or delivery callback); unordered: the consumer's dedupe row, read in bulk by [`sweep_applied`] (or a delivery callback, [`crate::config::OutcomeSource`]) → `delivered_at` | final | — |
//! | dead letter | a row in `dead_letters` (relay, failure callback, or this module's [`reconcile`]), the event `dead_lettered_at`; at most one unresolved per event | until an operator redrives it, or it resolves itself (late evidence; or the sweep finds the event's dedupe row: a relay dead-lettered an event QStash had delivered) | `DeadLettered` / dead-letter alarms |
//!
//! What closes the gap a lost callback leaves: each relay invocation ([`run`]) first marks in-flight events that
//! their dedupe rows show applied ([`sweep_applied`], no QStash message), then looks the events still in flight
//! past the horizon up at QStash ([`reconcile`]), in bounded work (at most `RELAY_RECONCILE_MAX_LOOKUPS`
//! management API requests, paced, stopping at the first 429):
//!
//! | QStash says | the reconciler |
//! |---|---|
//! | the message is in the DLQ (`GET /v2/dlq?messageId=…`; an entry about any message it did not ask about is logged and counted, `unasked_dlq_entries`, never recorded) | records it exactly as the failure callback would have ([`crate::callbacks`], same natural id `dlqId`: a late callback is a duplicate, not a second dead letter) |
//! | the message is still held (`GET /v2/messages/{id}` = 200: waiting, retrying) | leaves it; asks again after a quarter of the horizon |
//! | neither (expired, purged, lost, never accepted) | unordered, still in flight under that message: publishes it again with a fresh deduplication id (`republish_count`; the consumer dedupes), up to `RELAY_RECONCILE_MAX_REPUBLISH` times and only within [`crate::config::AccountingConfig::republish_window`] of its first claim, else a dead letter "unaccounted"; ordered: left to the head's evidence timeout, which republishes it |
//!
//! The reconciler never causes a second application, and never leaves an event without a state:
//!
//! | rule | why |
//! |---|---|
//! | an event is published again only until `first claim + PROCESSED_TTL_HOURS − delivery window − 1 h` | a dedupe row of any earlier application (at the first claim at the earliest: a publish answered with an error, or never recorded, may have been accepted) must outlive every delivery of the new message; measured from the latest dispatch, which every republish resets, the third republish with the defaults landed ≈ 195 h after a possible first application, past the 168 h rows |
//! | the first claim (`first_claimed_at`) is kept by republishes and redrives; a row re-inserted by a redrive has `-infinity` | a redrive makes no earlier application's dedupe row younger; a re-inserted row's first claim is unknown, so it is never published again on the reconciler's own |
//! | a republished row not published by its deadline (`republish_by`) becomes a dead letter | published later (QStash down meanwhile), its delivery could outlive the dedupe row |
//! | settings that could outlive the dedupe rows are refused at start ([`crate::config::AccountingConfig::check_dedupe_lifetime`]) | no republish, and no DLQ entry checked against dedupe rows, may happen after the rows are gone |
//! | its dead letter is written first, and only events whose dead letter was written are marked dead; natural ids name the lost message (`<id>/unaccounted/<message id>`, `<id>/republish-expired/<republish count>`) | an event never ends dead without an open dead letter (a count-based id collided with the redriven dead letter of an earlier loss) |
//! | only rows still in flight under the message asked about are republished or marked | another reconciler may have republished the row meanwhile |
//! | answers are read up to [`crate::qstash::MAX_ANSWER_BYTES`]; a DLQ page over it is asked again about half the messages | whatever answers at `QSTASH_URL` cannot exhaust the relay's memory, and a large page cannot stall the reconciler |
//!
//! Everything it does is counted: per invocation in the relay's summary and EMF line, summed in `outbox_accounting`
//! for `outbox status`.

pub(crate) mod reconcile;
mod report;
pub(crate) mod sweep;

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;

use crate::db::Statements;

pub(crate) use reconcile::{Reconciler, reconcile};
pub use report::AccountingReport;
use sweep::sweep_applied;

/// In-flight events by age, from `outbox_inflight_idx` (what `outbox status` shows).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct InFlight {
    /// Accepted by QStash, no outcome recorded yet.
    pub total: i64,
    /// Of them, younger than a minute.
    pub under_1m: i64,
    /// 1 to 10 minutes.
    pub from_1m_to_10m: i64,
    /// 10 minutes to an hour.
    pub from_10m_to_1h: i64,
    /// Over an hour.
    pub over_1h: i64,
    /// In flight for longer than the horizon, whatever their bucket above: QStash should have decided by now. The
    /// reconciler works on them; a count that stays above 0 means it cannot (alarm `UnaccountedEvents`).
    pub unaccounted: i64,
    /// The horizon, seconds.
    pub horizon_secs: f64,
    /// The oldest in-flight event's age, seconds (0 when none).
    pub oldest_secs: f64,
}

/// Reads [`InFlight`] (one index scan over in-flight rows only).
pub async fn in_flight(
    conn: &mut PgConnection,
    horizon: Duration,
    statements: Statements,
) -> Result<InFlight, sqlx::Error> {
    let row: (i64, i64, i64, i64, i64, i64, f64) = statements
        .query_as(crate::schema::q(
            "SELECT count(*), \
                count(*) FILTER (WHERE dispatched_at >= now() - interval '1 minute'), \
                count(*) FILTER (WHERE dispatched_at < now() - interval '1 minute' \
                                   AND dispatched_at >= now() - interval '10 minutes'), \
                count(*) FILTER (WHERE dispatched_at < now() - interval '10 minutes' \
                                   AND dispatched_at >= now() - interval '1 hour'), \
                count(*) FILTER (WHERE dispatched_at < now() - interval '1 hour'), \
                count(*) FILTER (WHERE dispatched_at < now() - make_interval(secs => $1)), \
                coalesce(extract(epoch FROM now() - min(dispatched_at))::float8, 0) \
         FROM {schema}.outbox \
         WHERE dispatched_at IS NOT NULL AND delivered_at IS NULL AND dead_lettered_at IS NULL",
        ))
        .bind(horizon.as_secs_f64())
        .fetch_one(&mut *conn)
        .await?;
    Ok(InFlight {
        total: row.0,
        under_1m: row.1,
        from_1m_to_10m: row.2,
        from_10m_to_1h: row.3,
        over_1h: row.4,
        unaccounted: row.5,
        horizon_secs: horizon.as_secs_f64(),
        oldest_secs: row.6.max(0.0),
    })
}

/// The reconciler's totals over every invocation (`outbox_accounting`).
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq, sqlx::FromRow)]
pub struct AccountingTotals {
    pub swept_applied: i64,
    pub recorded_from_dlq: i64,
    pub republished: i64,
    pub still_retrying: i64,
    pub unaccounted_dead: i64,
    pub lookup_failures: i64,
    /// The last pass.
    pub last_run_at: Option<DateTime<Utc>>,
    /// The last pass's error, if it had one.
    pub last_error: Option<String>,
}

/// Reads [`AccountingTotals`].
pub async fn totals(
    conn: &mut PgConnection,
    statements: Statements,
) -> Result<AccountingTotals, sqlx::Error> {
    let t: Option<AccountingTotals> = statements
        .query_as(crate::schema::q(
            "SELECT swept_applied, recorded_from_dlq, republished, still_retrying, unaccounted_dead, lookup_failures, \
                last_run_at, last_error FROM {schema}.outbox_accounting",
        ))
        .fetch_optional(&mut *conn)
    .await?;
    Ok(t.unwrap_or_default())
}

/// Adds a pass to the totals (and notes its error, or clears the last one).
pub(crate) async fn add_to_totals(
    conn: &mut PgConnection,
    r: &AccountingReport,
    error: Option<&str>,
    statements: Statements,
) -> Result<(), sqlx::Error> {
    let q = statements
        .query(crate::schema::q(
            "UPDATE {schema}.outbox_accounting SET swept_applied = swept_applied + $1, \
                recorded_from_dlq = recorded_from_dlq + $2, republished = republished + $3, \
                still_retrying = still_retrying + $4, unaccounted_dead = unaccounted_dead + $5, \
                lookup_failures = lookup_failures + $6, last_run_at = now(), last_error = $7",
        ))
        .bind(r.swept_applied as i64)
        .bind(r.recorded_from_dlq as i64)
        .bind(r.republished as i64)
        .bind(r.still_retrying as i64)
        .bind(r.unaccounted_dead as i64)
        .bind(r.lookup_failures as i64)
        .bind(error);
    statements.execute(conn, q).await?;
    Ok(())
}

/// One accounting pass: [`sweep_applied`], then [`reconcile`], then the totals. Bounded by `budget` (wall time) and the reconciler's lookup budget.
pub async fn run(rec: &Reconciler<'_>, budget: Duration) -> Result<AccountingReport, sqlx::Error> {
    let started = std::time::Instant::now();
    // Whatever the outcome source: a dedupe row is the strongest evidence there is, and where the consumer keeps
    // its dedupe rows elsewhere the sweep finds none (its cost is one scan of the in-flight rows, which delivery
    // callbacks keep few).
    let swept_applied = sweep_applied(
        rec.db,
        &rec.cfg.consumer_name,
        rec.cfg.applied_grace,
        budget / 2,
    )
    .await?;
    let mut report = AccountingReport {
        swept_applied,
        ..Default::default()
    };
    let left = budget.saturating_sub(started.elapsed());
    let error = reconcile(rec, left, &mut report).await.err();
    let mut conn = rec.db.pool().acquire().await?;
    let error_text = error.as_ref().map(|e| e.to_string());
    add_to_totals(
        &mut conn,
        &report,
        error_text.as_deref(),
        rec.db.statements(),
    )
    .await?;
    match error {
        Some(reconcile::ReconcileError::Database(e)) => Err(e),
        _ => Ok(report),
    }
}
