//! Scenario "Fan-out" (decision record 0068): the same drains with 1 and with 3 subscribers side by side in one run,
//! a replay of retained history to a new subscriber while a live subscriber takes a steady rate, and a subscriber
//! down for a minute beside a healthy one. `--only throughput|replay|outage` runs one part.
//!
//! Throughput, for each number of subscribers, alternating within each round: events written through the
//! producer's statement (so each subscriber gets its copy), drained by the relay process (`outbox relay
//! --until-empty`, `RELAY_DELIVERY_BATCH=50`, consumer evidence) through the delivering dev server into one real
//! consumer per subscriber (its own `CONSUMER_NAME`). Per subscriber: events/s from the relay's start to its last
//! dedupe row; QStash messages per event per subscriber (the dev server's `accepted`); the relay process's CPU per
//! event and per copy.
//!
//! Replay (`replay.rs`): 100,000 ordered events (1,000 keys × 100) retained and done for the default subscriber; a live
//! producer writes 100 events/s on the unordered topic; after a baseline window a subscriber is added `--from` the first
//! event and its history copied (`subscribers::replay`), while the relay (in this process) keeps serving both. The
//! replay's events/s (first copy → last applied) and the live subscriber's commit → applied p50/p99 in the
//! baseline window and during the replay; run unpaced (`QSTASH_REPLAY_PARALLELISM` 1000) and then paced at the
//! default.
//!
//! Producer (`producer.rs`): the producer's statement (and its commit) with 1 and with 3 subscribers, four
//! producers at once, no relay: what each subscriber's copy adds to the business transaction.
//!
//! Outage (`outage.rs`): A and B subscribe to the ordered topic; a producer writes 100 events/s for 75 s; B
//! answers 503 for the middle 60 s in one run and stays healthy in the other, alternating, two of each (medians).
//! A's events/s and commit → applied over that minute side by side, and B's catch-up (every event once, every key
//! in order, no dead letter). This part's dev server runs QStash's retry delays 20× faster.

use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use outbox_cli::util::DbArgs;
use serde_json::{Value, json};

use super::relay;
use super::support::{DevServerProcess, Knobs, ScratchDb, load_average};

mod figures;
mod outage;
mod plan;
mod producer;
mod replay;
pub mod report;
mod rig;
mod traffic;

use figures::median_at;
use plan::Plan;
use rig::{DELIVERY_BATCH, Rig, reset, rig};
use traffic::{ordered_events, produce, unordered_events};

/// `outbox-dev bench fanout`.
#[derive(Args, Debug)]
pub struct FanoutArgs {
    /// Small sizes (seconds): for checking the command.
    #[arg(long)]
    pub quick: bool,
    /// Rounds per throughput point (medians are reported).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Run one part only (`throughput` or `replay`), e.g. while tuning it; not with `--report`.
    #[arg(long, value_enum)]
    pub only: Option<Part>,
    /// Also write the figures into DIR/benchmarks.md (its fan-out section) and DIR/benchmarks/figures.json
    /// (`--report docs`).
    #[arg(long)]
    pub report: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub db: DbArgs,
}

/// The parts of `bench fanout`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// Drains with 1 and 3 subscribers, ordered and unordered.
    Throughput,
    /// The replay to a new subscriber beside a live one.
    Replay,
    /// Subscriber B down for a minute beside A (`--quick`: 5 s), against a run with B healthy.
    Outage,
    /// The producer's statement with 1 and with 3 subscribers (a copy each).
    Producer,
}

