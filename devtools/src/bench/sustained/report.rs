//! A sustained run on paper: the text printed at the end ([`text`]), and its place in the benchmark report
//! ([`write`]): `figures.json`'s `sustained` object (or `sustained_long_transaction` for a run with a long
//! transaction), plots over time, and the section of `benchmarks.md` between two markers ([`section`]), which
//! `outbox-dev bench report` keeps when it rewrites the rest.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::bench::plot::{self, Series, XScale};

/// Where the section starts and ends in `benchmarks.md`.
pub const BEGIN: &str = "<!-- sustained:begin -->";
pub const END: &str = "<!-- sustained:end -->";

/// The `figures.json` keys of the two kinds of run, in report order.
pub const KEYS: [&str; 2] = ["sustained", "sustained_long_transaction"];

fn key_of(summary: &Value) -> &'static str {
    if summary["settings"]["long_transaction_at"].is_null() {
        KEYS[0]
    } else {
        KEYS[1]
    }
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// The summary without the per-minute table detail: the `BENCH_JSON` line.
pub fn compact(summary: &Value) -> Value {
    let per_minute: Vec<Value> = summary["per_minute"]
        .as_array()
        .map(|v| v.iter().map(minute_core).collect())
        .unwrap_or_default();
    json!({
        "settings": summary["settings"],
        "accounting": summary["accounting"],
        "targets": summary["targets"],
        "per_minute": per_minute,
    })
}

/// A minute's figures the issue names (`minute`, `dispatched`, `outbox_bytes`, `claim_p99_ms`,
/// `commit_to_applied_p99_ms`) and the few beside them.
fn minute_core(m: &Value) -> Value {
    json!({
        "minute": m["minute"],
        "produced": m["produced"],
        "dispatched": m["dispatched"],
        "applied": m["applied"],
        "outbox_bytes": m["outbox_bytes"],
        "claim_p99_ms": m["claim_p99_ms"],
        "commit_to_applied_p99_ms": m["commit_to_applied_p99_ms"],
    })
}

/// The end-of-run text: accounting and targets.
pub fn text(summary: &Value) -> String {
    let mut o = String::new();
    let a = &summary["accounting"];
    let _ = writeln!(
        o,
        "sustained: {} events produced: applied once {}, twice {}, lost {}, dead-lettered {}, order violations {}, \
         left leased {} — accounting {}",
        a["produced"],
        a["applied_once"],
        a["applied_twice"],
        a["lost"],
        a["dead_lettered"],
        a["order_violations"],
        a["left_leased"],
        if a["ok"].as_bool().unwrap_or(false) {
            "OK"
        } else {
            "FAILED"
        }
    );
    for t in summary["targets"].as_array().into_iter().flatten() {
        let _ = writeln!(
            o,
            "  {} {}: {}",
            if t["met"].as_bool().unwrap_or(false) {
                "met    "
            } else {
                "NOT MET"
            },
            t["name"].as_str().unwrap_or("?"),
            t["measured"].as_str().unwrap_or("?")
        );
    }
    o
}

/// Plot file names of a run kind.
fn svgs(key: &str) -> [String; 4] {
    let stem = key.replace('_', "-");
    [
        format!("{stem}-size.svg"),
        format!("{stem}-latency.svg"),
        format!("{stem}-throughput.svg"),
        format!("{stem}-cpu.svg"),
    ]
}

fn series(summary: &Value, name: &str, pick: impl Fn(&Value) -> Option<f64>) -> Series {
    let points = summary["per_minute"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| Some((f(&m["minute"]), pick(m)?)))
        .filter(|p| p.1.is_finite())
        .collect();
    Series::new(name, points)
}

fn table_mb(m: &Value, table: &str) -> Option<f64> {
    m["tables"]
        .as_array()?
        .iter()
        .find(|t| t["table"] == table)
        .map(|t| f(&t["total_bytes"]) / 1e6)
}

