//! The cost section of `benchmarks.md` (between `<!-- cost:begin -->` and `<!-- cost:end -->`), its plot, its
//! figures under `cost` in `benchmarks/figures.json`, and the README's cost block: all from the figures alone,
//! written by `outbox-dev bench cost --report DIR` and kept as they are by the other benchmark commands.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::bail;
use serde_json::Value;

use super::model::usd_per_million_at;
use super::prices::PRICES;
use crate::bench::plot::{self, Series, XScale};
use crate::bench::support::{load_text, write_section};

pub const BEGIN: &str = "<!-- cost:begin -->";
pub const END: &str = "<!-- cost:end -->";
/// The README's block.
pub const README_BEGIN: &str = "<!-- cost-figures:begin -->";
pub const README_END: &str = "<!-- cost-figures:end -->";
pub const KEY: &str = "cost";
pub const PLOT: &str = "cost-per-million.svg";
/// The rates the plot and the table spread the relay's month over, events/s.
const RATES: [f64; 9] = [1.0, 2.0, 5.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0];

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn kind(row: &Value) -> &'static str {
    if row["ordered"] == Value::Bool(true) {
        "ordered"
    } else {
        "unordered"
    }
}

/// `$0.0123`, with as many decimals as a small amount needs.
fn usd(v: f64) -> String {
    match v.abs() {
        x if x >= 10.0 => format!("${v:.2}"),
        x if x >= 0.1 => format!("${v:.3}"),
        _ => format!("${v:.4}"),
    }
}

/// A count per million events, readable.
fn count(v: &Value) -> String {
    match v.as_f64() {
        None => "–".to_owned(),
        Some(0.0) => "0".to_owned(),
        Some(x) if x >= 100.0 => format!("{x:.0}"),
        Some(x) => format!("{x:.2}"),
    }
}

/// The row of scenario `name`.
fn row<'a>(run: &'a Value, name: &str) -> Option<&'a Value> {
    run["model"]["rows"]
        .as_array()?
        .iter()
        .find(|r| r["scenario"] == name)
}

fn counts_table(w: &mut String, rows: &[Value]) {
    let _ = writeln!(
        w,
        "| configuration | topic | subscribers | QStash messages (publishes + callbacks) | per subscriber | retries | API requests | MB to QStash | consumer invocations | consumer GB-s | callback invocations | callback GB-s | Postgres CPU s | WAL MB |"
    );
    let _ = writeln!(
        w,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in rows {
        let c = &r["per_million_events"];
        let mb = |v: &Value| v.as_f64().map(|b| serde_json::json!(b / 1e6));
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} ({} + {}) | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r["label"].as_str().unwrap_or("?"),
            kind(r),
            r["subscribers"],
            count(&c["qstash_messages"]),
            count(&c["qstash_publishes"]),
            count(&c["qstash_callbacks"]),
            count(&serde_json::json!(
                f(&c["qstash_messages"]) / f(&r["subscribers"])
            )),
            count(&c["qstash_retries"]),
            count(&c["qstash_api_requests"]),
            count(&mb(&c["qstash_bytes"]).unwrap_or(Value::Null)),
            count(&c["consumer_invocations"]),
            count(&c["consumer_gb_seconds"]),
            count(&c["callback_invocations"]),
            count(&c["callback_gb_seconds"]),
            count(&c["postgres_cpu_secs"]),
            count(&mb(&c["postgres_wal_bytes"]).unwrap_or(Value::Null)),
        );
    }
}

fn dollars_table(w: &mut String, rows: &[Value], relay_usd: f64, rate: f64) {
    let _ = writeln!(
        w,
        "| configuration | topic | subscribers | QStash | consumer | callbacks | without the relay | per subscriber | with the relay at {rate:.0} events/s | at 10 events/s | at 1 event/s |"
    );
    let _ = writeln!(w, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let u = &r["usd_per_million_events"];
        let v = f(&u["variable"]);
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} | {} | {} | **{}** | {} | {} | {} | {} |",
            r["label"].as_str().unwrap_or("?"),
            kind(r),
            r["subscribers"],
            usd(f(&u["qstash"])),
            usd(f(&u["consumer"])),
            usd(f(&u["callbacks"])),
            usd(v),
            usd(v / f(&r["subscribers"])),
            usd(usd_per_million_at(v, relay_usd, rate)),
            usd(usd_per_million_at(v, relay_usd, 10.0)),
            usd(usd_per_million_at(v, relay_usd, 1.0)),
        );
    }
}

