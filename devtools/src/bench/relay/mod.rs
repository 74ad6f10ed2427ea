//! `outbox-dev bench relay`: relay throughput against the QStash-compatible dev server, beside a SQL-only
//! claim+settle cycle on the same schema in the same run; claim latency with a large backlog and history; the
//! relay's peak RSS (the relay runs as its own process: the operator CLI's `outbox relay --until-empty`).

use std::time::Instant;

use clap::Args;
use serde_json::{Value, json};

use outbox_cli::util::DbArgs;
use outbox_testkit::median;

use super::support::{DevServerProcess, Knobs, ScratchDb};

mod measure;

pub(crate) use measure::*;
pub use measure::{OrderedRun, RelayRun};

#[derive(Args, Debug)]
pub struct RelayBenchArgs {
    /// Unordered events per run (200-byte JSON payloads).
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// Runs of each measurement (medians are reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Rows per claim.
    #[arg(long, default_value_t = 500)]
    batch: u32,
    /// Cycles in flight at once in the relay. The SQL-only baseline runs at 2 and at this concurrency and the
    /// better of the two is the baseline (the database's limit).
    #[arg(long, default_value_t = 8)]
    concurrency: u32,
    /// Messages per /v2/batch request.
    #[arg(long, default_value_t = 250)]
    qstash_batch: u32,
    /// Skip the claim-latency-at-scale measurement (it seeds millions of rows).
    #[arg(long)]
    skip_scale: bool,
    /// Skip the unordered measurement.
    #[arg(long)]
    skip_unordered: bool,
    /// Skip the ordered measurement.
    #[arg(long)]
    skip_ordered: bool,
    /// Ordered events per run.
    #[arg(long, default_value_t = 50_000)]
    ordered_events: u64,
    /// Ordered keys the events are spread over.
    #[arg(long, default_value_t = 1_000)]
    ordered_keys: u64,
    /// Pending rows for the scale measurement.
    #[arg(long, default_value_t = 1_000_000)]
    scale_pending: u64,
    /// Dispatched (history) rows for the scale measurement.
    #[arg(long, default_value_t = 5_000_000)]
    scale_history: u64,
    #[command(flatten)]
    db: DbArgs,
}

impl RelayBenchArgs {
    fn knobs(&self) -> Knobs {
        Knobs {
            batch: self.batch,
            concurrency: self.concurrency,
            qstash_batch: self.qstash_batch,
        }
    }
}

