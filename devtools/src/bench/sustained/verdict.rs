//! The verdict of a sustained run: every event accounted for ([`account`]) and the targets ([`targets`]).
//!
//! Retention deletes the outbox rows as the run goes, so the accounting cannot start from the outbox as the
//! soak's does: it starts from the producers' ledger (every outbox id whose transaction committed) and the
//! consumer's table (`soak_applied`, one row per application, no unique constraint), which retention never
//! touches.

use std::collections::{BTreeSet, HashMap};

use serde::Serialize;
use sqlx::PgPool;

use super::args::SustainedArgs;
use super::sample::{Invocation, Minute};

/// Every event's fate.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Accounting {
    /// Events the producers committed (their ledger).
    pub produced: u64,
    /// Applied exactly once.
    pub applied_once: u64,
    /// Applied more than once (must be 0).
    pub applied_twice: u64,
    /// Neither applied nor dead-lettered (must be 0).
    pub lost: u64,
    /// Dead-lettered (no event is poison and the dev server has no faults: must be 0).
    pub dead_lettered: u64,
    /// Applications of ids no producer committed (must be 0).
    pub applied_unknown: u64,
    /// Ordered topic: applications of a key whose sequence did not rise (must be 0).
    pub order_violations: i64,
    /// Outbox rows left pending, leased or in flight after the drain, and dispatched events whose outcome was
    /// never recorded (`delivered_at` unset: retention would never delete them) (must be 0).
    pub left_leased: i64,
    /// The pipeline drained within the timeout.
    pub drained: bool,
    pub ok: bool,
    /// What failed, in words.
    pub problems: Vec<String>,
}

/// Whether every ledger event has been applied or dead-lettered (the drain waits for it).
pub async fn settled(db: &PgPool, produced: i64) -> anyhow::Result<bool> {
    let (done, undelivered): (i64, i64) = sqlx::query_as(outbox::schema::q(
        "SELECT (SELECT count(DISTINCT outbox_id) FROM soak_applied) \
              + (SELECT count(DISTINCT outbox_id) FROM {schema}.dead_letters), \
                (SELECT count(*) FROM {schema}.outbox WHERE dispatched_at IS NOT NULL AND delivered_at IS NULL \
                    AND dead_lettered_at IS NULL)",
    ))
    .fetch_one(db)
    .await?;
    Ok(done >= produced && undelivered == 0)
}

/// The account of every event in `ledger`.
pub async fn account(db: &PgPool, ledger: Vec<i64>, drained: bool) -> anyhow::Result<Accounting> {
    let produced: BTreeSet<i64> = ledger.into_iter().collect();
    let applied: HashMap<i64, i64> =
        sqlx::query_as::<_, (i64, i64)>("SELECT outbox_id, count(*) FROM soak_applied GROUP BY 1")
            .fetch_all(db)
            .await?
            .into_iter()
            .collect();
    let dead: BTreeSet<i64> = sqlx::query_scalar(outbox::schema::q(
        "SELECT DISTINCT outbox_id FROM {schema}.dead_letters WHERE outbox_id IS NOT NULL",
    ))
    .fetch_all(db)
    .await?
    .into_iter()
    .collect();
    let mut a = Accounting {
        produced: produced.len() as u64,
        drained,
        ..Accounting::default()
    };
    for id in &produced {
        match applied.get(id) {
            Some(1) => a.applied_once += 1,
            Some(_) => a.applied_twice += 1,
            None if dead.contains(id) => {}
            None => a.lost += 1,
        }
    }
    a.dead_lettered = dead.len() as u64;
    a.applied_unknown = applied.keys().filter(|id| !produced.contains(id)).count() as u64;
    a.order_violations = sqlx::query_scalar(
        "SELECT count(*) FROM (
             SELECT seq, lag(seq) OVER (PARTITION BY partition_key ORDER BY ord) AS prev
               FROM soak_applied WHERE topic = 'soak_ordered') s
          WHERE prev IS NOT NULL AND seq <= prev",
    )
    .fetch_one(db)
    .await?;
    a.left_leased = sqlx::query_scalar(outbox::schema::q(
        "SELECT (SELECT count(*) FROM {schema}.outbox
                  WHERE (dispatched_at IS NULL OR delivered_at IS NULL) AND dead_lettered_at IS NULL)
              + (SELECT count(*) FROM {schema}.outbox_keys
                  WHERE locked_until > now() OR inflight_id IS NOT NULL)",
    ))
    .fetch_one(db)
    .await?;
    for (figure, value) in [
        ("applied twice", a.applied_twice as i64),
        ("lost", a.lost as i64),
        ("dead-lettered", a.dead_lettered as i64),
        ("applied but never produced", a.applied_unknown as i64),
        ("order violations", a.order_violations),
        (
            "left pending, leased, in flight or without a recorded outcome",
            a.left_leased,
        ),
    ] {
        if value != 0 {
            a.problems.push(format!("{value} {figure}"));
        }
    }
    if a.produced == 0 {
        a.problems.push("no event was produced".into());
    }
    if !drained {
        a.problems.push("the pipeline did not drain in time".into());
    }
    a.ok = a.problems.is_empty();
    Ok(a)
}

/// One target and whether it was met.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    pub name: String,
    /// What was measured, in words with the figures.
    pub measured: String,
    pub met: bool,
}