/// A whole number with thousands separators: `100,000`.
fn thousands(v: f64) -> String {
    let digits = format!("{v:.0}");
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn prices_table(w: &mut String) {
    let _ = writeln!(w, "| item | price | source | read | in the model |");
    let _ = writeln!(w, "|---|---|---|---|---|");
    for p in PRICES {
        let _ = writeln!(
            w,
            "| {} | ${} per {} {} | {} | {} | {} |",
            p.item,
            p.usd,
            thousands(p.per),
            p.unit,
            p.source,
            p.read,
            p.note
        );
    }
}

/// The section, from `figures.json` alone (empty when it holds no cost run).
pub fn section(figures: &Value) -> String {
    let run = &figures[KEY];
    let Some(rows) = run["model"]["rows"].as_array() else {
        return String::new();
    };
    let relay = &run["model"]["relay_month"];
    let d = &run["deployment"];
    let rate = f(&run["rate"]);
    let mut o = String::new();
    let w = &mut o;
    let _ = writeln!(w, "{BEGIN}");
    let _ = writeln!(w, "## Cost per million events\n");
    let _ = writeln!(
        w,
        "Generated by `outbox-dev bench cost` on {} ({}; load average before {}, after {}; the machine is shared: \
         durations are what this machine gave, on a noisy 2-core host). Each configuration runs alone on a fresh \
         set of tables: a producer commits {} events/s, one event per transaction, over {} keys for {:.0} s, \
         while the relay runs as its Lambda handler (invoked with the schedule's event and a {} s timeout, the \
         template's `RelayTimeoutSeconds` in a full run; again while events are left) and the delivering dev server delivers to the real \
         consumers and the callback receiver. QStash's counts are the dev server's own counters (messages \
         accepted, callbacks created, retries, other API requests, publish bytes); Lambda's are the handlers' \
         invocations, each timed from the request handed to the handler to its response and billed rounded up \
         to 1 ms at the template's memory (relay {:.0} MB, consumer {:.0} MB, callback {:.0} MB). Postgres: CPU of the \
         benchmark database's backends (`/proc`), WAL of its transactions (`{}`). The prices are applied by \
         the command and kept apart from the counts; what the model leaves out: decision record 0075.\n",
        run["generated_at"].as_str().unwrap_or("?"),
        run["mode"].as_str().unwrap_or("?"),
        load_text(&run["load_before"]),
        load_text(&run["load_after"]),
        run["rate"],
        run["keys"],
        f(&run["produce_secs"]),
        relay["invocation_secs"],
        f(&d["relay_memory_mb"]),
        f(&d["consumer_memory_mb"]),
        f(&d["callback_memory_mb"]),
        run["runs"][0]["postgres"]["wal_method"]
            .as_str()
            .unwrap_or("?"),
    );
    let _ = writeln!(w, "![Cost per million events by rate](benchmarks/{PLOT})\n");
    let _ = writeln!(
        w,
        "**The relay's schedule**, whatever the traffic: `{}` is {:.0} invocations a month (30 days), each {:.1} s \
         (the median of {} measured invocations: it drains until its deadline), at {:.0} MB: {:.0} GB-s, **{} a \
         month**. Spread over a month of events, it is the difference between the columns below.\n",
        d["relay_schedule"].as_str().unwrap_or("?"),
        f(&relay["invocations"]),
        f(&relay["duration_ms_p50"]) / 1000.0,
        relay["measured_invocations"],
        f(&d["relay_memory_mb"]),
        f(&relay["gb_seconds"]),
        usd(f(&relay["usd"])),
    );
    let _ = writeln!(w, "**Counts per million events** (measured, no price):\n");
    counts_table(w, rows);
    let _ = writeln!(
        w,
        "\n**Dollars per million events** (the prices below applied to the counts; batched configurations were \
         measured at {rate:.0} events/s and carry fewer events per message at lower rates):\n"
    );
    dollars_table(w, rows, f(&relay["usd"]), rate);
    let _ = writeln!(
        w,
        "\nMemory: the peak RSS of the benchmark process, which ran all three handlers, the producer and the \
         rig, was {:.1} MB (`VmHWM`), under each function's configured memory; Lambda bills the configured \
         memory, which the model uses.\n",
        f(&run["peak_rss_mb"]),
    );
    let _ = writeln!(w, "**Prices:**\n");
    prices_table(w);
    let _ = writeln!(
        w,
        "\nReproduce: `cargo build --release -p outbox-cli -p qstash-dev -p outbox-devtools`, then \
         `target/release/outbox-dev bench cost --report docs` (about 12 minutes).\n"
    );
    let _ = writeln!(w, "{END}");
    o
}

/// The plot: dollars per million events by events/s, one line per configuration.
fn draw(dir: &Path, run: &Value) -> anyhow::Result<PathBuf> {
    let relay = f(&run["model"]["relay_month"]["usd"]);
    let series: Vec<Series> = run["model"]["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let v = f(&r["usd_per_million_events"]["variable"]);
            Series::new(
                format!("{} ({})", r["scenario"].as_str().unwrap_or("?"), kind(r)),
                RATES
                    .iter()
                    .map(|x| (*x, usd_per_million_at(v, relay, *x)))
                    .collect(),
            )
        })
        .collect();
    let path = dir.join("benchmarks").join(PLOT);
    std::fs::create_dir_all(dir.join("benchmarks"))?;
    plot::lines(
        &path,
        "Dollars per million events, the relay's schedule included",
        "events/s (steady)",
        "$ per million events",
        XScale::Log,
        &series,
    )?;
    Ok(path)
}

/// The README's block: the defaults' and the seed's dollars per million events, and the relay's month.
pub fn readme_block(figures: &Value) -> anyhow::Result<String> {
    let run = &figures[KEY];
    let (Some(defaults), Some(seed)) = (row(run, "defaults-unordered"), row(run, "seed-unordered"))
    else {
        bail!("the figures hold no cost run with the defaults and the seed");
    };
    let v = |r: &Value| f(&r["usd_per_million_events"]["variable"]);
    Ok(format!(
        "{} per million unordered events at the defaults, {} with the seed's one message and callback per event; \
         plus {} a month for the relay's schedule",
        usd(v(defaults)),
        usd(v(seed)),
        usd(f(&run["model"]["relay_month"]["usd"])),
    ))
}

/// Stores the run under [`KEY`], draws the plot, rewrites the section of `dir/benchmarks.md`.
pub fn write(dir: &Path, run: &Value) -> anyhow::Result<Vec<PathBuf>> {
    let mut written = vec![draw(dir, run)?];
    written.extend(write_section(dir, KEY, run, section, [BEGIN, END])?);
    Ok(written)
}