/// Scenario: unordered relay throughput beside the SQL-only cycle (async commit at 2 and at the configured
/// concurrency, the better one; and synchronous commit).
async fn unordered(args: &RelayBenchArgs) -> anyhow::Result<Value> {
    let knobs = args.knobs();
    let mut base_sync = Vec::new();
    let mut base_async = Vec::new();
    let mut runs: Vec<RelayRun> = Vec::new();
    let db = ScratchDb::create(&args.db.database_url, "outbox_bench_relay").await?;
    let dev = DevServerProcess::start(&["--deliver", "false"]).await?;
    for run in 1..=args.runs {
        let mut best = 0f64;
        for c in [2, args.concurrency] {
            best = best.max(unordered_sql_only_rate(&db, args.events, args.batch, c, true).await?);
        }
        base_async.push(best);
        base_sync.push(
            unordered_sql_only_rate(&db, args.events, args.batch, args.concurrency, false).await?,
        );
        let r = unordered_relay_run(&db, &dev, args.events, knobs).await?;
        println!(
            "run {run}: sql-only {:>8.0}/s (async commit) {:>8.0}/s (sync commit) | relay {:>8.0}/s, publish p50 {:.1} ms, peak RSS {:.1} MB\n  \
             CPU per event on the database's cores: relay {:.1} µs, dev server {:.1} µs",
            base_async[run - 1],
            base_sync[run - 1],
            r.events_per_sec,
            r.publish_p50_ms,
            r.peak_rss_mb,
            r.relay_cpu_us,
            r.dev_cpu_us,
        );
        runs.push(r);
    }
    dev.stop().await;
    db.drop_now().await?;
    let relay: Vec<f64> = runs.iter().map(|r| r.events_per_sec).collect();
    let rss: Vec<f64> = runs.iter().map(|r| r.peak_rss_mb).collect();
    let cpu_relay: Vec<f64> = runs.iter().map(|r| r.relay_cpu_us).collect();
    let cpu_dev: Vec<f64> = runs.iter().map(|r| r.dev_cpu_us).collect();
    let (r, b, bs) = (median(&relay), median(&base_async), median(&base_sync));
    println!(
        "\nunordered: relay {r:.0} events/s (median of {}), SQL-only cycle {b:.0}/s with the relay's async commit \
         ({bs:.0}/s synchronous) -> relay at {:.0}% of the same-run SQL-only cycle; relay peak RSS {:.1} MB; \
         CPU per event: relay {:.1} µs, dev server {:.1} µs (both take it from Postgres on this machine)",
        relay.len(),
        100.0 * r / b,
        rss.iter().cloned().fold(0.0, f64::max),
        median(&cpu_relay),
        median(&cpu_dev)
    );
    Ok(json!({
        "relay_events_per_sec": relay, "relay_median": r,
        "sql_only_async_commit": base_async, "sql_only_async_median": b,
        "sql_only_sync_commit": base_sync, "sql_only_sync_median": bs,
        "relay_vs_sql_only": r / b,
        "relay_cpu_us_per_event": cpu_relay, "dev_server_cpu_us_per_event": cpu_dev,
        "relay_peak_rss_mb": rss,
    }))
}

/// Scenario: ordered relay throughput end to end (callback evidence, then consumer evidence) beside the SQL-only
/// ordered protocol.
async fn ordered(args: &RelayBenchArgs) -> anyhow::Result<Value> {
    let knobs = args.knobs();
    let per_key = (args.ordered_events / args.ordered_keys).max(1);
    let n = per_key * args.ordered_keys;
    let db = ScratchDb::create(&args.db.database_url, "outbox_bench_ordered").await?;
    let (dev, rig) = ordered_rig(&db).await?;
    let mut base = Vec::new();
    let mut rates = Vec::new();
    let mut rates_consumer = Vec::new();
    for run in 1..=args.runs {
        base.push(
            ordered_sql_only_rate(
                &db,
                args.ordered_keys,
                per_key,
                knobs,
                outbox::config::DEFAULT_DELIVERY_BATCH,
            )
            .await?,
        );
        for (mode, rates) in [("callback", &mut rates), ("consumer", &mut rates_consumer)] {
            let o = ordered_relay_run(
                &db,
                &dev,
                &rig,
                args.ordered_keys,
                per_key,
                knobs,
                mode,
                &[],
            )
            .await?;
            rates.push(o.events_per_sec);
            println!(
                "ordered run {run}, evidence from the {mode}: {n} events over {} keys: relay {:>7.0}/s (SQL-only ordered cycle {:>7.0}/s)\n  \
                 per key, median: accepted → evidence {:.1} ms, evidence → next accepted {:.1} ms\n  \
                 CPU per event: relay {:.0} µs, dev server {:.0} µs, receivers in this process {:.0} µs (Postgres not counted)",
                args.ordered_keys,
                o.events_per_sec,
                base[run - 1],
                o.to_evidence_ms,
                o.to_next_ms,
                o.relay_cpu_us,
                o.dev_cpu_us,
                o.receivers_cpu_us,
            );
        }
    }
    let _ = rig.stop.send(true);
    dev.stop().await;
    db.drop_now().await?;
    println!(
        "ordered over {} keys (medians): relay {:.0} events/s with QStash delivery callbacks, {:.0} events/s with \
         evidence recorded by the consumer; SQL-only ordered cycle {:.0}/s",
        args.ordered_keys,
        median(&rates),
        median(&rates_consumer),
        median(&base)
    );
    Ok(json!({
        "events": n, "keys": args.ordered_keys,
        "relay_events_per_sec_callback_evidence": rates, "relay_median_callback_evidence": median(&rates),
        "relay_events_per_sec_consumer_evidence": rates_consumer, "relay_median_consumer_evidence": median(&rates_consumer),
        "sql_only": base, "sql_only_median": median(&base),
    }))
}

