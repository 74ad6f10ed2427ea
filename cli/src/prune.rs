//! `outbox prune`: retention in bounded batches with a progress line per batch — dispatched outbox rows,
//! consumer dedupe rows (`processed_messages`) and consumer sequence rows, handled dead letters and the dead
//! outbox rows nothing refers to any more, and idle ordered keys. The relay's housekeeping runs the same batch
//! functions (`outbox::relay::housekeeping`) a little at a time; this command does the whole backlog at once
//! (decision record 0061).

use std::future::Future;
use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use outbox::config::{ProcessEnv, RelayConfig, Vars};
use outbox::db::{Db, Statements};
use outbox::relay;
use serde::Serialize;

use crate::util::DbArgs;

/// Arguments of `outbox prune`.
#[derive(Args, Debug, Clone)]
pub struct PruneArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Delete dispatched outbox rows older than this many hours (delivered ones, for ordered topics). Dead rows
    /// are never deleted here (see --dead-letters-days). Default: what the relay uses — OUTBOX_RETENTION_HOURS,
    /// else QStash's retry horizon for QSTASH_RETRIES (default 5) plus a day, about 55 h.
    #[arg(long)]
    pub outbox_hours: Option<f64>,
    /// Delete consumer dedupe rows (`processed_messages`) and consumer sequence rows older than this many hours.
    /// Keep it longer than any redelivery or redrive can come: a younger duplicate would be applied twice.
    /// Default: PROCESSED_TTL_HOURS, else 168 (what the relay uses).
    #[arg(long)]
    pub processed_hours: Option<f64>,
    /// Delete dead letters older than this many days that are handled (redriven, or resolved = delivered after
    /// all), and dead outbox rows dead for longer than this that no unhandled dead letter refers to (their dead
    /// letter was purged or handled) and that block no ordered key. Unhandled dead letters are never pruned.
    #[arg(long, default_value_t = 30.0)]
    pub dead_letters_days: f64,
    /// Rows per statement.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100000))]
    pub batch: u32,
    /// Progress and totals as JSON lines.
    #[arg(long)]
    pub json: bool,
}

/// What `outbox prune` removed.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct PruneReport {
    /// Outbox partitions dropped whole (every row in them done; the rest moved into DEFAULT first).
    pub outbox_partitions: u64,
    /// Dispatched outbox rows deleted one by one (DEFAULT and the pre-partitioning table).
    pub outbox: u64,
    /// `processed_messages` rows.
    pub processed_messages: u64,
    /// `consumer_sequences` rows.
    pub consumer_sequences: u64,
    /// Handled dead letters.
    pub dead_letters: u64,
    /// Dead outbox rows nothing refers to.
    pub dead_events: u64,
    /// Idle ordered keys released.
    pub idle_keys: u64,
}

fn hours(name: &str, h: f64) -> anyhow::Result<Duration> {
    if !h.is_finite() || h <= 0.0 {
        bail!("{name} must be a positive number of hours (got {h})");
    }
    Ok(Duration::from_secs_f64(h * 3600.0))
}

/// Runs one step in batches until a batch comes back short, printing a line per batch.
async fn step<F, Fut>(
    out: &mut dyn Write,
    json: bool,
    name: &str,
    what: &str,
    batch: u32,
    mut one: F,
) -> anyhow::Result<u64>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<u64, sqlx::Error>>,
{
    let started = Instant::now();
    let mut total = 0u64;
    let mut batches = 0u64;
    loop {
        let n = one().await.with_context(|| {
            format!("pruning {what} (deleted {total} so far; re-run to continue)")
        })?;
        total += n;
        batches += 1;
        if n > 0 || batches == 1 {
            if json {
                writeln!(
                    out,
                    "{}",
                    serde_json::json!({"step": name, "batch": batches, "deleted": n, "total": total})
                )?;
            } else {
                writeln!(
                    out,
                    "{what}: batch {batches} deleted {n} (total {total}, {:.1}s)",
                    started.elapsed().as_secs_f64()
                )?;
            }
        }
        if n < u64::from(batch) {
            break;
        }
    }
    Ok(total)
}

/// How old rows must be to go, from the flags or the relay's own settings.
struct Ttls {
    outbox_hours: f64,
    processed_hours: f64,
    outbox_ttl: Duration,
    processed_ttl: Duration,
    dead_ttl: Duration,
}

/// The relay's own settings (same variables, same defaults) unless the flags say otherwise.
fn ttls(args: &PruneArgs) -> anyhow::Result<Ttls> {
    let env = ProcessEnv;
    let vars = Vars::new(&env);
    let relay = RelayConfig::from_vars(&vars, vars.ranged_or("QSTASH_RETRIES", 5, 0, 100)?)
        .context(
            "reading the relay's retention settings (OUTBOX_RETENTION_HOURS, PROCESSED_TTL_HOURS)",
        )?;
    let outbox_hours = args
        .outbox_hours
        .unwrap_or(relay.retention.as_secs_f64() / 3600.0);
    let processed_hours = args
        .processed_hours
        .unwrap_or(relay.processed_ttl.as_secs_f64() / 3600.0);
    let outbox_ttl = hours("--outbox-hours", outbox_hours)?;
    let processed_ttl = hours("--processed-hours", processed_hours)?;
    if !args.dead_letters_days.is_finite() || args.dead_letters_days < 0.0 {
        bail!(
            "--dead-letters-days must be 0 or more (got {})",
            args.dead_letters_days
        );
    }
    let dead_ttl = Duration::from_secs_f64(args.dead_letters_days * 86_400.0);
    Ok(Ttls {
        outbox_hours,
        processed_hours,
        outbox_ttl,
        processed_ttl,
        dead_ttl,
    })
}

