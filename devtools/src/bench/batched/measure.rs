//! The measurements: for every N, alternating within each round, the ordered, hot-key and unordered drains end to
//! end (time, QStash messages and consumer requests, the SQL-only ordered protocol beside each ordered point),
//! then commit → applied at a low steady rate; medians and ratios as JSON.

use std::time::{Duration, Instant};

use anyhow::bail;
use outbox_testkit::median;
use serde_json::{Value, json};

use super::plan::{BatchedPlan, DELIVERY_BATCH_VAR, env};
use crate::bench::relay::{self, OrderedRig};
use crate::bench::steady;
use crate::bench::support::{DevServerProcess, Knobs, ScratchDb};

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
