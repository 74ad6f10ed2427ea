//! `outbox-dev bench cost`: the cost model, measured. Each configuration (`plan.rs`: the seed's one message and
//! one delivery callback per event, the template's defaults, fan-out to 3 subscribers, the defaults with delivery
//! callbacks; ordered and unordered) runs at a steady rate through the real handlers (`measure.rs`); the counts
//! per million events (`model.rs`) are QStash's messages billed, retries, API requests and bytes (the dev
//! server's own counters), each function's invocations and GB-seconds (the handlers' timed invocations; the
//! relay's schedule a fixed monthly cost), Postgres CPU seconds and WAL bytes (`postgres.rs`). The prices
//! (`prices.rs`, with their sources and dates) are applied to the counts, never mixed into them; `report.rs`
//! writes the section of `benchmarks.md`, its plot and the README's block. What the model leaves out: decision
//! record 0075.

use clap::Args;
use outbox_cli::util::DbArgs;
use serde_json::{Value, json};

pub mod measure;
pub mod model;
pub mod plan;
pub mod postgres;
pub mod prices;
pub mod report;

/// `outbox-dev bench cost`.
#[derive(Args, Debug)]
pub struct CostArgs {
    /// Small sizes and 6-second relay invocations (seconds per configuration): for checking the command.
    #[arg(long)]
    pub quick: bool,
    /// Events per second the producer commits.
    #[arg(long, default_value_t = 200)]
    pub rate: u32,
    /// Run only these configurations (comma-separated names, e.g. `seed-unordered,defaults-ordered`); not with
    /// `--report`.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Also write the figures into DIR/benchmarks.md (its cost section), DIR/benchmarks/figures.json and the plot,
    /// and the cost block of the README beside DIR (`--report docs`).
    #[arg(long)]
    pub report: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub db: DbArgs,
}

/// Runs the configurations `only` names (all when empty) and returns the run: raw counts per configuration, the
/// model over them, the deployment and the prices.
pub async fn measure_run(
    database_url: &str,
    plan: &plan::Plan,
    only: &[String],
    mode: &str,
) -> anyhow::Result<Value> {
    use crate::bench::support::{DevServerProcess, ScratchDb, load_average};
    let deployment = prices::Deployment::from_template()?;
    let scenarios: Vec<plan::Scenario> = plan::scenarios()
        .into_iter()
        .filter(|s| only.is_empty() || only.contains(&s.name))
        .collect();
    if scenarios.is_empty() {
        anyhow::bail!("no configuration named {only:?}");
    }
    let load_before = load_average();
    let db = ScratchDb::create(database_url, "outbox_bench_cost").await?;
    let dev = DevServerProcess::start(&["--deliver", "true"]).await?;
    let rig = measure::Rig::start(&db).await?;
    let result = async {
        let mut runs = Vec::new();
        for s in &scenarios {
            let r = measure::scenario(&db, &dev, &rig, s, plan, &deployment).await?;
            let c = model::counts(&r, &deployment);
            println!(
                "cost {}: {} events, per million events: {:.0} QStash messages ({:.0} publishes + {:.0} callbacks), \
                 {:.0} consumer invocations, {:.0} callback invocations; relay invocations (ms): {}",
                s.name,
                r["events"],
                c["qstash_messages"].as_f64().unwrap_or(f64::NAN),
                c["qstash_publishes"].as_f64().unwrap_or(f64::NAN),
                c["qstash_callbacks"].as_f64().unwrap_or(f64::NAN),
                c["consumer_invocations"].as_f64().unwrap_or(f64::NAN),
                c["callback_invocations"].as_f64().unwrap_or(f64::NAN),
                r["relay"]["durations_ms"]
                    .as_array()
                    .map(|a| a.iter().map(|d| format!("{:.0}", d.as_f64().unwrap_or(f64::NAN))))
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>()
                    .join(", "),
            );
            runs.push(r);
        }
        anyhow::Ok(runs)
    }
    .await;
    rig.stop();
    dev.stop().await;
    db.drop_now().await?;
    let runs = result?;
    Ok(json!({
        "generated_at": chrono::Utc::now().to_rfc3339(),
        "mode": mode,
        "rate": plan.rate,
        "produce_secs": plan.produce.as_secs_f64(),
        "keys": plan.keys,
        "load_before": load_before,
        "load_after": load_average(),
        "deployment": deployment,
        "peak_rss_mb": outbox_cli::relay_cmd::peak_rss_kib().map(|k| k as f64 / 1024.0),
        "prices": prices::PRICES.iter().map(|p| json!({
            "key": p.key, "item": p.item, "usd": p.usd, "per": p.per, "unit": p.unit,
            "source": p.source, "read": p.read, "note": p.note,
        })).collect::<Vec<_>>(),
        "model": model::model(&runs, &deployment),
        "runs": runs,
    }))
}

/// `outbox-dev bench cost`: each configuration's counts as it ends, then one `BENCH_JSON` line; `--report`
/// writes the section, the plot, the figures and the README's block.
pub async fn run(args: CostArgs) -> anyhow::Result<()> {
    if !args.only.is_empty() && args.report.is_some() {
        anyhow::bail!("--report needs every configuration: leave out --only");
    }
    let plan = plan::Plan::new(args.quick, args.rate);
    let mode = if args.quick { "quick" } else { "full" };
    let run = measure_run(&args.db.database_url, &plan, &args.only, mode).await?;
    println!(
        "BENCH_JSON {}",
        serde_json::to_string(&json!({ report::KEY: run }))?
    );
    if let Some(dir) = &args.report {
        for path in report::write(dir, &run)? {
            println!("wrote {}", path.display());
        }
        let readme = dir.join("..").join("README.md");
        let figures: Value = serde_json::from_str(&std::fs::read_to_string(
            dir.join("benchmarks").join("figures.json"),
        )?)?;
        if readme.is_file() && crate::bench::report::readme::update(&readme, &figures)? {
            println!("wrote the blocks of {}", readme.display());
        }
    }
    Ok(())
}
