//! The fairness section of `benchmarks.md` and its entry in `figures.json`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

const BEGIN: &str = "<!-- fairness:begin -->";
const END: &str = "<!-- fairness:end -->";
/// The run's key in `figures.json`.
const KEY: &str = "fairness";

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

/// The section, from a run's figures.
pub fn section(run: &Value) -> String {
    let mut o = String::new();
    let w = &mut o;
    let _ = writeln!(w, "{BEGIN}");
    let _ = writeln!(w, "## Fairness between tenants\n");
    let _ = writeln!(
        w,
        "Tenant A imports {} events (transactions of 1,000, committed before the relay starts: a backlog of the \
         whole import) while {} other tenants write {} events/s each, one per transaction, on an unordered topic with batched deliveries (50 events per message), \
         through the relay (this process), the delivering dev server and the real consumer; each run on a fresh \
         database. The others' commit → applied is measured over the events they wrote while A's import was \
         waiting; A's rate is its events over first commit → last applied. `outbox-dev bench fairness` (decision \
         record 0076). Load average before/after: {:.1}/{:.1}.\n",
        run["flood"],
        run["tenants"],
        run["rate_per_tenant"],
        f(&run["load_average_before"][0]),
        f(&run["load_average_after"][0]),
    );
    let _ = writeln!(
        w,
        "| run | the others' p50 (ms) | p99 (ms) | p99 vs no flood | A's events/s | vs A alone |"
    );
    let _ = writeln!(w, "|---|---:|---:|---:|---:|---:|");
    let runs = &run["runs"];
    let alone_p99 = f(&runs["others_alone"]["others_applied_ms"]["p99"]);
    let alone_rate = f(&runs["flood_alone"]["flood_events_per_sec"]);
    for (key, label) in [
        ("others_alone", "the others, no flood".to_owned()),
        ("flood_alone", "A's import alone".to_owned()),
        ("flood_fair", "import, fair claims (default)".to_owned()),
        (
            "flood_oldest_first",
            "import, `RELAY_FAIR_CLAIMS=false`".to_owned(),
        ),
        (
            "flood_limited",
            format!(
                "import, fair, every tenant limited to {} messages/s",
                run["limit_rate"]
            ),
        ),
    ] {
        let r = &runs[key];
        let others = r["others_events"].as_u64().unwrap_or(0) > 0;
        let flood = r["flood_events"].as_u64().unwrap_or(0) > 0;
        let cell = |on: bool, text: String| if on { text } else { "—".to_owned() };
        let p99 = f(&r["others_applied_ms"]["p99"]);
        let rate = f(&r["flood_events_per_sec"]);
        let _ = writeln!(
            w,
            "| {label} | {} | {} | {} | {} | {} |",
            cell(others, format!("{:.0}", f(&r["others_applied_ms"]["p50"]))),
            cell(others, format!("{p99:.0}")),
            cell(
                others && key != "others_alone" && alone_p99 > 0.0,
                format!("{:.2}×", p99 / alone_p99)
            ),
            cell(flood, format!("{rate:.0}")),
            cell(
                flood && key != "flood_alone" && alone_rate > 0.0,
                format!("{:.0} %", 100.0 * rate / alone_rate)
            ),
        );
    }
    let fair_p99 = f(&run["others_p99_vs_alone"]["fair"]);
    let fair_drain = f(&run["flood_drain_vs_alone"]["fair"]);
    let _ = writeln!(
        w,
        "\nTargets (issue 39): the others' p99 during the import within 2× of no flood — {:.2}×, {}; A's rate at \
         least 90 % of A alone — {:.0} %, {}.\n",
        fair_p99,
        if fair_p99 <= 2.0 { "met" } else { "not met" },
        100.0 * fair_drain,
        if fair_drain >= 0.9 { "met" } else { "not met" },
    );
    let _ = writeln!(
        w,
        "Reproduce: `cargo build --release -p outbox-devtools -p qstash-dev`, then `target/release/outbox-dev bench \
         fairness --report docs` (about 5 minutes).\n"
    );
    let _ = writeln!(w, "{END}");
    o
}

/// Stores the run under [`KEY`] in `dir/benchmarks/figures.json` and rewrites the section of `dir/benchmarks.md`.
pub fn write(dir: &Path, run: &Value) -> anyhow::Result<Vec<PathBuf>> {
    super::super::support::write_section(dir, KEY, run, |_| section(run), [BEGIN, END])
}
