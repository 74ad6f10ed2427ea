//! `outbox-dev bench report`: every scenario, each beside a baseline measured in the same run, written as one
//! self-contained report — `<out>/benchmarks.md`, plots as `<out>/benchmarks/*.svg` and every figure in
//! `<out>/benchmarks/figures.json` — and printed to stdout. Medians over rounds and ratios to the same-run
//! baseline, because these small shared machines are noisy; the machine and the Postgres settings that matter
//! are read at run time and written next to the figures. The figures README.md quotes are rewritten from the
//! same figures ([`readme`]).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use outbox_testkit::median;
use serde_json::{Value, json};

use super::batched;
use super::plot::{self, Series, XScale};
use super::relay;
use super::support::{DevServerProcess, Knobs, Machine, ScratchDb, load_average};
use super::{consumer, steady, xmin};

mod args;
mod figures;
mod markdown;
mod plan;
pub mod readme;

pub use args::ReportArgs;
pub use figures::{cpu_ceiling, in_flight, unordered_targets};

use markdown::markdown;
use plan::Plan;

/// The scenario keys of `figures.json`, in report order.
pub const SCENARIOS: [&str; 7] = [
    "relay_unordered_by_batch",
    "relay_unordered_by_concurrency",
    "relay_ordered_by_keys",
    "consumer",
    "commit_to_applied",
    "xmin_pin",
    "batched_deliveries",
];

/// One unordered point: the relay and the SQL-only cycle at the same settings, alternating, `rounds` times.
async fn unordered_point(
    db: &ScratchDb,
    dev: &DevServerProcess,
    events: u64,
    knobs: Knobs,
    rounds: usize,
) -> anyhow::Result<Value> {
    let (mut relay, mut sql, mut rss, mut cpu_relay, mut cpu_dev) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 1..=rounds {
        sql.push(
            relay::unordered_sql_only_rate(db, events, knobs.batch, knobs.concurrency, true)
                .await?,
        );
        let r = relay::unordered_relay_run(db, dev, events, knobs).await?;
        println!(
            "  round {round}: relay {:>7.0}/s, SQL-only {:>7.0}/s ({:.0} %), CPU per event: relay {:.1} µs, dev \
             server {:.1} µs",
            r.events_per_sec,
            sql[round - 1],
            100.0 * r.events_per_sec / sql[round - 1],
            r.relay_cpu_us,
            r.dev_cpu_us
        );
        relay.push(r.events_per_sec);
        rss.push(r.peak_rss_mb);
        cpu_relay.push(r.relay_cpu_us);
        cpu_dev.push(r.dev_cpu_us);
    }
    let (r, s) = (median(&relay), median(&sql));
    println!(
        "unordered batch {:>4}, concurrency {:>2}: relay {r:>7.0}/s, SQL-only {s:>7.0}/s ({:.0} %)",
        knobs.batch,
        knobs.concurrency,
        100.0 * r / s
    );
    Ok(json!({
        "batch": knobs.batch, "concurrency": knobs.concurrency,
        "relay_events_per_sec": relay, "relay_median": r,
        "sql_only_events_per_sec": sql, "sql_only_median": s,
        "relay_vs_sql_only": r / s,
        "relay_vs_sql_only_per_round": relay.iter().zip(&sql).map(|(r, s)| r / s).collect::<Vec<f64>>(),
        "relay_peak_rss_mb": rss.iter().cloned().fold(0.0, f64::max),
        "relay_cpu_us_per_event": median(&cpu_relay), "dev_server_cpu_us_per_event": median(&cpu_dev),
    }))
}

