//! The targets of the batched scenarios (issue 25), each a ratio within one run, with its figure and verdict.

use serde_json::{Value, json};

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
