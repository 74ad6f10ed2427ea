//! The scenario's plot: each throughput scenario's speed-up over the first N.

use std::path::Path;

use serde_json::Value;

use crate::bench::plot::{self, Series, XScale};

/// The plot's file name under `benchmarks/`.
pub const SVG: &str = "batched-deliveries.svg";

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
