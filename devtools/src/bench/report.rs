//! `outbox-dev bench report`: every scenario, each beside a baseline measured in the same run, written as one
//! self-contained report — `<out>/benchmarks.md`, plots as `<out>/benchmarks/*.svg` and every figure in
//! `<out>/benchmarks/figures.json` — and printed to stdout. Medians over rounds and ratios to the same-run
//! baseline, because these small shared machines are noisy; the machine and the Postgres settings that matter
//! are read at run time and written next to the figures.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use outbox_cli::util::DbArgs;
use outbox_testkit::median;
use serde_json::{Value, json};

use super::plot::{self, Series, XScale};
use super::relay::{self, Knobs};
use super::support::{DevServerProcess, Machine, ScratchDb, load_average};
use super::{consumer, steady, xmin};

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Small sizes and one round per point (about two minutes in a release build): CI, a quick look. The
    /// figures are for checking the command, not for quoting.
    #[arg(long)]
    quick: bool,
    /// Directory for `benchmarks.md`; plots and `figures.json` go to its `benchmarks/` subdirectory.
    #[arg(long, default_value = "docs")]
    out: PathBuf,
    /// Rounds per measured point (default 3; 1 with --quick).
    #[arg(long)]
    rounds: Option<usize>,
    /// Events per phase of the xmin-pin scenario (default 100000; 10000 with --quick).
    #[arg(long)]
    xmin_events: Option<u64>,
    #[command(flatten)]
    db: DbArgs,
}

/// Sizes of one report run.
struct Plan {
    quick: bool,
    rounds: usize,
    unordered_events: u64,
    batches: Vec<u32>,
    concurrencies: Vec<u32>,
    base: Knobs,
    /// (keys, events per key).
    ordered: Vec<(u64, u64)>,
    consumer_secs: f64,
    steady_rate: u32,
    steady_secs: f64,
    xmin_events: u64,
}

impl Plan {
    fn from(args: &ReportArgs) -> Plan {
        let base = Knobs {
            batch: 500,
            concurrency: 8,
            qstash_batch: 250,
        };
        if args.quick {
            Plan {
                quick: true,
                rounds: args.rounds.unwrap_or(1),
                unordered_events: 5_000,
                batches: vec![100, 500],
                concurrencies: vec![2, 8],
                base,
                ordered: vec![(10, 10), (100, 4)],
                consumer_secs: 1.0,
                steady_rate: 50,
                steady_secs: 3.0,
                xmin_events: args.xmin_events.unwrap_or(10_000),
            }
        } else {
            Plan {
                quick: false,
                rounds: args.rounds.unwrap_or(3),
                unordered_events: 50_000,
                batches: vec![50, 100, 250, 500, 1000],
                concurrencies: vec![1, 2, 4, 8, 16],
                base,
                ordered: vec![(10, 50), (100, 20), (1000, 10)],
                consumer_secs: 3.0,
                steady_rate: 200,
                steady_secs: 20.0,
                xmin_events: args.xmin_events.unwrap_or(100_000),
            }
        }
    }
}

/// The scenario keys of `figures.json`, in report order.
pub const SCENARIOS: [&str; 6] = [
    "relay_unordered_by_batch",
    "relay_unordered_by_concurrency",
    "relay_ordered_by_keys",
    "consumer",
    "commit_to_applied",
    "xmin_pin",
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
    for _ in 0..rounds {
        sql.push(
            relay::unordered_sql_only_rate(db, events, knobs.batch, knobs.concurrency, true)
                .await?,
        );
        let r = relay::unordered_relay_run(db, dev, events, knobs).await?;
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
                sql.push(relay::ordered_sql_only_rate(&db, keys, per_key, plan.base).await?);
                let o = relay::ordered_relay_run(&db, &dev, &rig, keys, per_key, plan.base, "consumer")
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

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
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

    let (by_batch, by_conc) = unordered_sweeps(&base_url, &plan).await?;
    let ordered = ordered_sweep(&base_url, &plan).await?;
    let cons = consumer::run(&base_url, plan.rounds, plan.consumer_secs, 16, 8).await?;
    let mut steady = steady::run(&base_url, plan.steady_rate, plan.steady_secs, plan.base).await?;
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

    let figures = json!({
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
        },
    });
    std::fs::write(
        plots_dir.join("figures.json"),
        serde_json::to_string_pretty(&figures)? + "\n",
    )?;
    let md = markdown(&figures, &plan);
    std::fs::write(args.out.join("benchmarks.md"), &md)?;
    println!("\n{md}");
    println!("BENCH_JSON {}", figures);
    println!(
        "wrote {}, {}/*.svg and {} in {elapsed:.0} s",
        args.out.join("benchmarks.md").display(),
        plots_dir.display(),
        plots_dir.join("figures.json").display()
    );
    Ok(())
}