/// One drain: events/s per subscriber (relay start → its last dedupe row), messages per event per subscriber,
/// relay CPU per event and per copy.
async fn drain(
    db: &ScratchDb,
    dev: &DevServerProcess,
    rig: &Rig,
    knobs: Knobs,
    subs: usize,
    ordered: bool,
    plan: &Plan,
) -> anyhow::Result<Value> {
    reset(db, rig, subs).await?;
    let (events, batch) = if ordered {
        (
            plan.keys * plan.per_key,
            ordered_events(plan.keys, plan.per_key)?,
        )
    } else {
        (plan.unordered, unordered_events(plan.unordered)?)
    };
    produce(&db.pool, batch).await?;
    sqlx::query("VACUUM ANALYZE outbox")
        .execute(&db.pool)
        .await?;
    let m0 = dev.accepted().await?;
    let started_at: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&db.pool)
        .await?;
    let out = relay::relay_child(&db.url, &dev.url, knobs, &rig.relay_env()).await?;
    let names: Vec<&str> = rig
        .consumers
        .iter()
        .take(subs)
        .map(|(n, _)| n.as_str())
        .collect();
    let give_up = Instant::now() + Duration::from_secs(300);
    let per: Vec<(String, i64, f64)> = loop {
        let rows: Vec<(String, i64, f64)> = sqlx::query_as(
            "SELECT consumer, count(*), extract(epoch FROM max(processed_at) - $2)::float8 \
             FROM processed_messages WHERE consumer = ANY($1) GROUP BY consumer ORDER BY consumer",
        )
        .bind(&names)
        .bind(started_at)
        .fetch_all(&db.pool)
        .await?;
        if rows.len() == subs && rows.iter().all(|r| r.1 as u64 >= events) {
            break rows;
        }
        if Instant::now() > give_up {
            bail!("subscribers applied {rows:?} of {events} events each within 300 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let messages = dev.accepted().await? - m0;
    let cpu = out["cpu_secs"].as_f64().unwrap_or(f64::NAN);
    let rates: Vec<f64> = per.iter().map(|(_, n, secs)| *n as f64 / secs).collect();
    Ok(json!({
        "subscribers": subs,
        "events": events,
        "per_subscriber": per.iter().zip(&rates).map(|((name, n, secs), r)| json!({
            "subscriber": name, "applied": n, "secs": secs, "events_per_sec": r})).collect::<Vec<_>>(),
        "events_per_sec_per_subscriber_min": rates.iter().copied().fold(f64::INFINITY, f64::min),
        "qstash_messages_per_event_per_subscriber": messages as f64 / (events as f64 * subs as f64),
        "relay_cpu_us_per_event": cpu * 1e6 / events as f64,
        "relay_cpu_us_per_copy": cpu * 1e6 / (events as f64 * subs as f64),
        "relay_secs": out["elapsed_secs"],
    }))
}

/// The medians of one (kind, subscribers) point over its rounds.
fn point(runs: &[Value]) -> Value {
    let m = |k: &str| median_at(runs, &[k]);
    json!({
        "subscribers": runs[0]["subscribers"],
        "events": runs[0]["events"],
        "events_per_sec_per_subscriber": m("events_per_sec_per_subscriber_min"),
        "qstash_messages_per_event_per_subscriber": m("qstash_messages_per_event_per_subscriber"),
        "relay_cpu_us_per_event": m("relay_cpu_us_per_event"),
        "relay_cpu_us_per_copy": m("relay_cpu_us_per_copy"),
        "rounds": runs,
    })
}

/// `outbox-dev bench fanout`: prints each drain as it ends, the medians, and one `BENCH_JSON` line.
pub async fn run(args: FanoutArgs) -> anyhow::Result<()> {
    if args.only.is_some() && args.report.is_some() {
        bail!("--report needs every part: leave out --only");
    }
    let runs_part = |p: Part| args.only.is_none_or(|o| o == p);
    let plan = Plan::new(args.quick);
    let rounds = if args.quick { 1 } else { args.rounds.max(1) };
    let knobs = Knobs {
        batch: 500,
        concurrency: 8,
        qstash_batch: 100,
    };
    let load_before = load_average();
    let db = ScratchDb::create(&args.db.database_url, "outbox_bench_fanout").await?;
    let dev = DevServerProcess::start(&["--deliver", "true"]).await?;
    let rig = rig(&db).await?;
    let result = async {
        let mut runs: Vec<Vec<Value>> = vec![Vec::new(); 4];
        for round in 0..if runs_part(Part::Throughput) { rounds } else { 0 } {
            for (i, (ordered, subs)) in [(true, 1), (true, 3), (false, 1), (false, 3)].into_iter().enumerate() {
                let r = drain(&db, &dev, &rig, knobs, subs, ordered, &plan).await?;
                println!(
                    "fanout round {}: {} {} events, {subs} subscriber(s): {:.0} events/s per subscriber (slowest), \
                     {:.4} QStash messages per event per subscriber, relay CPU {:.1} µs/event ({:.1} µs/copy)",
                    round + 1,
                    if ordered { "ordered" } else { "unordered" },
                    r["events"],
                    r["events_per_sec_per_subscriber_min"].as_f64().unwrap_or(f64::NAN),
                    r["qstash_messages_per_event_per_subscriber"].as_f64().unwrap_or(f64::NAN),
                    r["relay_cpu_us_per_event"].as_f64().unwrap_or(f64::NAN),
                    r["relay_cpu_us_per_copy"].as_f64().unwrap_or(f64::NAN),
                );
                runs[i].push(r);
            }
        }
        let mut figures = json!({
            "generated_at": chrono::Utc::now().to_rfc3339(),
            "mode": if args.quick { "quick" } else { "full" },
            "rounds": rounds,
            "delivery_batch": DELIVERY_BATCH,
        });
        if runs_part(Part::Throughput) {
            figures["ordered"] = json!([point(&runs[0]), point(&runs[1])]);
            figures["unordered"] = json!([point(&runs[2]), point(&runs[3])]);
        }
        if runs_part(Part::Replay) {
            for (key, r) in replay::part(&db, &dev, &rig, knobs, &plan).await? {
                figures[key] = r;
            }
        }
        if runs_part(Part::Producer) {
            figures["producer"] = producer::part(&db, &rig, &plan, rounds).await?;
        }
        if runs_part(Part::Outage) {
            figures["outage"] = outage::part(&db, &rig, knobs, &plan).await?;
        }
        anyhow::Ok(figures)
    }
    .await;
    let _ = rig.stop.send(true);
    dev.stop().await;
    db.drop_now().await?;
    let mut figures = result?;
    figures["load_before"] = json!(load_before);
    figures["load_after"] = json!(load_average());
    for kind in ["ordered", "unordered"] {
        for p in figures[kind].as_array().into_iter().flatten() {
            println!(
                "{kind:>9}, {} subscriber(s): {:.0} events/s per subscriber, {:.4} messages/event/subscriber, \
                 relay CPU {:.1} µs/event",
                p["subscribers"],
                p["events_per_sec_per_subscriber"]
                    .as_f64()
                    .unwrap_or(f64::NAN),
                p["qstash_messages_per_event_per_subscriber"]
                    .as_f64()
                    .unwrap_or(f64::NAN),
                p["relay_cpu_us_per_event"].as_f64().unwrap_or(f64::NAN),
            );
        }
    }
    println!(
        "BENCH_JSON {}",
        serde_json::to_string(&json!({ "fanout": figures }))?
    );
    if let Some(dir) = &args.report {
        for path in report::write(dir, &figures)? {
            println!("wrote {}", path.display());
        }
    }
    Ok(())
}
