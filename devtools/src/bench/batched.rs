//! Scenario "Batched deliveries": the same pipelines with N = 1 and with larger N events per QStash message, side by
//! side in one run. N is passed to the relay exactly as a deployment sets it: the `RELAY_DELIVERY_BATCH` variable
//! of the relay process (or of the relay state built from the environment in this process).
//!
//! For each N, alternating within each round:
//! - ordered, end to end: events spread over many keys (1,000 in the full report), relay process → delivering dev
//!   server → the real consumer, which applies them and records the delivery evidence in its transaction;
//! - one hot key: a backlog of pending events (10,000 in the full report) on a single ordered key, drained the
//!   same way: the drain time;
//! - unordered, end to end: relay process → delivering dev server → consumer applied;
//! - commit → applied latency at a low steady rate (20 events/s, unordered), with the relay listening for the
//!   producer's `NOTIFY` hint ([`super::steady`]).
//!
//! Besides rates, every throughput point counts what batching saves: QStash messages per event (the dev server's
//! `accepted` counter) and consumer invocations per event (HTTP requests the consumer received, retries included).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use outbox_cli::util::DbArgs;
use outbox_testkit::median;
use serde_json::{Value, json};

use super::plot::{self, Series, XScale};
use super::relay::{self, OrderedRig};
use super::steady;
use super::support::{DevServerProcess, Knobs, ScratchDb};

/// The relay variable N is passed in.
pub const DELIVERY_BATCH_VAR: &str = "RELAY_DELIVERY_BATCH";

/// The N values measured when none are given: 1 (one event per message, the behaviour before batching) and the
/// default (`outbox::config::DEFAULT_DELIVERY_BATCH`).
pub fn default_ns() -> Vec<u32> {
    let mut ns = vec![1, outbox::config::DEFAULT_DELIVERY_BATCH];
    ns.dedup();
    ns
}

/// The plot's file name under `benchmarks/`.
pub const SVG: &str = "batched-deliveries.svg";

/// Sizes of one batched-deliveries run.
#[derive(Debug, Clone)]
pub struct BatchedPlan {
    /// Events per message to compare (`RELAY_DELIVERY_BATCH`), ascending; the first (smallest) is the baseline.
    pub ns: Vec<u32>,
    /// Rounds per throughput point (medians are reported).
    pub rounds: usize,
    pub ordered_keys: u64,
    pub ordered_per_key: u64,
    pub hot_key_events: u64,
    /// Rounds of the hot-key drain (one is 10,000 delivery round trips at N = 1 in the full report).
    pub hot_key_rounds: usize,
    pub unordered_events: u64,
    pub latency_rate: u32,
    pub latency_secs: f64,
}

impl BatchedPlan {
    /// The sizes of the full report (`quick`: a smoke run of a few seconds per N).
    pub fn new(ns: &[u32], quick: bool, rounds: usize) -> BatchedPlan {
        let mut ns = ns.to_vec();
        ns.sort_unstable();
        ns.dedup();
        if quick {
            BatchedPlan {
                ns,
                rounds,
                ordered_keys: 100,
                ordered_per_key: 5,
                hot_key_events: 200,
                hot_key_rounds: 1,
                unordered_events: 1_000,
                latency_rate: 20,
                latency_secs: 3.0,
            }
        } else {
            BatchedPlan {
                ns,
                rounds,
                ordered_keys: 1_000,
                ordered_per_key: 20,
                hot_key_events: 10_000,
                hot_key_rounds: 1,
                unordered_events: 20_000,
                latency_rate: 20,
                latency_secs: 20.0,
            }
        }
    }
}

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

fn env(n: u32) -> Vec<(&'static str, String)> {
    vec![(DELIVERY_BATCH_VAR, n.to_string())]
}

/// What one drain cost in messages and consumer invocations.
struct Counted {
    secs: f64,
    messages: u64,
    requests: u64,
}