/// Unordered relay throughput by batch size and by concurrency (one database and dev server for all points;
/// the point both sweeps share is measured once).
async fn unordered_sweeps(base_url: &str, plan: &Plan) -> anyhow::Result<(Value, Value)> {
    let db = ScratchDb::create(base_url, "outbox_bench_report").await?;
    let dev = DevServerProcess::start(&["--deliver", "false"]).await?;
    let result = async {
        let mut by_batch = Vec::new();
        let mut shared = None;
        for &batch in &plan.batches {
            let knobs = Knobs { batch, ..plan.base };
            let p = unordered_point(&db, &dev, plan.unordered_events, knobs, plan.rounds).await?;
            if batch == plan.base.batch {
                shared = Some(p.clone());
            }
            by_batch.push(p);
        }
        let mut by_conc = Vec::new();
        for &concurrency in &plan.concurrencies {
            let knobs = Knobs {
                concurrency,
                ..plan.base
            };
            let p = match (&shared, concurrency == plan.base.concurrency) {
                (Some(p), true) => p.clone(),
                _ => unordered_point(&db, &dev, plan.unordered_events, knobs, plan.rounds).await?,
            };
            by_conc.push(p);
        }
        let common = |fixed: &str, v: u32, points: Vec<Value>| {
            json!({ "events": plan.unordered_events, "rounds": plan.rounds, fixed: v,
                    "qstash_batch": plan.base.qstash_batch, "points": points })
        };
        Ok::<_, anyhow::Error>((
            common("concurrency", plan.base.concurrency, by_batch),
            common("batch", plan.base.batch, by_conc),
        ))
    }
    .await;
    dev.stop().await;
    db.drop_now().await?;
    result
}

/// Ordered throughput end to end (evidence from the consumer) by number of keys, beside the SQL-only ordered
/// protocol on the same rows.
async fn ordered_sweep(base_url: &str, plan: &Plan) -> anyhow::Result<Value> {
    let db = ScratchDb::create(base_url, "outbox_bench_report_ordered").await?;
    let (dev, rig) = relay::ordered_rig(&db).await?;
    let result = async {
        let mut points = Vec::new();
        for &(keys, per_key) in &plan.ordered {
            let (mut relay_rates, mut sql, mut to_evidence, mut to_next) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for _ in 0..plan.rounds {
                sql.push(relay::ordered_sql_only_rate(
                    &db,
                    keys,
                    per_key,
                    plan.base,
                    outbox::config::DEFAULT_DELIVERY_BATCH,
                )
                .await?);
                let o = relay::ordered_relay_run(&db, &dev, &rig, keys, per_key, plan.base, "consumer", &[])
                    .await?;
                relay_rates.push(o.events_per_sec);
                to_evidence.push(o.to_evidence_ms);
                to_next.push(o.to_next_ms);
            }
            let (r, s) = (median(&relay_rates), median(&sql));
            println!(
                "ordered {keys:>5} keys x {per_key}: relay {r:>7.0}/s, SQL-only ordered {s:>7.0}/s ({:.0} %)",
                100.0 * r / s
            );
            points.push(json!({
                "keys": keys, "events": keys * per_key,
                "relay_events_per_sec": relay_rates, "relay_median": r,
                "sql_only_events_per_sec": sql, "sql_only_median": s,
                "relay_vs_sql_only": r / s,
                "accepted_to_evidence_ms_median": median(&to_evidence),
                "evidence_to_next_accepted_ms_median": median(&to_next),
            }));
        }
        Ok::<_, anyhow::Error>(json!({
            "rounds": plan.rounds, "evidence": "consumer", "batch": plan.base.batch,
            "concurrency": plan.base.concurrency, "points": points,
        }))
    }
    .await;
    let _ = rig.stop.send(true);
    dev.stop().await;
    db.drop_now().await?;
    result
}