/// The median of the values `pick` gives for the minutes in `from..=to` (1-based, inclusive); `None` when none.
fn window(
    minutes: &[Minute],
    from: u32,
    to: u32,
    pick: impl Fn(&Minute) -> Option<f64>,
) -> Option<f64> {
    let v: Vec<f64> = minutes
        .iter()
        .filter(|m| m.minute >= from && m.minute <= to)
        .filter_map(pick)
        .collect();
    (!v.is_empty()).then(|| outbox_testkit::median(&v))
}

/// The template's default `OldestTransactionThresholdSecs`: the `OldestTransactionAlarm` fires when a relay
/// invocation reports an `OldestTransactionAge` at least this large.
pub const OLDEST_TRANSACTION_ALARM_SECS: f64 = 300.0;

/// The targets, scaled to the run's length: the size at the last minute within 1.5× of the size at a quarter
/// of the run (minute 15 of 60); the claim p99 and commit → applied p99 of the last sixth (the last 10 minutes
/// of 60) within 1.5× of minutes one sixth to one third (10–20 of 60), each a median of per-minute figures; the
/// throughput kept up (produced ≥ 99 % of the rate, dispatched ≥ 99 % of produced). With a long transaction:
/// recovered to the same bounds within 10 minutes of its end, against the run's own state before it opened
/// (the size at that minute, the latencies of the sixth before), and its alarm's condition seen by a relay.
pub fn targets(
    args: &SustainedArgs,
    minutes: &[Minute],
    invocations: &[Invocation],
) -> Vec<Target> {
    let mut out = Vec::new();
    let n = args.minutes;
    let sixth = (n / 6).max(1);
    let quarter = (n / 4).max(1);
    let size_at = |m: u32| {
        minutes
            .iter()
            .find(|x| x.minute == m)
            .map(|x| x.outbox_bytes as f64)
    };
    let claim = |m: &Minute| m.claim_p99_ms;
    let applied = |m: &Minute| m.commit_to_applied_p99_ms;
    let bound = 1.5;
    // The reference (a size and a window of minutes) and what is judged against it. Steady: the size at a
    // quarter of the run, the latencies of its second sixth, judged at the end. With a long transaction: the
    // size when it opens and the sixth before, judged over the sixth that ends 10 minutes after it closed
    // (or at the end of the run, if sooner).
    let (size_ref, (ref_from, ref_to), (end_from, end_to)) = match args.long_transaction_at {
        Some(at) => {
            let recovered = (at + args.long_transaction_minutes + 10).min(n);
            (
                at,
                ((at + 1).saturating_sub(sixth).max(1), at),
                ((recovered + 1).saturating_sub(sixth).max(1), recovered),
            )
        }
        None => (
            quarter,
            (sixth, 2 * sixth),
            (n.saturating_sub(sixth) + 1, n),
        ),
    };
    let size_end = end_to;
    if let (Some(a), Some(b)) = (size_at(size_ref), size_at(size_end)) {
        out.push(Target {
            name: format!(
                "outbox table + indexes at minute {size_end} ≤ {bound}× minute {size_ref}"
            ),
            measured: format!("{:.1} MB vs {:.1} MB: {:.2}×", b / 1e6, a / 1e6, b / a),
            met: b <= bound * a,
        });
    }
    for (label, pick) in [
        ("claim p99", &claim as &dyn Fn(&Minute) -> Option<f64>),
        ("commit → applied p99", &applied),
    ] {
        if let (Some(r), Some(e)) = (
            window(minutes, ref_from, ref_to, pick),
            window(minutes, end_from, end_to, pick),
        ) {
            out.push(Target {
                name: format!(
                    "{label}, minutes {end_from}–{end_to} ≤ {bound}× minutes {ref_from}–{ref_to} (medians of the minutes)"
                ),
                measured: format!("{e:.1} ms vs {r:.1} ms: {:.2}×", e / r),
                met: e <= bound * r,
            });
        }
    }
    let produced: u64 = minutes.iter().map(|m| m.produced).sum();
    let dispatched: i64 = minutes.iter().map(|m| m.dispatched).sum();
    let wanted = args.rate * (n as f64) * args.minute_secs as f64;
    out.push(Target {
        name: format!("{:.0} events/s produced and dispatched", args.rate),
        measured: format!(
            "{produced} produced of {wanted:.0} due ({:.1} %), {dispatched} dispatched within the minutes ({:.1} %)",
            100.0 * produced as f64 / wanted,
            100.0 * dispatched as f64 / produced.max(1) as f64
        ),
        met: produced as f64 >= 0.99 * wanted && dispatched as f64 >= 0.99 * produced as f64,
    });
    if args.long_transaction_at.is_some() {
        let seen = invocations
            .iter()
            .filter_map(|i| i.metrics.get("OldestTransactionAge").copied())
            .fold(0.0, f64::max);
        out.push(Target {
            name: format!(
                "OldestTransactionAlarm's condition seen (OldestTransactionAge ≥ {OLDEST_TRANSACTION_ALARM_SECS:.0} s)"
            ),
            measured: format!("largest OldestTransactionAge a relay invocation reported: {seen:.0} s"),
            met: seen >= OLDEST_TRANSACTION_ALARM_SECS,
        });
    }
    out
}