/// `outbox prune`.
pub async fn run(args: PruneArgs, out: &mut dyn Write) -> anyhow::Result<PruneReport> {
    let Ttls {
        outbox_hours,
        processed_hours,
        outbox_ttl,
        processed_ttl,
        dead_ttl,
    } = ttls(&args)?;
    // Run against Postgres directly (like `outbox migrate`): named statements.
    let db = Db::new(args.db.connect().await?, Statements::Prepared);
    let b = args.batch;
    let j = args.json;
    let p = &db;
    // Whole partitions first (decision record 0067), so row retention does not delete rows one by one that a drop
    // removes at once.
    let parts = partitions_step(&db, outbox_ttl, j, out).await?;
    let mut r = PruneReport {
        outbox_partitions: parts.dropped,
        outbox: step(
            out,
            j,
            "outbox",
            &format!("dispatched outbox rows older than {outbox_hours}h"),
            b,
            || relay::prune_outbox_batch(p, outbox_ttl, b),
        )
        .await?,
        ..Default::default()
    };
    r.processed_messages = step(
        out,
        j,
        "processed_messages",
        &format!("consumer dedupe rows older than {processed_hours}h"),
        b,
        || relay::prune_processed_batch(p, processed_ttl, b),
    )
    .await?;
    r.consumer_sequences = step(
        out,
        j,
        "consumer_sequences",
        &format!("consumer sequence rows idle for {processed_hours}h"),
        b,
        || relay::prune_consumer_sequences_batch(p, processed_ttl, b),
    )
    .await?;
    r.dead_letters = step(
        out,
        j,
        "dead_letters",
        &format!(
            "handled dead letters older than {}d",
            args.dead_letters_days
        ),
        b,
        || relay::prune_dead_letters_batch(p, dead_ttl, b),
    )
    .await?;
    r.dead_events = step(
        out,
        j,
        "dead_events",
        &format!(
            "unreferenced dead outbox rows older than {}d",
            args.dead_letters_days
        ),
        b,
        || relay::prune_dead_events_batch(p, dead_ttl, b),
    )
    .await?;
    r.idle_keys = step(out, j, "idle_keys", "idle ordered keys", b, || {
        relay::release_idle_keys(p, b)
    })
    .await?;
    write_totals(&r, j, out)?;
    Ok(r)
}

/// The partition maintenance (`outbox::relay::maintain`), reported as a step.
async fn partitions_step(
    db: &Db,
    outbox_ttl: Duration,
    j: bool,
    out: &mut dyn Write,
) -> anyhow::Result<outbox::relay::PartitionReport> {
    let parts = outbox::relay::maintain(
        db,
        outbox::relay::PartitionSettings::new(outbox_ttl, Duration::from_secs(3600)),
    )
    .await;
    if let Some(e) = &parts.error {
        bail!("outbox partitions: {e}");
    }
    if j {
        writeln!(
            out,
            "{}",
            serde_json::json!({"step": "outbox_partitions", "dropped": parts.dropped, "survivors_moved": parts.survivors_moved, "created": parts.created, "busy": parts.busy, "held": parts.held})
        )?;
    } else {
        writeln!(
            out,
            "outbox_partitions: {} dropped ({} rows not done moved to DEFAULT), {} made ahead{}{}",
            parts.dropped,
            parts.survivors_moved,
            parts.created,
            if parts.busy > 0 {
                ", some busy (a transaction held the outbox): run again later"
            } else {
                ""
            },
            if parts.held > 0 {
                format!(
                    ", {} kept for a replay under way (outbox subscribers list)",
                    parts.held
                )
            } else {
                String::new()
            }
        )?;
    }
    Ok(parts)
}

/// The totals, as JSON or words.
fn write_totals(r: &PruneReport, j: bool, out: &mut dyn Write) -> anyhow::Result<()> {
    if j {
        writeln!(out, "{}", serde_json::json!({"totals": r}))?;
    } else {
        writeln!(
            out,
            "pruned: {} outbox partitions, {} outbox rows, {} dedupe rows, {} consumer sequences, {} dead letters, {} dead outbox rows, \
             {} idle keys released",
            r.outbox_partitions,
            r.outbox,
            r.processed_messages,
            r.consumer_sequences,
            r.dead_letters,
            r.dead_events,
            r.idle_keys
        )?;
        writeln!(
            out,
            "unhandled dead letters are never pruned: `outbox status` counts them; redrive or purge them"
        )?;
    }
    Ok(())
}
