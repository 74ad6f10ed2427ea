//! `outbox-dev bench batched`: the scenario alone, its arguments, and what it prints (the report's section, the
//! targets, one `BENCH_JSON` line).

use clap::Args;
use outbox_cli::util::DbArgs;
use serde_json::json;

use super::chart::plot;
use super::markdown::markdown;
use super::measure::run;
use super::plan::{BatchedPlan, default_ns};
use super::targets::{print_targets, targets};
use crate::bench::support::Knobs;

/// `outbox-dev bench batched`: only this scenario (e.g. to compare candidate defaults), printed as the report's
/// section plus one `BENCH_JSON` line; `--svg` also draws the plot.
#[derive(Args, Debug)]
pub struct BatchedArgs {
    /// Events per QStash message to compare (`RELAY_DELIVERY_BATCH` of the relay), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = default_ns())]
    pub delivery_batch: Vec<u32>,
    /// Small sizes (seconds per N): for checking the command.
    #[arg(long)]
    pub quick: bool,
    /// Rounds per throughput point (default 3; 1 with --quick).
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Pending events on the hot key (default 10000; 200 with --quick).
    #[arg(long)]
    pub hot_key_events: Option<u64>,
    /// Write the plot to this SVG file.
    #[arg(long)]
    pub svg: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub db: DbArgs,
}

/// `outbox-dev bench batched`.
pub async fn run_cli(args: BatchedArgs) -> anyhow::Result<()> {
    let rounds = args.rounds.unwrap_or(if args.quick { 1 } else { 3 });
    let mut plan = BatchedPlan::new(&args.delivery_batch, args.quick, rounds);
    if let Some(h) = args.hot_key_events {
        plan.hot_key_events = h;
    }
    let knobs = Knobs {
        batch: 500,
        concurrency: 8,
        qstash_batch: 250,
    };
    println!(
        "batched deliveries: N = {:?}, {} round(s) per point",
        plan.ns, plan.rounds
    );
    let v = run(&args.db.database_url, &plan, knobs).await?;
    if let Some(svg) = &args.svg {
        plot(&v, svg)?;
    }
    println!("\n{}", markdown(&v));
    print_targets(&targets(&v));
    println!(
        "BENCH_JSON {}",
        json!({"bench": "batched", "figures": v, "targets": targets(&v)})
    );
    Ok(())
}
