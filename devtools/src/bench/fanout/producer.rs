//! The producer part of `bench fanout` (module docs of `super`): the producer's statement with 1 and with 3
//! subscribers.

use std::time::Instant;

use serde_json::{Value, json};

use outbox::NewEvent;

use super::figures::median_at;
use super::plan::Plan;
use super::rig::{Rig, reset};
use super::traffic::{ordered_events, unordered_events};
use crate::bench::support::ScratchDb;

/// `rounds` of each point, alternating; medians.
pub(super) async fn part(
    db: &ScratchDb,
    rig: &Rig,
    plan: &Plan,
    rounds: usize,
) -> anyhow::Result<Value> {
    let mut runs: Vec<Vec<Value>> = vec![Vec::new(); 4];
    for _ in 0..rounds {
        for (i, (ordered, subs)) in [(true, 1), (true, 3), (false, 1), (false, 3)]
            .into_iter()
            .enumerate()
        {
            let r = producer_run(db, rig, plan, subs, ordered).await?;
            println!(
                "fanout producer: {} events, {subs} subscriber(s): {:.0} events/s, p50 {:.2} ms, p99 {:.2} ms",
                if ordered { "ordered" } else { "unordered" },
                r["events_per_sec"].as_f64().unwrap_or(f64::NAN),
                r["p50_ms"].as_f64().unwrap_or(f64::NAN),
                r["p99_ms"].as_f64().unwrap_or(f64::NAN),
            );
            runs[i].push(r);
        }
    }
    let point = |runs: &[Value]| {
        let m = |k: &str| median_at(runs, &[k]);
        json!({
            "subscribers": runs[0]["subscribers"],
            "events": runs[0]["events"],
            "events_per_sec": m("events_per_sec"),
            "p50_ms": m("p50_ms"),
            "p99_ms": m("p99_ms"),
            "rounds": runs,
        })
    };
    Ok(json!({
        "producers": PRODUCERS,
        "ordered": [point(&runs[0]), point(&runs[1])],
        "unordered": [point(&runs[2]), point(&runs[3])],
    }))
}

/// Producer tasks writing at once in the producer part.
const PRODUCERS: usize = 4;

/// The producer part (module docs): `plan.producer_events` events of one topic (ordered: over 1,000 keys), each
/// `outbox::enqueue` in a transaction of its own (the statement and its commit), from [`PRODUCERS`] tasks with a
/// connection each, with `subs` subscribers; no relay runs. Per event: p50/p99 ms; all: events/s.
async fn producer_run(
    db: &ScratchDb,
    rig: &Rig,
    plan: &Plan,
    subs: usize,
    ordered: bool,
) -> anyhow::Result<Value> {
    reset(db, rig, subs).await?;
    let events = if ordered {
        ordered_events(1_000, (plan.producer_events / 1_000).max(1))?
    } else {
        unordered_events(plan.producer_events)?
    };
    let n = events.len();
    let mut lists: Vec<Vec<NewEvent>> = (0..PRODUCERS).map(|_| Vec::new()).collect();
    for (i, e) in events.into_iter().enumerate() {
        lists[i % PRODUCERS].push(e);
    }
    let started = Instant::now();
    let tasks: Vec<_> = lists
        .into_iter()
        .map(|list| {
            let pool = db.pool.clone();
            tokio::spawn(async move {
                let mut conn = pool.acquire().await?;
                let mut ms = Vec::with_capacity(list.len());
                for e in list {
                    let t = Instant::now();
                    outbox::enqueue(&mut conn, e).await?;
                    ms.push(t.elapsed().as_secs_f64() * 1000.0);
                }
                anyhow::Ok(ms)
            })
        })
        .collect();
    let mut ms = Vec::with_capacity(n);
    for t in tasks {
        ms.extend(t.await??);
    }
    let secs = started.elapsed().as_secs_f64();
    let copies: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&db.pool)
        .await?;
    anyhow::ensure!(
        copies as usize == n * subs,
        "{n} events with {subs} subscribers wrote {copies} rows"
    );
    Ok(json!({
        "subscribers": subs,
        "events": n,
        "events_per_sec": n as f64 / secs,
        "p50_ms": outbox_testkit::percentile(&ms, 0.5),
        "p99_ms": outbox_testkit::percentile(&ms, 0.99),
    }))
}
