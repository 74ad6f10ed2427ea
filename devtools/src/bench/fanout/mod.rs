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

use anyhow::{Context, bail};
use clap::Args;
use outbox::db::{Db, Statements};
use outbox::subscribers::{self, Start};
use outbox::{NewEvent, Topic};
use outbox_cli::util::DbArgs;
use outbox_testkit::median;
use serde_json::{Value, json};
use sqlx::PgPool;

use super::relay;
use super::support::{DevServerProcess, Knobs, ScratchDb, in_process_relay, load_average};

mod outage;
mod producer;
mod replay;
pub mod report;

const ORDERED: Topic = Topic::ordered("bench_ordered");
const UNORDERED: Topic = Topic::unordered("bench");
/// The live subscriber's topic in the replay scenario (the bench consumers handle `bench`).
const LIVE: Topic = UNORDERED;
/// The named subscribers (the default one is `consumer`).
const NAMED: [&str; 2] = ["billing", "search"];
const REPLAYED: &str = "ledger";
/// Events per QStash message.
const DELIVERY_BATCH: u32 = 50;

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

struct Plan {
    keys: u64,
    per_key: u64,
    unordered: u64,
    replay_keys: u64,
    replay_per_key: u64,
    live_rate: u64,
    baseline_secs: f64,
    outage_rate: u64,
    outage_keys: u64,
    outage_before_secs: f64,
    outage_down_secs: f64,
    outage_after_secs: f64,
    producer_events: u64,
}

impl Plan {
    fn new(quick: bool) -> Plan {
        if quick {
            Plan {
                keys: 50,
                per_key: 4,
                unordered: 500,
                replay_keys: 50,
                replay_per_key: 20,
                live_rate: 50,
                baseline_secs: 2.0,
                outage_rate: 50,
                outage_keys: 20,
                outage_before_secs: 2.0,
                outage_down_secs: 5.0,
                outage_after_secs: 2.0,
                producer_events: 400,
            }
        } else {
            Plan {
                keys: 1_000,
                per_key: 20,
                unordered: 20_000,
                replay_keys: 1_000,
                replay_per_key: 100,
                live_rate: 100,
                baseline_secs: 10.0,
                outage_rate: 100,
                outage_keys: 100,
                outage_before_secs: 10.0,
                outage_down_secs: 60.0,
                outage_after_secs: 5.0,
                producer_events: 8_000,
            }
        }
    }
}

/// The consumers: the default one first, then the named ones.
struct Rig {
    callback_url: String,
    consumers: Vec<(String, String)>,
    /// Takes the first named subscriber ([`NAMED`]`[0]`, "B") down: it answers 503 while true.
    b_down: std::sync::Arc<std::sync::atomic::AtomicBool>,
    stop: tokio::sync::watch::Sender<bool>,
}

impl Rig {
    /// The relay's variables for these consumers: the default one's URL, the callback receiver, consumer
    /// evidence, [`DELIVERY_BATCH`] events per message.
    fn relay_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("CONSUMER_URL", self.consumers[0].1.clone()),
            ("CALLBACK_URL", self.callback_url.clone()),
            ("QSTASH_RETRIES", "3".into()),
            ("RELAY_ORDERED_EVIDENCE", "consumer".into()),
            ("RELAY_DELIVERY_BATCH", DELIVERY_BATCH.to_string()),
        ]
    }
}

async fn rig(db: &ScratchDb) -> anyhow::Result<Rig> {
    let (stop, rx) = tokio::sync::watch::channel(false);
    let (default_url, callback_url, stop_default, _) = relay::ordered_endpoints(&db.url).await?;
    let mut consumers = vec![("consumer".to_owned(), default_url)];
    let b_down = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for (i, name) in NAMED.iter().chain([&REPLAYED]).enumerate() {
        let (url, _) = if i == 0 {
            relay::switchable_consumer_endpoint(&db.url, name, rx.clone(), b_down.clone()).await?
        } else {
            relay::consumer_endpoint(&db.url, name, rx.clone()).await?
        };
        consumers.push(((*name).to_owned(), url));
    }
    // One switch for all.
    let mut rx2 = rx.clone();
    tokio::spawn(async move {
        let _ = rx2.wait_for(|s| *s).await;
        let _ = stop_default.send(true);
    });
    Ok(Rig {
        callback_url,
        consumers,
        b_down,
        stop,
    })
}

/// Empties every table the drains use, and makes the first `subs - 1` named subscribers live for both topics.
async fn reset(db: &ScratchDb, rig: &Rig, subs: usize) -> anyhow::Result<()> {
    sqlx::query(
        "TRUNCATE outbox, outbox_keys, outbox_sequences, dead_letters, processed_messages, consumer_sequences, \
         outbox_subscribers",
    )
    .execute(&db.pool)
    .await?;
    let h = Db::new(db.pool.clone(), Statements::Prepared);
    for (name, url) in rig.consumers.iter().skip(1).take(subs - 1) {
        for topic in [ORDERED.name(), UNORDERED.name()] {
            subscribers::add(
                &h,
                topic,
                name,
                Some(url),
                Start::Now,
                Duration::from_secs(30),
            )
            .await?;
        }
    }
    Ok(())
}

/// Writes events through the producer's statement, 1,000 per transaction.
async fn produce(pool: &PgPool, events: Vec<NewEvent>) -> anyhow::Result<()> {
    for chunk in events.chunks(1_000) {
        let mut tx = pool.begin().await?;
        outbox::enqueue_batch(&mut tx, chunk).await?;
        tx.commit().await?;
    }
    Ok(())
}