fn k(v: f64) -> String {
    if !v.is_finite() {
        "n/a".into()
    } else if v >= 10_000.0 {
        format!("{:.1}k", v / 1000.0)
    } else {
        format!("{v:.0}")
    }
}

fn pct(v: f64) -> String {
    format!("{:.0} %", 100.0 * v)
}

/// The report as Markdown, from the figures alone (so it can be regenerated from `figures.json`).
fn markdown(fig: &Value, plan: &Plan) -> String {
    let s = &fig["scenarios"];
    let m = &fig["machine"];
    let mut o = String::new();
    let w = &mut o;
    let _ = writeln!(w, "# Benchmarks\n");
    let _ = writeln!(
        w,
        "Generated by `outbox-dev bench report{}` on {} ({} mode, {} round(s) per point, {:.0} s). Every \
         figure stands beside a baseline measured in the same run on the same machine — the relay beside the \
         SQL-only claim+settle cycle it cannot beat, the consumer beside the same transaction without HTTP, \
         signature or routing — and is a median over rounds: on a small shared machine the ratio is the figure \
         to compare, not the absolute rate. All numbers are also in [`benchmarks/figures.json`](benchmarks/figures.json).\n",
        if plan.quick { " --quick" } else { "" },
        fig["generated_at"].as_str().unwrap_or("?"),
        fig["mode"].as_str().unwrap_or("?"),
        fig["rounds"],
        f(&fig["duration_secs"]),
    );
    if plan.quick {
        let _ = writeln!(
            w,
            "**Quick mode**: small sizes and one round — these figures check the command, they are not for \
             quoting.\n"
        );
    }
    let _ = writeln!(w, "## Machine\n");
    let _ = writeln!(w, "| | |\n|---|---|");
    let _ = writeln!(
        w,
        "| CPUs | {} × {} |",
        m["cpus"],
        m["cpu_model"].as_str().unwrap_or("?")
    );
    let _ = writeln!(w, "| memory | {:.1} GiB |", f(&m["memory_gib"]));
    let _ = writeln!(w, "| kernel | {} |", m["kernel"].as_str().unwrap_or("?"));
    let _ = writeln!(
        w,
        "| Postgres | {} |",
        m["postgres_version"].as_str().unwrap_or("?")
    );
    if let Some(settings) = m["postgres_settings"].as_array() {
        for kv in settings {
            let _ = writeln!(
                w,
                "| `{}` | {} |",
                kv[0].as_str().unwrap_or("?"),
                kv[1].as_str().unwrap_or("?")
            );
        }
    }
    let la = |v: &Value| {
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|x| format!("{:.2}", f(x)))
                    .collect::<Vec<_>>()
                    .join(" / ")
            })
            .unwrap_or_default()
    };
    let _ = writeln!(
        w,
        "| load average (1 / 5 / 15 min) | {} before, {} after |\n",
        la(&m["load_before"]),
        la(&fig["load_after"])
    );
    let _ = writeln!(
        w,
        "Postgres, the dev server (`qstash-dev`, its own process), the relay (the `outbox` CLI's \
         `relay --until-empty`, its own process, unless said otherwise) and the receivers (in the benchmark \
         process) share these cores: CPU the relay and the dev server use is CPU Postgres does not get. A load \
         average above the core count before the run means something else was running too.\n"
    );

    // Unordered.
    for (key, title, x, xname, svg) in [
        (
            "relay_unordered_by_batch",
            "Relay, unordered, by batch size",
            "batch",
            "rows per claim",
            "relay-by-batch.svg",
        ),
        (
            "relay_unordered_by_concurrency",
            "Relay, unordered, by concurrency",
            "concurrency",
            "cycles in flight",
            "relay-by-concurrency.svg",
        ),
    ] {
        let v = &s[key];
        let _ = writeln!(w, "## {title}\n");
        let _ = writeln!(
            w,
            "{} pending unordered events (200-byte JSON payloads) drained by the relay, publishing to the dev \
             server in accept-only mode (`/v2/batch`, {} messages per request), {}; beside it, the relay's own \
             claim and settle statements with no HTTP (asynchronous commit, as the relay runs) at the same \
             settings on the same rows: the database's limit. Medians of {} round(s).\n",
            v["events"],
            v["qstash_batch"],
            if key.ends_with("batch") {
                format!("{} cycles in flight", v["concurrency"])
            } else {
                format!("{} rows per claim", v["batch"])
            },
            v["rounds"],
        );
        let _ = writeln!(w, "![{title}](benchmarks/{svg})\n");
        let _ = writeln!(
            w,
            "| {xname} | relay events/s | SQL-only events/s | relay / SQL-only | relay CPU µs/event | dev server CPU µs/event | relay peak RSS |"
        );
        let _ = writeln!(w, "|---:|---:|---:|---:|---:|---:|---:|");
        for p in v["points"].as_array().into_iter().flatten() {
            let _ = writeln!(
                w,
                "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} MB |",
                p[x],
                k(f(&p["relay_median"])),
                k(f(&p["sql_only_median"])),
                pct(f(&p["relay_vs_sql_only"])),
                f(&p["relay_cpu_us_per_event"]),
                f(&p["dev_server_cpu_us_per_event"]),
                f(&p["relay_peak_rss_mb"]),
            );
        }
        let _ = writeln!(w);
    }

    // Ordered.
    let v = &s["relay_ordered_by_keys"];
    let _ = writeln!(w, "## Relay, ordered, by number of keys\n");
    let _ = writeln!(
        w,
        "Ordered events spread evenly over the keys, end to end: the relay publishes each key's head to the dev \
         server, which delivers it (signed) to the real consumer in the benchmark process (signature check, \
         dedupe row, per-key sequence check, a no-op handler, delivery evidence in the same transaction); the \
         relay claims a key's next event only once the evidence is recorded. Beside it, the SQL-only ordered \
         protocol on the same rows (claim key heads, settle, record evidence; no HTTP). Batch {}, {} cycles in \
         flight, medians of {} round(s). With few keys the rate is bounded by one delivery round trip per key \
         at a time; with many, by CPU on this machine (the receivers, the dev server and Postgres share it).\n",
        v["batch"], v["concurrency"], v["rounds"]
    );
    let _ = writeln!(
        w,
        "![Ordered events/s by number of keys](benchmarks/ordered-by-keys.svg)\n"
    );
    let _ = writeln!(
        w,
        "| keys | events | relay events/s | SQL-only events/s | relay / SQL-only | per key: accepted → evidence | evidence → next accepted |"
    );
    let _ = writeln!(w, "|---:|---:|---:|---:|---:|---:|---:|");
    for p in v["points"].as_array().into_iter().flatten() {
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} | {} | {:.1} ms | {:.1} ms |",
            p["keys"],
            p["events"],
            k(f(&p["relay_median"])),
            k(f(&p["sql_only_median"])),
            pct(f(&p["relay_vs_sql_only"])),
            f(&p["accepted_to_evidence_ms_median"]),
            f(&p["evidence_to_next_accepted_ms_median"]),
        );
    }
    let _ = writeln!(w);

    // Consumer.
    let v = &s["consumer"];
    let _ = writeln!(w, "## Consumer\n");
    let _ = writeln!(
        w,
        "Distinct deliveries, each signed beforehand like QStash signs them (signing is not the consumer's \
         cost), through the consumer's handler (`outbox::consumer::handle_event`, no HTTP server) by 16 \
         concurrent callers over 8 pooled connections: cap, verify the token, route, parse the envelope, then \
         `BEGIN; INSERT` the dedupe row; `INSERT` one row; `COMMIT` (synchronous commit, like the consumer \
         Lambda). Beside it, alternating with each round, the same transaction alone: what this Postgres allows.\n"
    );
    let _ = writeln!(
        w,
        "![Consumer latency distribution](benchmarks/consumer-latency.svg)\n"
    );
    let lat = &v["latency_ms"];
    let _ = writeln!(
        w,
        "| applied/s | SQL-only tx/s | consumer / SQL-only | p50 | p90 | p99 | deliveries measured |"
    );
    let _ = writeln!(w, "|---:|---:|---:|---:|---:|---:|---:|");
    let _ = writeln!(
        w,
        "| {} | {} | {} | {:.2} ms | {:.2} ms | {:.2} ms | {} |\n",
        k(f(&v["msgs_per_sec_median"])),
        k(f(&v["sql_only_median"])),
        pct(f(&v["ratio_to_sql_only"])),
        f(&lat["p50"]),
        f(&lat["p90"]),
        f(&lat["p99"]),
        v["samples"],
    );

    // Commit → applied.
    let v = &s["commit_to_applied"];
    let _ = writeln!(w, "## Commit → applied under a steady rate\n");
    let _ = writeln!(
        w,
        "A producer commits one event per transaction at a steady {} events/s for {} s ({} events over 100 \
         keys, unordered), each with the `NOTIFY` wake-up hint. The relay runs in the benchmark process from \
         the Lambda's configuration variables with `RELAY_LISTEN_NOTIFY=true` (default 500 ms poll interval \
         otherwise); the dev server delivers each message to the real consumer, whose handler stamps the time \
         it applied the event. Both latencies are differences of Postgres clock readings from the event's \
         `created_at`; commit → dispatched (the relay's share, measured on the same events) is the reference \
         the end-to-end figure is compared with.\n",
        v["rate_per_sec"], v["secs"], v["events"]
    );
    let _ = writeln!(
        w,
        "![Commit to applied latency](benchmarks/commit-to-applied.svg)\n"
    );
    let _ = writeln!(w, "| | p50 | p90 | p99 | max |\n|---|---:|---:|---:|---:|");
    for (name, key) in [
        ("commit → dispatched", "commit_to_dispatched_ms"),
        ("commit → applied", "commit_to_applied_ms"),
    ] {
        let q = &v[key];
        let _ = writeln!(
            w,
            "| {name} | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms |",
            f(&q["p50"]),
            f(&q["p90"]),
            f(&q["p99"]),
            f(&q["max"])
        );
    }
    let _ = writeln!(
        w,
        "\nProducer rate achieved: {:.0} events/s. Applied p50 / dispatched p50: {:.1}×.\n",
        f(&v["achieved_rate_per_sec"]),
        f(&v["applied_vs_dispatched_p50"])
    );

    // xmin pin.
    let v = &s["xmin_pin"];
    let _ = writeln!(w, "## A long transaction pinning the xmin horizon\n");
    let _ = writeln!(
        w,
        "Three phases on one database, each adding {} pending unordered events (no `TRUNCATE`, no `VACUUM` in \
         between) and draining them: without a pin (baseline); while a second connection holds a \
         `REPEATABLE READ` transaction open after reading the outbox, so no row version the drain replaces can \
         be cleaned up; and after that transaction commits. The relay's own claim, publish and settle steps run \
         in the benchmark process ({} workers, batch {}, dev server in accept-only mode) so every claim can be \
         timed; every event must be dispatched in every phase. Medians of {} round(s), a fresh database each; \
         claim percentiles over every claim of the phase in all rounds.\n",
        v["events_per_phase"], v["concurrency"], v["batch"], v["rounds"]
    );
    let _ = writeln!(
        w,
        "![Claim latency under an xmin pin](benchmarks/xmin-pin-claims.svg)\n"
    );
    let _ = writeln!(
        w,
        "| phase | events/s | vs baseline | claim p50 | claim p99 | p50 vs baseline | dead tuples after (estimate) |"
    );
    let _ = writeln!(w, "|---|---:|---:|---:|---:|---:|---:|");
    for p in v["phases"].as_array().into_iter().flatten() {
        let dead = p["dead_tuples_after"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default();
        let _ = writeln!(
            w,
            "| {} | {} | {} | {:.2} ms | {:.2} ms | {:.2}× | {} |",
            p["phase"].as_str().unwrap_or("?"),
            k(f(&p["events_per_sec_median"])),
            pct(f(&p["vs_baseline"])),
            f(&p["claim_p50_ms"]),
            f(&p["claim_p99_ms"]),
            f(&p["claim_p50_vs_baseline"]),
            dead
        );
    }
    let _ = writeln!(w);
    let _ = writeln!(w, "## Reproducing\n");
    let _ = writeln!(
        w,
        "    cargo build --release -p outbox-cli -p qstash-dev -p outbox-devtools\n    \
         cargo run --release -p outbox-devtools -- bench report            # this report, ~15 min\n    \
         cargo run --release -p outbox-devtools -- bench report --quick --out /tmp/bench   # ~2 min, figures not for quoting\n\n\
         `--rounds N` changes the rounds per point, `--xmin-events N` the events per phase of the xmin-pin \
         scenario. The relay and the dev server run as the `outbox` and `qstash-dev` binaries next to \
         `outbox-dev`; the command needs a `DATABASE_URL` user that may create databases (it creates and drops \
         `outbox_bench_*` scratch databases)."
    );
    o
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
    ] {
        v.push(dir.join(svg));
    }
    v
}