fn points(v: &Value, x: &str, y: &str) -> Vec<(f64, f64)> {
    v["points"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .map(|p| {
                    (
                        p[x].as_f64().unwrap_or(f64::NAN),
                        p[y].as_f64().unwrap_or(f64::NAN),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Runs every scenario and writes the report.
pub async fn run(args: ReportArgs) -> anyhow::Result<()> {
    let plan = Plan::from(&args);
    let started = Instant::now();
    let base_url = args.db.database_url.clone();
    let machine = {
        let pool = outbox_cli::util::connect(&base_url).await?;
        let m = Machine::read(&pool).await?;
        pool.close().await;
        m
    };
    println!(
        "benchmark report ({}): {} CPU(s) {}, {:.1} GiB, {}; load {:?}",
        if plan.quick { "quick" } else { "full" },
        machine.cpus,
        machine.cpu_model,
        machine.memory_gib,
        machine.postgres_version,
        machine.load_before
    );
    let plots_dir = args.out.join("benchmarks");
    std::fs::create_dir_all(&plots_dir)
        .with_context(|| format!("creating {}", plots_dir.display()))?;

    // First: the scenario that depends most on recent code fails fastest here.
    let batched_out = batched::run(&base_url, &plan.batched, plan.base).await?;
    let (by_batch, by_conc) = unordered_sweeps(&base_url, &plan).await?;
    let ordered = ordered_sweep(&base_url, &plan).await?;
    let cons = consumer::run(
        &base_url,
        consumer::ConsumerPlan {
            rounds: plan.rounds,
            secs: plan.consumer_secs,
            concurrency: 16,
            pool: 8,
            ping_always: false,
        },
    )
    .await?;
    let mut steady = steady::run(
        &base_url,
        plan.steady_rate,
        plan.steady_secs,
        plan.base,
        &[],
    )
    .await?;
    let xmin_out = xmin::run(&base_url, plan.xmin_events, plan.rounds, plan.base).await?;
    let load_after = load_average();
    let elapsed = started.elapsed().as_secs_f64();

    // Plots.
    plot::lines(
        &plots_dir.join("relay-by-batch.svg"),
        &format!(
            "Unordered relay vs SQL-only limit by batch size ({} in flight)",
            plan.base.concurrency
        ),
        "rows per claim (log scale)",
        "events/s",
        XScale::Log,
        &[
            Series::new(
                "relay → dev server",
                points(&by_batch, "batch", "relay_median"),
            ),
            Series::new(
                "SQL-only claim+settle",
                points(&by_batch, "batch", "sql_only_median"),
            ),
        ],
    )?;
    plot::lines(
        &plots_dir.join("relay-by-concurrency.svg"),
        &format!(
            "Unordered relay vs SQL-only limit by concurrency (batch {})",
            plan.base.batch
        ),
        "cycles in flight (log scale)",
        "events/s",
        XScale::Log,
        &[
            Series::new(
                "relay → dev server",
                points(&by_conc, "concurrency", "relay_median"),
            ),
            Series::new(
                "SQL-only claim+settle",
                points(&by_conc, "concurrency", "sql_only_median"),
            ),
        ],
    )?;
    plot::lines(
        &plots_dir.join("ordered-by-keys.svg"),
        "Ordered events/s by number of keys",
        "keys (log scale)",
        "events/s",
        XScale::Log,
        &[
            Series::new(
                "relay → dev server → consumer",
                points(&ordered, "keys", "relay_median"),
            ),
            Series::new(
                "SQL-only ordered protocol",
                points(&ordered, "keys", "sql_only_median"),
            ),
        ],
    )?;
    plot::lines(
        &plots_dir.join("consumer-latency.svg"),
        "Consumer latency per delivery (distribution to p99)",
        "ms",
        "% of deliveries at or below",
        XScale::Linear,
        &[Series::cdf(
            "verify + dedupe + handler + commit",
            &cons.latencies_ms,
            0.99,
        )],
    )?;
    let samples = |k: &str| -> Vec<f64> {
        steady["samples_ms"][k]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default()
    };
    plot::lines(
        &plots_dir.join("commit-to-applied.svg"),
        &format!(
            "Commit → applied at a steady {} events/s (distribution to p99)",
            plan.steady_rate
        ),
        "ms after the producer's commit",
        "% of events at or below",
        XScale::Linear,
        &[
            Series::cdf(
                "dispatched (accepted by the dev server)",
                &samples("dispatched"),
                0.99,
            ),
            Series::cdf("applied by the consumer", &samples("applied"), 0.99),
        ],
    )?;
    if let Some(obj) = steady.as_object_mut() {
        obj.remove("samples_ms");
    }
    let mut xmin_out = xmin_out;
    let xmin_series: Vec<Series> = xmin_out["phases"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .map(|p| {
                    let claims: Vec<f64> = p["samples_claim_ms"]
                        .as_array()
                        .map(|a| a.iter().filter_map(Value::as_f64).collect())
                        .unwrap_or_default();
                    Series::cdf(p["phase"].as_str().unwrap_or("?"), &claims, 0.99)
                })
                .collect()
        })
        .unwrap_or_default();
    plot::lines(
        &plots_dir.join("xmin-pin-claims.svg"),
        "Claim latency: no pin, under an xmin pin, after release (distribution to p99)",
        "claim ms",
        "% of claims at or below",
        XScale::Linear,
        &xmin_series,
    )?;
    if let Some(phases) = xmin_out["phases"].as_array_mut() {
        for p in phases {
            if let Some(obj) = p.as_object_mut() {
                obj.remove("samples_claim_ms");
            }
        }
    }

    batched::plot(&batched_out, &plots_dir.join(batched::SVG))?;

    let mut targets = batched::targets(&batched_out);
    targets.extend(unordered_targets(&by_batch, &by_conc));
    let mut figures = json!({
        "targets": targets,
        "generated_at": chrono::Utc::now().to_rfc3339(),
        "mode": if plan.quick { "quick" } else { "full" },
        "rounds": plan.rounds,
        "duration_secs": elapsed,
        "machine": machine,
        "load_after": load_after,
        "scenarios": {
            "relay_unordered_by_batch": by_batch,
            "relay_unordered_by_concurrency": by_conc,
            "relay_ordered_by_keys": ordered,
            "consumer": cons.to_json(),
            "commit_to_applied": steady,
            "xmin_pin": xmin_out,
            "batched_deliveries": batched_out,
        },
    });
    // The sustained-load, fan-out and cost runs (`bench sustained --report`, `bench fanout --report`, `bench cost
    // --report`) are not part of this report's run: kept as they were.
    if let Ok(old) = std::fs::read_to_string(plots_dir.join("figures.json"))
        && let Ok(old) = serde_json::from_str::<Value>(&old)
    {
        for key in super::sustained::report::KEYS
            .iter()
            .chain([&super::fanout::report::KEY, &super::cost::report::KEY])
        {
            if old[key].is_object() {
                figures[key] = old[key].clone();
            }
        }
    }
    std::fs::write(
        plots_dir.join("figures.json"),
        serde_json::to_string_pretty(&figures)? + "\n",
    )?;
    let md = super::sustained::report::with_section(
        &markdown(&figures, &plan),
        &super::sustained::report::section(&figures),
    );
    let md = super::fanout::report::with_section(&md, &super::fanout::report::section(&figures));
    let md = super::support::splice_section(
        &md,
        super::cost::report::BEGIN,
        super::cost::report::END,
        &super::cost::report::section(&figures),
    );
    std::fs::write(args.out.join("benchmarks.md"), &md)?;
    let readme_path = args
        .readme
        .clone()
        .unwrap_or_else(|| args.out.join("..").join("README.md"));
    let readme_written = readme_path.is_file() && readme::update(&readme_path, &figures)?;
    println!("\n{md}");
    println!("BENCH_JSON {}", figures);
    batched::print_targets(figures["targets"].as_array().map_or(&[][..], Vec::as_slice));
    println!(
        "wrote {}, {}/*.svg and {} in {elapsed:.0} s",
        args.out.join("benchmarks.md").display(),
        plots_dir.display(),
        plots_dir.join("figures.json").display()
    );
    if readme_written {
        println!("rewrote the figures block of {}", readme_path.display());
    }
    Ok(())
}

/// Where a report run put its files (the test checks them).
pub fn files(out: &Path) -> Vec<PathBuf> {
    let dir = out.join("benchmarks");
    let mut v = vec![out.join("benchmarks.md"), dir.join("figures.json")];
    for svg in [
        "relay-by-batch.svg",
        "relay-by-concurrency.svg",
        "ordered-by-keys.svg",
        "consumer-latency.svg",
        "commit-to-applied.svg",
        "xmin-pin-claims.svg",
        batched::SVG,
    ] {
        v.push(dir.join(svg));
    }
    v
}
