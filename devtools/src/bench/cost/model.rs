//! The cost model: a scenario's raw counts per million events (and per subscriber), then the price table applied
//! to them, kept apart. The relay runs on its schedule whatever the traffic: its invocations a month × its
//! measured invocation duration is a fixed monthly cost, spread over the events of a month at a given rate.

use outbox_testkit::median;
use serde_json::{Value, json};

use super::prices::{Deployment, price};

/// Seconds in the 30-day month the model bills.
pub const MONTH_SECS: f64 = 30.0 * 86_400.0;

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn durations(v: &Value) -> Vec<f64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

/// GB-seconds of invocations lasting `ms` each (rounded up to 1 ms, as Lambda bills) at `memory_mb`.
pub fn gb_seconds(ms: &[f64], memory_mb: f64) -> f64 {
    // A fold from +0.0: an empty sum of f64 is -0.0.
    ms.iter().fold(0.0, |sum, d| sum + d.ceil() / 1000.0) * memory_mb / 1024.0
}

/// A run's counts per million events: QStash messages billed (publishes and callbacks), retries, API requests and
/// bytes; the consumer's and the callback receiver's invocations and GB-seconds; Postgres CPU seconds and WAL
/// bytes. No price.
pub fn counts(run: &Value, d: &Deployment) -> Value {
    let per_m = 1e6 / f(&run["events"]);
    let q = &run["qstash"];
    let consumer = durations(&run["consumer"]["durations_ms"]);
    let callbacks = durations(&run["callbacks"]["durations_ms"]);
    let pg = &run["postgres"];
    let pm = |v: f64| v * per_m;
    json!({
        "qstash_publishes": pm(f(&q["accepted"])),
        "qstash_callbacks": pm(f(&q["callbacks_created"])),
        "qstash_messages": pm(f(&q["accepted"]) + f(&q["callbacks_created"])),
        "qstash_retries": pm(f(&q["retries"])),
        "qstash_api_requests": pm(f(&q["api_requests"])),
        "qstash_bytes": pm(f(&q["publish_bytes"])),
        "consumer_invocations": pm(consumer.len() as f64),
        "consumer_gb_seconds": pm(gb_seconds(&consumer, d.consumer_memory_mb)),
        "consumer_ms_p50": median(&consumer),
        "callback_invocations": pm(callbacks.len() as f64),
        "callback_gb_seconds": pm(gb_seconds(&callbacks, d.callback_memory_mb)),
        "callback_ms_p50": median(&callbacks),
        "postgres_cpu_secs": pg["cpu_secs"].as_f64().map(pm),
        "postgres_wal_bytes": pg["wal_bytes"].as_f64().map(pm),
    })
}

/// The relay's schedule for a month: invocations, the measured invocation's duration (median), GB-seconds.
pub fn relay_month(runs: &[Value], d: &Deployment) -> Value {
    let ms: Vec<f64> = runs
        .iter()
        .flat_map(|r| durations(&r["relay"]["durations_ms"]))
        .collect();
    let each = median(&ms).ceil();
    let gbs = d.relay_invocations_per_month * each / 1000.0 * d.relay_memory_mb / 1024.0;
    json!({
        "invocations": d.relay_invocations_per_month,
        "duration_ms_p50": each,
        "invocation_secs": runs.first().map(|r| r["relay"]["invocation_secs"].clone()),
        "measured_invocations": ms.len(),
        "gb_seconds": gbs,
        "usd": price("lambda_request").of(d.relay_invocations_per_month) + price("lambda_gb_second").of(gbs),
    })
}

/// The prices applied to one run's counts per million events: dollars per million events by component.
pub fn usd_per_million(c: &Value) -> Value {
    let qstash = price("qstash_message").of(f(&c["qstash_messages"]))
        + price("qstash_retry").of(f(&c["qstash_retries"]))
        + price("qstash_api_request").of(f(&c["qstash_api_requests"]))
        + price("qstash_bandwidth").of(f(&c["qstash_bytes"]));
    let lambda = |inv: &str, gbs: &str| {
        price("lambda_request").of(f(&c[inv])) + price("lambda_gb_second").of(f(&c[gbs]))
    };
    let consumer = lambda("consumer_invocations", "consumer_gb_seconds");
    let callbacks = lambda("callback_invocations", "callback_gb_seconds");
    json!({
        "qstash": qstash,
        "consumer": consumer,
        "callbacks": callbacks,
        "variable": qstash + consumer + callbacks,
    })
}

/// Dollars per million events at `rate` events/s: the variable cost plus the relay's month spread over the
/// month's events.
pub fn usd_per_million_at(variable: f64, relay_month_usd: f64, rate: f64) -> f64 {
    variable + relay_month_usd / (rate * MONTH_SECS / 1e6)
}

/// The model over a run's scenarios: each one's counts and dollars, and the relay's month.
pub fn model(runs: &[Value], d: &Deployment) -> Value {
    let relay = relay_month(runs, d);
    let rows: Vec<Value> = runs
        .iter()
        .map(|r| {
            let c = counts(r, d);
            let usd = usd_per_million(&c);
            let rate = f(&r["rate"]);
            json!({
                "scenario": r["scenario"], "label": r["label"], "ordered": r["ordered"],
                "subscribers": r["subscribers"], "events": r["events"], "rate": rate,
                "per_million_events": c,
                "usd_per_million_events": usd,
                "usd_per_million_events_at_rate": usd_per_million_at(f(&usd["variable"]), f(&relay["usd"]), rate),
            })
        })
        .collect();
    json!({"relay_month": relay, "rows": rows})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn billed_durations_round_up_to_the_millisecond() {
        assert_eq!(gb_seconds(&[0.2, 1.0, 1.5], 1024.0), 0.004);
        assert!((usd_per_million_at(1.0, 10.0, 1.0) - (1.0 + 10.0 / 2.592)).abs() < 1e-9);
    }
}
