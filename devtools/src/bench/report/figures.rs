//! Figures the report derives and shows: a figure as a number, the share of the SQL-only cycle the relay can reach
//! at most on the machine's cores, the unordered targets and the words for a concurrency.

use serde_json::{Value, json};

/// A figure as a number; NaN when it is missing or not a number.
pub(super) fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// The share of the SQL-only cycle the relay can reach at most when the SQL-only cycle keeps every core busy
/// and each relayed event also costs `relay_us + dev_us` µs of CPU on the same cores (the relay's own process
/// and the dev server standing in for QStash): `1 / (1 + (relay_us + dev_us) · sql_rate / (cores · 10⁶))`.
pub fn cpu_ceiling(point: &Value, cores: f64) -> f64 {
    let extra_us = f(&point["relay_cpu_us_per_event"]) + f(&point["dev_server_cpu_us_per_event"]);
    1.0 / (1.0 + extra_us * f(&point["sql_only_median"]) / (cores * 1e6))
}

/// `1 cycle in flight`, `8 cycles in flight`.
pub fn in_flight(concurrency: &Value) -> String {
    if concurrency.as_u64() == Some(1) {
        "1 cycle in flight".into()
    } else {
        format!("{concurrency} cycles in flight")
    }
}

/// The unordered target of issue 25: the relay at ≥ 80 % of the SQL-only cycle at every claim size and
/// concurrency of the report (`{what, measured, target, unit, met}` per point, as [`batched::targets`]).
///
/// [`batched::targets`]: crate::bench::batched::targets
pub fn unordered_targets(by_batch: &Value, by_conc: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    for v in [by_batch, by_conc] {
        for p in v["points"].as_array().into_iter().flatten() {
            let m = f(&p["relay_vs_sql_only"]);
            let what = format!(
                "unordered relay / SQL-only cycle, {} rows per claim, {}",
                p["batch"],
                in_flight(&p["concurrency"])
            );
            if out.iter().any(|t: &Value| t["what"] == what.as_str()) {
                continue;
            }
            out.push(json!({ "what": what, "measured": m, "target": 0.8, "unit": "share", "met": m >= 0.8 }));
        }
    }
    out
}