/// Medians of a throughput point's rounds, as JSON; with `sql` (the SQL-only protocol's events/s in the same
/// rounds) also `relay / SQL-only`.
fn point(n: u32, events: u64, runs: &[Counted], sql: &[f64]) -> Value {
    let secs: Vec<f64> = runs.iter().map(|r| r.secs).collect();
    let rates: Vec<f64> = runs.iter().map(|r| events as f64 / r.secs).collect();
    let msgs: Vec<f64> = runs
        .iter()
        .map(|r| r.messages as f64 / events as f64)
        .collect();
    let reqs: Vec<f64> = runs
        .iter()
        .map(|r| r.requests as f64 / events as f64)
        .collect();
    let mut p = json!({
        "n": n, "events": events,
        "secs": secs, "secs_median": median(&secs),
        "events_per_sec": rates, "events_per_sec_median": median(&rates),
        "qstash_messages_per_event": median(&msgs),
        "consumer_requests_per_event": median(&reqs),
    });
    if !sql.is_empty() {
        let ratios: Vec<f64> = rates.iter().zip(sql).map(|(r, s)| r / s).collect();
        p["sql_only_events_per_sec"] = json!(sql);
        p["sql_only_median"] = json!(median(sql));
        p["relay_vs_sql_only_per_round"] = json!(ratios);
        p["relay_vs_sql_only"] = json!(median(&rates) / median(sql));
    }
    p
}

/// Ordered keys × events drained end to end with N events per message: time, messages and consumer requests.
async fn ordered_once(
    db: &ScratchDb,
    dev: &DevServerProcess,
    rig: &OrderedRig,
    keys: u64,
    per_key: u64,
    knobs: Knobs,
    n: u32,
) -> anyhow::Result<Counted> {
    let (m0, r0) = (dev.accepted().await?, rig.consumer_requests());
    let o =
        relay::ordered_relay_run(db, dev, rig, keys, per_key, knobs, "consumer", &env(n)).await?;
    Ok(Counted {
        secs: o.secs,
        messages: dev.accepted().await? - m0,
        requests: rig.consumer_requests() - r0,
    })
}