fn ordered_events(keys: u64, per_key: u64) -> anyhow::Result<Vec<NewEvent>> {
    let mut out = Vec::with_capacity((keys * per_key) as usize);
    for s in 1..=per_key {
        for k in 1..=keys {
            out.push(NewEvent::new(
                &ORDERED,
                format!("key-{k}"),
                &json!({"k": k, "s": s, "pad": "x".repeat(170)}),
            )?);
        }
    }
    Ok(out)
}

fn unordered_events(n: u64) -> anyhow::Result<Vec<NewEvent>> {
    (0..n)
        .map(|i| {
            Ok(NewEvent::new(
                &UNORDERED,
                format!("k{}", i % 1000),
                &json!({"i": i, "pad": "x".repeat(170)}),
            )?)
        })
        .collect()
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

/// The median over `runs` of the number at `path` (keys into each run's JSON); NaN when no run has one.
fn median_at(runs: &[Value], path: &[&str]) -> f64 {
    let values: Vec<f64> = runs
        .iter()
        .filter_map(|r| path.iter().fold(r, |v, k| &v[*k]).as_f64())
        .collect();
    median(&values)
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

/// The live subscriber's latency over the live topic's events applied by `consumer` between `from` and `to`
/// (database clock).
struct LiveLatency {
    events: i64,
    /// Commit → applied, ms.
    p50_ms: f64,
    p99_ms: f64,
    /// Commit → accepted by QStash (the part spent in the outbox and the relay), ms.
    relay_p50_ms: f64,
    relay_p99_ms: f64,
}

impl LiveLatency {
    fn json(&self) -> Value {
        json!({
            "events": self.events,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "relay_p50_ms": self.relay_p50_ms,
            "relay_p99_ms": self.relay_p99_ms,
        })
    }
}

/// Commit → applied (and commit → accepted by QStash) of `topic`'s events written between `from` and `to`
/// (database clock) and applied by the default subscriber `consumer`.
async fn latency(
    pool: &PgPool,
    topic: &str,
    consumer: &str,
    from: chrono::DateTime<chrono::Utc>,
    to: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<LiveLatency> {
    let r: (i64, Option<f64>, Option<f64>, Option<f64>, Option<f64>) = sqlx::query_as(
        "WITH l AS (SELECT extract(epoch FROM p.processed_at - o.created_at) * 1000 AS applied, \
                           extract(epoch FROM o.dispatched_at - o.created_at) * 1000 AS relayed \
                    FROM processed_messages p JOIN outbox o ON o.id = p.message_id::bigint \
                    WHERE p.consumer = $4 AND o.topic = $1 AND o.created_at >= $2 AND o.created_at < $3) \
         SELECT count(*), \
                percentile_cont(0.5) WITHIN GROUP (ORDER BY applied)::float8, \
                percentile_cont(0.99) WITHIN GROUP (ORDER BY applied)::float8, \
                percentile_cont(0.5) WITHIN GROUP (ORDER BY relayed)::float8, \
                percentile_cont(0.99) WITHIN GROUP (ORDER BY relayed)::float8 \
         FROM l",
    )
    .bind(topic)
    .bind(from)
    .bind(to)
    .bind(consumer)
    .fetch_one(pool)
    .await?;
    let nan = |v: Option<f64>| v.unwrap_or(f64::NAN);
    Ok(LiveLatency {
        events: r.0,
        p50_ms: nan(r.1),
        p99_ms: nan(r.2),
        relay_p50_ms: nan(r.3),
        relay_p99_ms: nan(r.4),
    })
}

/// The database's clock now (the producers' `created_at` and the consumers' `processed_at` are on it).
async fn clock(pool: &PgPool) -> Result<chrono::DateTime<chrono::Utc>, sqlx::Error> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await
}

/// A relay in this process (the rig's settings, dedupe-row outcomes for unordered events, and `extra`), draining
/// until its stop handle is used: the handle and the drain's task.
async fn running_relay(
    db: &ScratchDb,
    dev: &DevServerProcess,
    rig: &Rig,
    knobs: Knobs,
    extra: &[(&'static str, String)],
) -> anyhow::Result<(
    outbox::relay::StopHandle,
    tokio::task::JoinHandle<Result<outbox::relay::DrainSummary, outbox::relay::RelayError>>,
)> {
    let mut env = rig.relay_env();
    env.push(("RELAY_UNORDERED_EVIDENCE", "dedupe".into()));
    env.extend(extra.iter().cloned());
    let relay = std::sync::Arc::new(in_process_relay(&db.url, &dev.url, knobs, &env).await?);
    let stop = relay.stop_handle();
    let draining = tokio::spawn(async move {
        relay
            .drain_with(
                tokio::time::Instant::now().into_std() + Duration::from_secs(3_600),
                outbox::relay::Until::Deadline,
            )
            .await
    });
    Ok((stop, draining))
}

/// A live producer: one event of `topic` per 1/`rate` s over `keys` keys, each in its own transaction, until the
/// returned sender says stop; its task returns how many it wrote.
fn steady_producer(
    pool: &PgPool,
    topic: Topic,
    rate: u64,
    keys: u64,
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<anyhow::Result<u64>>,
) {
    let (stop, rx) = tokio::sync::watch::channel(false);
    let pool = pool.clone();
    let task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
        let mut n = 0u64;
        while !*rx.borrow() {
            tick.tick().await;
            let e = NewEvent::new(&topic, format!("k{}", n % keys), &json!({"n": n}))?;
            let mut conn = pool.acquire().await?;
            outbox::enqueue(&mut conn, e).await?;
            n += 1;
        }
        anyhow::Ok(n)
    });
    (stop, task)
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
