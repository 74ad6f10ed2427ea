//! The report's "Batched deliveries" section (Markdown), from the figures alone.

use serde_json::Value;

use super::chart::SVG;
use super::plan::DELIVERY_BATCH_VAR;
use super::targets::{target_figure, targets};

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