/// Unordered events drained end to end: from the relay process's start until the consumer has applied every
/// event (its dedupe rows), polled every 5 ms.
async fn unordered_once(
    db: &ScratchDb,
    dev: &DevServerProcess,
    rig: &OrderedRig,
    events: u64,
    knobs: Knobs,
    n: u32,
) -> anyhow::Result<Counted> {
    sqlx::query("TRUNCATE processed_messages")
        .execute(&db.pool)
        .await?;
    relay::seed_unordered(&db.pool, events).await?;
    let (m0, r0) = (dev.accepted().await?, rig.consumer_requests());
    let started = Instant::now();
    let mut env = env(n);
    env.push(("CONSUMER_URL", rig.consumer_url.clone()));
    env.push(("CALLBACK_URL", rig.callback_url.clone()));
    let out = relay::relay_child(&db.url, &dev.url, knobs, &env).await?;
    let dispatched = out["summary"]["dispatched"].as_u64().unwrap_or(0);
    if dispatched != events {
        bail!("relay dispatched {dispatched} of {events} events: {out}");
    }
    let give_up = Instant::now() + Duration::from_secs(120);
    loop {
        let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_messages")
            .fetch_one(&db.pool)
            .await?;
        if applied as u64 >= events {
            break;
        }
        if Instant::now() > give_up {
            bail!("the consumer applied {applied} of {events} unordered events within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let secs = started.elapsed().as_secs_f64();
    Ok(Counted {
        secs,
        messages: dev.accepted().await? - m0,
        requests: rig.consumer_requests() - r0,
    })
}

/// The three throughput scenarios on one database and one delivering dev server.
async fn throughput(
    db: &ScratchDb,
    dev: &DevServerProcess,
    rig: &OrderedRig,
    plan: &BatchedPlan,
    knobs: Knobs,
) -> anyhow::Result<(Value, Value, Value)> {
    let (keys, per_key) = (plan.ordered_keys, plan.ordered_per_key);
    let mut ordered: Vec<Vec<Counted>> = plan.ns.iter().map(|_| Vec::new()).collect();
    let mut ordered_sql: Vec<Vec<f64>> = plan.ns.iter().map(|_| Vec::new()).collect();
    let mut unordered: Vec<Vec<Counted>> = plan.ns.iter().map(|_| Vec::new()).collect();
    let mut hot: Vec<Vec<Counted>> = plan.ns.iter().map(|_| Vec::new()).collect();
    for round in 0..plan.rounds.max(plan.hot_key_rounds) {
        for (i, &n) in plan.ns.iter().enumerate() {
            if round < plan.rounds {
                // The SQL-only ordered protocol with runs of N, on the same rows, just before the relay.
                let s = relay::ordered_sql_only_rate(db, keys, per_key, knobs, n).await?;
                let o = ordered_once(db, dev, rig, keys, per_key, knobs, n).await?;
                let r = (keys * per_key) as f64 / o.secs;
                println!(
                    "batched N={n:>4} round {}: ordered {keys} keys x {per_key}: {r:>7.0} events/s, SQL-only ordered \
                     {s:>7.0} events/s (relay / SQL-only {:.0} %), {:.3} messages/event, {:.3} consumer \
                     requests/event",
                    round + 1,
                    100.0 * r / s,
                    o.messages as f64 / (keys * per_key) as f64,
                    o.requests as f64 / (keys * per_key) as f64
                );
                ordered[i].push(o);
                ordered_sql[i].push(s);
                let u = unordered_once(db, dev, rig, plan.unordered_events, knobs, n).await?;
                println!(
                    "batched N={n:>4} round {}: unordered {}: {:>7.0} events/s, {:.3} messages/event, {:.3} consumer \
                     requests/event",
                    round + 1,
                    plan.unordered_events,
                    plan.unordered_events as f64 / u.secs,
                    u.messages as f64 / plan.unordered_events as f64,
                    u.requests as f64 / plan.unordered_events as f64
                );
                unordered[i].push(u);
            }
            if round < plan.hot_key_rounds {
                let h = ordered_once(db, dev, rig, 1, plan.hot_key_events, knobs, n).await?;
                println!(
                    "batched N={n:>4}: one hot key, {} pending: drained in {:.2} s, {:.3} messages/event",
                    plan.hot_key_events,
                    h.secs,
                    h.messages as f64 / plan.hot_key_events as f64
                );
                hot[i].push(h);
            }
        }
    }
    let points = |runs: &[Vec<Counted>], sql: Option<&[Vec<f64>]>, events: u64| -> Vec<Value> {
        plan.ns
            .iter()
            .zip(runs)
            .enumerate()
            .map(|(i, (&n, r))| point(n, events, r, sql.map_or(&[][..], |s| &s[i])))
            .collect()
    };
    Ok((
        json!({ "keys": keys, "events_per_key": per_key, "rounds": plan.rounds, "evidence": "consumer",
                "points": points(&ordered, Some(&ordered_sql), keys * per_key) }),
        json!({ "keys": 1, "rounds": plan.hot_key_rounds, "evidence": "consumer",
                "points": points(&hot, None, plan.hot_key_events) }),
        json!({ "rounds": plan.rounds, "points": points(&unordered, None, plan.unordered_events) }),
    ))
}

/// Adds `vs_first` (this point's events/s over the first point's) to every point.
fn with_ratios(mut v: Value) -> Value {
    if let Some(points) = v["points"].as_array_mut() {
        let base = points
            .first()
            .and_then(|p| p["events_per_sec_median"].as_f64())
            .unwrap_or(f64::NAN);
        for p in points {
            let r = p["events_per_sec_median"].as_f64().unwrap_or(f64::NAN) / base;
            p["vs_first"] = json!(r);
        }
    }
    v
}

/// Runs every batched-deliveries scenario for every N of `plan` and returns its figures.
pub async fn run(base_url: &str, plan: &BatchedPlan, knobs: Knobs) -> anyhow::Result<Value> {
    if plan.ns.is_empty() {
        bail!("no --delivery-batch values to measure");
    }
    let db = ScratchDb::create(base_url, "outbox_bench_batched").await?;
    let (dev, rig) = relay::ordered_rig(&db).await?;
    let result = throughput(&db, &dev, &rig, plan, knobs).await;
    let _ = rig.stop.send(true);
    dev.stop().await;
    db.drop_now().await?;
    let (ordered, hot, unordered) = result?;
    let mut latency = Vec::new();
    for &n in &plan.ns {
        let v = steady::run(
            base_url,
            plan.latency_rate,
            plan.latency_secs,
            knobs,
            &env(n),
        )
        .await?;
        let events = v["events"].as_f64().unwrap_or(f64::NAN);
        latency.push(json!({
            "n": n,
            "events": v["events"],
            "achieved_rate_per_sec": v["achieved_rate_per_sec"],
            "commit_to_applied_ms": v["commit_to_applied_ms"],
            "commit_to_dispatched_ms": v["commit_to_dispatched_ms"],
            "qstash_messages_per_event": v["qstash_messages"].as_f64().unwrap_or(f64::NAN) / events,
            "consumer_requests_per_event": v["consumer_requests"].as_f64().unwrap_or(f64::NAN) / events,
        }));
    }
    Ok(json!({
        "delivery_batch": plan.ns,
        "variable": DELIVERY_BATCH_VAR,
        "batch": knobs.batch, "concurrency": knobs.concurrency,
        "ordered": with_ratios(ordered),
        "hot_key": with_ratios(hot),
        "unordered": with_ratios(unordered),
        "latency": { "rate_per_sec": plan.latency_rate, "secs": plan.latency_secs, "points": latency },
    }))
}

fn xy(v: &Value, y: &str) -> Vec<(f64, f64)> {
    v["points"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .map(|p| {
                    (
                        p["n"].as_f64().unwrap_or(f64::NAN),
                        p[y].as_f64().unwrap_or(f64::NAN),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Draws the speed-up over the first N of each throughput scenario.
pub fn plot(v: &Value, path: &Path) -> anyhow::Result<()> {
    let first = v["delivery_batch"][0].as_u64().unwrap_or(1);
    plot::lines(
        path,
        &format!("Batched deliveries: events/s relative to N = {first}"),
        "events per QStash message, N (log scale)",
        &format!("× the events/s at N = {first}"),
        XScale::Log,
        &[
            Series::new(
                format!(
                    "ordered, {} keys, end to end",
                    v["ordered"]["keys"].as_u64().unwrap_or(0)
                ),
                xy(&v["ordered"], "vs_first"),
            ),
            Series::new("one hot ordered key (drain)", xy(&v["hot_key"], "vs_first")),
            Series::new("unordered, end to end", xy(&v["unordered"], "vs_first")),
        ],
    )
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn rate(v: f64) -> String {
    if !v.is_finite() {
        "n/a".into()
    } else if v >= 10_000.0 {
        format!("{:.1}k", v / 1000.0)
    } else {
        format!("{v:.0}")
    }
}

/// The point of `scenario` at N = `n`, if measured.
fn point_at<'a>(v: &'a Value, scenario: &str, n: u64) -> Option<&'a Value> {
    v[scenario]["points"]
        .as_array()?
        .iter()
        .find(|p| p["n"].as_u64() == Some(n))
}

/// The targets of the batched scenarios (issue 25), each a ratio within this one run: ordered 1,000 keys × 20 at
/// N = 50 at least 10× N = 1 and at least 60 % of the SQL-only ordered protocol at N = 50; one hot key at
/// N = 50 at least 45× N = 1. Each as `{what, measured, target, met}`; empty unless N = 1 and N = 50 were
/// measured.
pub fn targets(v: &Value) -> Vec<Value> {
    let n = u64::from(outbox::config::DEFAULT_DELIVERY_BATCH);
    let mut out = Vec::new();
    let mut add = |what: String, measured: Option<f64>, target: f64, unit: &str| {
        if let Some(m) = measured.filter(|m| m.is_finite()) {
            out.push(json!({ "what": what, "measured": m, "target": target, "unit": unit, "met": m >= target }));
        }
    };
    let rate = |p: Option<&Value>| p.and_then(|p| p["events_per_sec_median"].as_f64());
    let (o1, on) = (point_at(v, "ordered", 1), point_at(v, "ordered", n));
    let keys = v["ordered"]["keys"].as_u64().unwrap_or(0);
    let per_key = v["ordered"]["events_per_key"].as_u64().unwrap_or(0);
    add(
        format!("ordered, {keys} keys × {per_key}: N = {n} over N = 1"),
        rate(on).zip(rate(o1)).map(|(a, b)| a / b),
        10.0,
        "×",
    );
    add(
        format!("ordered, {keys} keys × {per_key}: relay / SQL-only ordered protocol at N = {n}"),
        on.and_then(|p| p["relay_vs_sql_only"].as_f64()),
        0.6,
        "share",
    );
    let (h1, hn) = (point_at(v, "hot_key", 1), point_at(v, "hot_key", n));
    add(
        format!("one hot key: N = {n} over N = 1 (the limit is {n}×)"),
        rate(hn).zip(rate(h1)).map(|(a, b)| a / b),
        45.0,
        "×",
    );
    out
}

/// A target's figure as text: `12.3×` or `64 %`.
pub fn target_figure(t: &Value, key: &str) -> String {
    let x = t[key].as_f64().unwrap_or(f64::NAN);
    if t["unit"] == "share" {
        format!("{:.0} %", 100.0 * x)
    } else {
        format!("{x:.1}×")
    }
}

/// Each target with its figure and verdict, one line each (what the benchmark prints at the end).
pub fn print_targets(targets: &[Value]) {
    for t in targets {
        println!(
            "target {}: {} (target ≥ {}): {}",
            t["what"].as_str().unwrap_or(""),
            target_figure(t, "measured"),
            target_figure(t, "target"),
            if t["met"] == true { "MET" } else { "NOT MET" }
        );
    }
}

/// The report's "Batched deliveries" section (Markdown), from the figures alone.
pub fn markdown(v: &Value) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let w = &mut o;
    let first = v["delivery_batch"][0].as_u64().unwrap_or(1);
    let ns = v["delivery_batch"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default();
    let _ = writeln!(w, "## Batched deliveries\n");
    let _ = writeln!(
        w,
        "The same pipelines with N = {ns} events per QStash message, N set as a deployment sets it: the relay \
         process's `{}` variable. Alternating N within each round, on one database and one delivering dev server \
         (relay: batch {}, {} cycles in flight): **ordered** — {} keys × {} events, relay → dev server → the real \
         consumer, which applies each event and records its delivery evidence in the same transaction (the relay \
         publishes a key's next events only after that); **one hot key** — {} pending events on a single ordered \
         key, the same path, drain time ({} round(s)); **unordered** — {} events, relay → dev server → consumer, \
         timed from the relay's start until the consumer has applied every event. QStash messages per event are \
         the dev server's accepted messages; consumer requests per event are the HTTP requests the consumer \
         received (retries included). Beside each ordered point, in the same round on the same rows, the SQL-only \
         ordered protocol at the same N: the relay's own claim of runs of up to N events per key, its settle, and \
         the consumer's evidence statement once per run (no HTTP, no signature, no handler): what this Postgres \
         allows for that protocol. Medians of {} round(s).\n",
        v["variable"].as_str().unwrap_or(DELIVERY_BATCH_VAR),
        v["batch"],
        v["concurrency"],
        v["ordered"]["keys"],
        v["ordered"]["events_per_key"],
        v["hot_key"]["points"][0]["events"],
        v["hot_key"]["rounds"],
        v["unordered"]["points"][0]["events"],
        v["ordered"]["rounds"],
    );
    let _ = writeln!(w, "![Batched deliveries](benchmarks/{SVG})\n");
    let _ = writeln!(
        w,
        "| scenario | N | events | time | events/s | × N = {first} | SQL-only events/s | relay / SQL-only | QStash messages / event | consumer requests / event |"
    );
    let _ = writeln!(w, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (key, name) in [
        (
            "ordered",
            format!(
                "ordered, {} keys",
                v["ordered"]["keys"].as_u64().unwrap_or(0)
            ),
        ),
        ("hot_key", "one hot ordered key".to_owned()),
        ("unordered", "unordered".to_owned()),
    ] {
        for p in v[key]["points"].as_array().into_iter().flatten() {
            let (sql, share) = if p["sql_only_median"].is_number() {
                (
                    rate(num(&p["sql_only_median"])),
                    format!("{:.0} %", 100.0 * num(&p["relay_vs_sql_only"])),
                )
            } else {
                ("—".to_owned(), "—".to_owned())
            };
            let _ = writeln!(
                w,
                "| {name} | {} | {} | {:.2} s | {} | {:.1}× | {sql} | {share} | {:.3} | {:.3} |",
                p["n"],
                p["events"],
                num(&p["secs_median"]),
                rate(num(&p["events_per_sec_median"])),
                num(&p["vs_first"]),
                num(&p["qstash_messages_per_event"]),
                num(&p["consumer_requests_per_event"]),
            );
        }
    }
    let _ = writeln!(
        w,
        "\nEach round (events/s; ordered: relay / SQL-only in the same round):\n"
    );
    for (key, name) in [
        ("ordered", "ordered"),
        ("hot_key", "one hot key"),
        ("unordered", "unordered"),
    ] {
        for p in v[key]["points"].as_array().into_iter().flatten() {
            let rates: Vec<String> = p["events_per_sec"]
                .as_array()
                .into_iter()
                .flatten()
                .zip(
                    p["relay_vs_sql_only_per_round"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(Some)
                        .chain(std::iter::repeat(None)),
                )
                .map(|(r, share)| match share {
                    Some(s) => format!("{} ({:.0} %)", rate(num(r)), 100.0 * num(s)),
                    None => rate(num(r)),
                })
                .collect();
            let _ = writeln!(w, "- {name}, N = {}: {}", p["n"], rates.join(", "));
        }
    }
    let targets = targets(v);
    if !targets.is_empty() {
        let _ = writeln!(
            w,
            "\nTargets, as ratios within this run (medians):\n\n| target | measured | required | verdict |\n|---|---:|---:|---|"
        );
        for t in &targets {
            let _ = writeln!(
                w,
                "| {} | {} | ≥ {} | {} |",
                t["what"].as_str().unwrap_or(""),
                target_figure(t, "measured"),
                target_figure(t, "target"),
                if t["met"] == true {
                    "met"
                } else {
                    "**not met**"
                }
            );
        }
    }
    let l = &v["latency"];
    let _ = writeln!(
        w,
        "\nCommit → applied at a steady {} events/s for {} s (unordered, one event per producer transaction, the \
         relay listening for the `NOTIFY` hint; the setup of [Commit → applied under a steady \
         rate](#commit--applied-under-a-steady-rate)), per N — batching must not make a quiet system slower:\n",
        l["rate_per_sec"], l["secs"]
    );
    let _ = writeln!(
        w,
        "| N | events | commit → applied p50 | p90 | p99 | max | QStash messages / event |"
    );
    let _ = writeln!(w, "|---:|---:|---:|---:|---:|---:|---:|");
    for p in l["points"].as_array().into_iter().flatten() {
        let q = &p["commit_to_applied_ms"];
        let _ = writeln!(
            w,
            "| {} | {} | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.3} |",
            p["n"],
            p["events"],
            num(&q["p50"]),
            num(&q["p90"]),
            num(&q["p99"]),
            num(&q["max"]),
            num(&p["qstash_messages_per_event"]),
        );
    }
    let _ = writeln!(w);
    o
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