/// Writes the plots, merges the run into `figures.json` and rewrites the section of `benchmarks.md`.
pub fn write(dir: &Path, summary: &Value) -> anyhow::Result<Vec<PathBuf>> {
    let plots = dir.join("benchmarks");
    std::fs::create_dir_all(&plots)?;
    let key = key_of(summary);
    let [size, latency, throughput, cpu] = svgs(key);
    let mut written = Vec::new();
    plot::lines(
        &plots.join(&size),
        "Table + indexes over time (MB)",
        "minute",
        "MB",
        XScale::Linear,
        &[
            series(summary, "outbox", |m| table_mb(m, "outbox")),
            series(summary, "processed_messages", |m| {
                table_mb(m, "processed_messages")
            }),
            series(summary, "outbox_keys", |m| table_mb(m, "outbox_keys")),
            series(summary, "dead_letters", |m| table_mb(m, "dead_letters")),
        ],
    )?;
    plot::lines(
        &plots.join(&latency),
        "Latency over time (ms, p99 of each minute)",
        "minute",
        "ms",
        XScale::Linear,
        &[
            series(summary, "claim p99 (worst invocation)", |m| {
                m["claim_p99_ms"].as_f64()
            }),
            series(summary, "commit → applied p99", |m| {
                m["commit_to_applied_p99_ms"].as_f64()
            }),
            series(summary, "claim p50", |m| m["claim_p50_ms"].as_f64()),
            series(summary, "commit → applied p50", |m| {
                m["commit_to_applied_p50_ms"].as_f64()
            }),
        ],
    )?;
    let secs = f(&summary["settings"]["minute_secs"]);
    plot::lines(
        &plots.join(&throughput),
        "Events per second, and dead tuples of outbox (thousands)",
        "minute",
        "events/s; thousands of dead tuples",
        XScale::Linear,
        &[
            series(summary, "produced/s", |m| Some(f(&m["produced"]) / secs)),
            series(summary, "dispatched/s", |m| {
                Some(f(&m["dispatched"]) / secs)
            }),
            series(summary, "applied/s", |m| Some(f(&m["applied"]) / secs)),
            series(summary, "outbox dead tuples (k)", |m| {
                m["tables"]
                    .as_array()?
                    .iter()
                    .find(|t| t["table"] == "outbox")
                    .map(|t| f(&t["dead_tuples"]) / 1e3)
            }),
        ],
    )?;
    plot::lines(
        &plots.join(&cpu),
        "CPU over time (% of one core)",
        "minute",
        "% of one core",
        XScale::Linear,
        &[
            series(summary, "relays", |m| m["relay_cpu_pct"].as_f64()),
            series(summary, "consumer + callbacks", |m| {
                Some(f(&m["consumer_cpu_pct"]) + f(&m["callback_cpu_pct"]))
            }),
            series(summary, "postgres", |m| m["postgres_cpu_pct"].as_f64()),
            series(summary, "producers + dev server", |m| {
                m["bench_cpu_pct"].as_f64()
            }),
        ],
    )?;
    for s in [size, latency, throughput, cpu] {
        written.push(plots.join(s));
    }

    written.extend(super::super::support::write_section(
        dir,
        key,
        summary,
        section,
        [BEGIN, END],
    )?);
    Ok(written)
}

/// `md` with its sustained section replaced by `section` (appended when it has none).
pub fn with_section(md: &str, section: &str) -> String {
    super::super::support::splice_section(md, BEGIN, END, section)
}

/// The sustained-load section of `benchmarks.md`, from `figures.json` alone (empty when it holds no run).
pub fn section(figures: &Value) -> String {
    let runs: Vec<(&str, &Value)> = KEYS
        .iter()
        .filter(|k| figures[**k].is_object())
        .map(|k| (*k, &figures[*k]))
        .collect();
    if runs.is_empty() {
        return String::new();
    }
    let mut o = String::new();
    let w = &mut o;
    let _ = writeln!(w, "{BEGIN}");
    let _ = writeln!(w, "## Sustained load with retention\n");
    let _ = writeln!(
        w,
        "Generated by `outbox-dev bench sustained`. A steady stream of events for an hour while the relay's \
         housekeeping removes what is done (whole outbox partitions dropped, dedupe rows deleted; decision \
         record 0067), as in production but with a short retention window: producers at a \
         fixed rate (1 to 3 events per transaction, ordered and unordered topics), relays as separate processes \
         running simulated invocations through the relay function's handler with the relay's code defaults (delivery evidence from QStash callbacks; the template deploys consumer and dedupe evidence), the \
         consumer and callback receiver as processes behind the QStash-compatible dev server. Every minute: \
         events, claim latency (each relay invocation's `ClaimLatencyP50/P99` metrics), commit → applied, the \
         tables' size and dead tuples, CPU. The run's verdict on the targets is its own, never a test's.\n"
    );
    for (key, run) in runs {
        run_section(w, key, run);
    }
    let _ = writeln!(w, "{END}");
    o
}