/// Scenario: claim latency with 1k pending and no history, then with a large backlog and history.
async fn claim_at_scale(args: &RelayBenchArgs) -> anyhow::Result<Value> {
    let sdb = ScratchDb::create(&args.db.database_url, "outbox_bench_scale").await?;
    seed_unordered(&sdb.pool, 1_000).await?;
    let (small_p50, small_p99) = claim_latency_ms(&sdb.pool, args.batch, 100).await?;
    println!(
        "claim latency, 1k pending / no history: p50 {small_p50:.2} ms, p99 {small_p99:.2} ms"
    );
    println!(
        "seeding {} history rows and {} pending rows...",
        args.scale_history, args.scale_pending
    );
    let t = Instant::now();
    let chunk = 1_000_000u64;
    let mut left = args.scale_history;
    while left > 0 {
        let n = left.min(chunk);
        sqlx::query(
            "INSERT INTO outbox (topic, partition_key, payload, dispatched_at, attempts) \
             SELECT 'bench', 'k' || (g % 1000), jsonb_build_object('i', g, 'pad', repeat('x', 176)), now(), 1 \
             FROM generate_series(1, $1::bigint) g",
        )
        .bind(n as i64)
        .execute(&sdb.pool)
        .await?;
        left -= n;
    }
    sqlx::query(SEED_SQL)
        .bind(args.scale_pending as i64)
        .execute(&sdb.pool)
        .await?;
    sqlx::query("VACUUM ANALYZE outbox")
        .execute(&sdb.pool)
        .await?;
    println!("  seeded in {:.0} s", t.elapsed().as_secs_f64());
    let (big_p50, big_p99) = claim_latency_ms(&sdb.pool, args.batch, 100).await?;
    println!(
        "claim latency, {} pending / {} history: p50 {big_p50:.2} ms, p99 {big_p99:.2} ms (ratio {:.2}x)",
        args.scale_pending,
        args.scale_history,
        big_p50 / small_p50
    );
    sdb.drop_now().await?;
    Ok(json!({
        "small_p50_ms": small_p50, "small_p99_ms": small_p99,
        "large_p50_ms": big_p50, "large_p99_ms": big_p99,
        "ratio_p50": big_p50 / small_p50,
        "pending": args.scale_pending, "history": args.scale_history,
    }))
}

/// `outbox-dev bench relay`: the scenarios not skipped, then one `BENCH_JSON` line.
pub async fn run(args: RelayBenchArgs) -> anyhow::Result<()> {
    println!(
        "relay benchmark: {} events x {} runs, batch {}, concurrency {}",
        args.events, args.runs, args.batch, args.concurrency
    );
    let unordered = if args.skip_unordered {
        json!(null)
    } else {
        unordered(&args).await?
    };
    let ordered = if args.skip_ordered {
        json!(null)
    } else {
        ordered(&args).await?
    };
    let scale = if args.skip_scale {
        json!(null)
    } else {
        claim_at_scale(&args).await?
    };
    println!(
        "BENCH_JSON {}",
        json!({
            "bench": "relay",
            "events": args.events, "runs": args.runs, "batch": args.batch, "concurrency": args.concurrency,
            "qstash_batch": args.qstash_batch,
            "relay_peak_rss_mb": unordered["relay_peak_rss_mb"].clone(),
            "unordered": unordered,
            "ordered": ordered,
            "claim_latency_at_scale": scale,
        })
    );
    Ok(())
}