fn run_section(w: &mut String, key: &str, run: &Value) {
    let s = &run["settings"];
    let m = &run["machine"];
    let title = if key == KEYS[0] {
        "Steady run".to_owned()
    } else {
        format!(
            "With a long transaction (minutes {}–{})",
            s["long_transaction_at"],
            s["long_transaction_at"].as_u64().unwrap_or(0)
                + s["long_transaction_minutes"].as_u64().unwrap_or(0)
        )
    };
    let _ = writeln!(w, "### {title}\n");
    if run["mode"] == "quick" {
        let _ = writeln!(
            w,
            "**Quick mode**: minutes of a few seconds at a low rate — these figures check the command, they are \
             not for quoting.\n"
        );
    }
    let _ = writeln!(
        w,
        "{} on {}: {:.0} events/s for {} minutes of {} s, {:.0} % ordered over {} keys, unordered over {} keys; \
         retention {} minutes (`OUTBOX_RETENTION_HOURS` and `PROCESSED_TTL_HOURS`); {} relays with {} s \
         invocations; {} producers. Machine: {} × {}, {:.1} GiB; {}. Load average before {:?}, after {:?}.\n",
        run["generated_at"].as_str().unwrap_or("?"),
        if run["mode"] == "quick" {
            "a quick run"
        } else {
            "a full run"
        },
        f(&s["rate_per_sec"]),
        s["minutes"],
        s["minute_secs"],
        100.0 * f(&s["ordered_share"]),
        s["ordered_keys"],
        s["unordered_keys"],
        s["retention_minutes"],
        s["relays"],
        s["invocation_secs"],
        s["producers"],
        m["cpus"],
        m["cpu_model"].as_str().unwrap_or("?"),
        f(&m["memory_gib"]),
        m["postgres_version"]
            .as_str()
            .unwrap_or("?")
            .split(" on ")
            .next()
            .unwrap_or("?"),
        m["load_before"]
            .as_array()
            .map(|a| a.iter().map(f).collect::<Vec<_>>())
            .unwrap_or_default(),
        run["load_after"]
            .as_array()
            .map(|a| a.iter().map(f).collect::<Vec<_>>())
            .unwrap_or_default(),
    );
    let settings: Vec<String> = run["autovacuum"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| Some(format!("`{}` = {}", p[0].as_str()?, p[1].as_str()?)))
        .collect();
    let pg: Vec<String> = m["postgres_settings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| Some(format!("`{}` = {}", p[0].as_str()?, p[1].as_str()?)))
        .collect();
    let _ = writeln!(w, "Postgres: {}.\n", pg.join(", "));
    let _ = writeln!(w, "Autovacuum: {}.\n", settings.join(", "));
    let a = &run["accounting"];
    let _ = writeln!(
        w,
        "**Accounting**: {} events produced; applied once {}, twice {}, lost {}, dead-lettered {}, per-key order \
         violations {}, left pending or leased {} — {}. Drained in {:.0} s after the producers stopped.\n",
        a["produced"],
        a["applied_once"],
        a["applied_twice"],
        a["lost"],
        a["dead_lettered"],
        a["order_violations"],
        a["left_leased"],
        if a["ok"].as_bool().unwrap_or(false) {
            "every event accounted for"
        } else {
            "**FAILED**"
        },
        f(&run["drain_secs"]),
    );
    let _ = writeln!(w, "| target | measured | |\n|---|---|---|");
    for t in run["targets"].as_array().into_iter().flatten() {
        let _ = writeln!(
            w,
            "| {} | {} | {} |",
            t["name"].as_str().unwrap_or("?"),
            t["measured"].as_str().unwrap_or("?"),
            if t["met"].as_bool().unwrap_or(false) {
                "met"
            } else {
                "**not met**"
            }
        );
    }
    let _ = writeln!(w);
    let [size, latency, throughput, cpu] = svgs(key);
    for (file, alt) in [
        (size, "table sizes over time"),
        (latency, "latency over time"),
        (throughput, "throughput and dead tuples over time"),
        (cpu, "CPU over time"),
    ] {
        let _ = writeln!(w, "![{alt}](benchmarks/{file})");
    }
    let _ = writeln!(w);
    let _ = writeln!(
        w,
        "| minute | produced | dispatched | applied | claim p50 / p99 ms | commit → applied p50 / p99 ms | outbox MB | \
         outbox dead tuples | processed_messages MB | autovacuums (outbox) | CPU relays / consumer+callbacks / postgres % |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let o = |v: &Value| v.as_f64().map_or("-".to_owned(), |v| format!("{v:.1}"));
    for m in run["per_minute"].as_array().into_iter().flatten() {
        let t = |name: &str| {
            m["tables"]
                .as_array()
                .and_then(|a| a.iter().find(|t| t["table"] == name))
                .cloned()
                .unwrap_or(Value::Null)
        };
        let (ob, pm) = (t("outbox"), t("processed_messages"));
        let _ = writeln!(
            w,
            "| {}{} | {} | {} | {} | {} / {} | {} / {} | {:.1} | {} | {:.1} | {} | {:.0} / {:.0} / {:.0} |",
            m["minute"],
            if m["pinned"].as_bool().unwrap_or(false) {
                " (pinned)"
            } else {
                ""
            },
            m["produced"],
            m["dispatched"],
            m["applied"],
            o(&m["claim_p50_ms"]),
            o(&m["claim_p99_ms"]),
            o(&m["commit_to_applied_p50_ms"]),
            o(&m["commit_to_applied_p99_ms"]),
            f(&m["outbox_bytes"]) / 1e6,
            ob["dead_tuples"],
            f(&pm["total_bytes"]) / 1e6,
            ob["autovacuum_count"],
            f(&m["relay_cpu_pct"]),
            f(&m["consumer_cpu_pct"]) + f(&m["callback_cpu_pct"]),
            f(&m["postgres_cpu_pct"]),
        );
    }
    let _ = writeln!(w);
}

/// The plot files a report holds for the runs in `figures` (the report test checks them).
pub fn files(figures: &Value) -> Vec<String> {
    KEYS.iter()
        .filter(|k| figures[**k].is_object())
        .flat_map(|k| svgs(k))
        .collect()
}
