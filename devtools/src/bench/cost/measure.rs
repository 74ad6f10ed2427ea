//! One configuration at a steady rate, counted: a producer commits one event per transaction while the relay runs
//! as its Lambda handler (`outbox::relay::handle`, invoked with the schedule's event and a deadline of the
//! function's timeout, again while events are left); the delivering dev server (its own process) delivers to the
//! real consumers and the callback receiver in this process, each invocation timed from the request handed to the
//! handler to its response. What QStash would count comes from the dev server's own counters; what Lambda would
//! count from the handlers' invocations.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox::db::{Db, Statements};
use outbox::producer::{NewEvent, Producer, Topic};
use outbox::relay::RelayState;
use outbox::subscribers::{self, Start};
use serde_json::{Value, json};

use super::plan::{Plan, Scenario};
use super::postgres::PgMeter;
use super::prices::Deployment;
use crate::bench::endpoints::{Endpoints, Invocations, consumer_endpoint, ordered_endpoints};
use crate::bench::support::{DevServerProcess, Knobs, ScratchDb, in_process_relay};

const ORDERED: Topic = Topic::ordered("bench_ordered");
const UNORDERED: Topic = Topic::unordered("bench");
/// The named subscribers of fan-out (the default one is `consumer`).
const NAMED: [&str; 2] = ["billing", "search"];
/// The dev server counters a run reads (differences over the run).
pub const COUNTERS: [&str; 10] = [
    "publish_requests",
    "accepted",
    "callbacks_created",
    "retries",
    "attempts",
    "callback_attempts",
    "delivered",
    "failed_to_dlq",
    "api_requests",
    "publish_bytes",
];

/// The receivers every configuration runs against.
pub struct Rig {
    endpoints: Endpoints,
    /// The named subscribers: name, URL, invocations.
    named: Vec<(String, String, Arc<Invocations>)>,
}

impl Rig {
    pub async fn start(db: &ScratchDb) -> anyhow::Result<Rig> {
        let endpoints = ordered_endpoints(&db.url).await?;
        let mut named = Vec::new();
        for name in NAMED {
            let (url, inv) = consumer_endpoint(&db.url, name, endpoints.stop.subscribe()).await?;
            named.push((name.to_owned(), url, inv));
        }
        Ok(Rig { endpoints, named })
    }

    /// The consumers of `subs` subscribers (the default one first).
    fn consumers(&self, subs: usize) -> Vec<(&str, &Invocations)> {
        std::iter::once(("consumer", &*self.endpoints.consumer))
            .chain(self.named.iter().map(|(n, _, i)| (n.as_str(), &**i)))
            .take(subs)
            .collect()
    }

    pub fn stop(&self) {
        let _ = self.endpoints.stop.send(true);
    }
}

/// Empties the tables and makes the first `subscribers - 1` named subscribers live for the scenario's topic.
async fn reset(db: &ScratchDb, rig: &Rig, s: &Scenario, topic: &Topic) -> anyhow::Result<()> {
    db.empty_pipeline_tables().await?;
    let h = Db::new(db.pool.clone(), Statements::Prepared);
    for (name, url, _) in rig.named.iter().take(s.subscribers - 1) {
        let at = Duration::from_secs(30);
        subscribers::add(&h, topic.name(), name, Some(url), Start::Now, at).await?;
    }
    Ok(())
}

/// The relay's invocations until `done`: each one's duration (handler start → response), ms.
async fn invocations(
    state: Arc<RelayState>,
    invocation: Duration,
    done: Arc<AtomicBool>,
) -> anyhow::Result<Vec<f64>> {
    let mut durations = Vec::new();
    let mut n = 0;
    while !done.load(Ordering::SeqCst) {
        n += 1;
        let event = outbox_testkit::lambda_event::scheduled(n, "outbox.bench", invocation);
        let started = Instant::now();
        let summary = outbox::relay::handle(&state, event).await;
        durations.push(started.elapsed().as_secs_f64() * 1000.0);
        summary.context("relay invocation")?;
        if n > 100 {
            bail!("100 relay invocations and the events are not all applied");
        }
    }
    Ok(durations)
}

/// Waits until every subscriber applied `events` events and the dev server has nothing left to deliver.
async fn settled(
    db: &ScratchDb,
    dev: &DevServerProcess,
    names: &[&str],
    events: u64,
    within: Duration,
) -> anyhow::Result<()> {
    let give_up = Instant::now() + within;
    loop {
        let counts: Vec<i64> = sqlx::query_scalar(
            "SELECT count(p.consumer) FROM unnest($1::text[]) n LEFT JOIN processed_messages p ON p.consumer = n \
             GROUP BY n ORDER BY n",
        )
        .bind(names)
        .fetch_all(&db.pool)
        .await?;
        let stats = dev.stats().await?;
        let idle = stats["in_flight"] == 0 && stats["waiting"] == 0;
        if counts.iter().all(|c| *c as u64 >= events) && idle {
            return Ok(());
        }
        if Instant::now() > give_up {
            bail!(
                "subscribers applied {counts:?} of {events} events (dev server {stats}) within {within:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Commits `events` events, one per transaction, at `plan.rate` per second over `plan.keys` keys.
async fn produce(db: &ScratchDb, topic: &Topic, plan: &Plan, events: u64) -> anyhow::Result<()> {
    let producer = Producer::default();
    let mut conn = db.pool.acquire().await?;
    let mut tick =
        tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(plan.rate.max(1))));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    for i in 0..events {
        tick.tick().await;
        let key = format!("k{}", i % plan.keys);
        producer
            .enqueue(&mut conn, NewEvent::new(topic, key, &json!({"i": i}))?)
            .await?;
    }
    Ok(())
}

/// Runs `s` and returns its raw counts (no price anywhere).
pub async fn scenario(
    db: &ScratchDb,
    dev: &DevServerProcess,
    rig: &Rig,
    s: &Scenario,
    plan: &Plan,
    deployment: &Deployment,
) -> anyhow::Result<Value> {
    let topic = if s.ordered { ORDERED } else { UNORDERED };
    reset(db, rig, s, &topic).await?;
    let events = plan.events();
    let invocation = plan
        .invocation
        .unwrap_or(Duration::from_secs_f64(deployment.relay_timeout_secs));
    let mut env = vec![
        ("CONSUMER_URL", rig.endpoints.consumer_url.clone()),
        ("CALLBACK_URL", rig.endpoints.callback_url.clone()),
        // The deployed poll interval (the benchmarks' relay polls every 20 ms otherwise).
        ("RELAY_POLL_INTERVAL_MS", "500".to_owned()),
    ];
    env.extend(plan.relay_env.iter().cloned());
    env.extend(s.env.iter().cloned());
    // The library's defaults: 500 rows per claim, 8 cycles in flight, 100 messages per `/v2/batch` request.
    let knobs = Knobs {
        batch: 500,
        concurrency: 8,
        qstash_batch: 100,
    };
    let relay = in_process_relay(&db.url, &dev.url, knobs, &env).await?;
    let state = Arc::new(RelayState::new(relay, "relay").with_metrics(false));
    let consumers = rig.consumers(s.subscribers);
    let names: Vec<&str> = consumers.iter().map(|(n, _)| *n).collect();
    let before: Vec<usize> = consumers
        .iter()
        .map(|(_, i)| i.durations_ms().len())
        .collect();
    let callbacks_before = rig.endpoints.callbacks.durations_ms().len();
    let stats0 = dev.stats().await?;
    let meter = PgMeter::start(&db.pool, &db.url).await?;
    let done = Arc::new(AtomicBool::new(false));
    let relay_task = tokio::spawn(invocations(state.clone(), invocation, done.clone()));
    let started = Instant::now();
    // The first invocation is under way (pool connected, subscribers declared) before the first event.
    tokio::time::sleep(Duration::from_millis(300)).await;
    produce(db, &topic, plan, events).await?;
    let produced_secs = started.elapsed().as_secs_f64();
    let waited = settled(db, dev, &names, events, invocation * 4).await;
    done.store(true, Ordering::SeqCst);
    let relay_ms = relay_task.await??;
    waited?;
    let wall_secs = started.elapsed().as_secs_f64();
    let postgres = meter.finish().await?;
    let stats1 = dev.stats().await?;
    state.relay.pool().close().await;
    let qstash: serde_json::Map<String, Value> = COUNTERS
        .iter()
        .map(|k| {
            let d = stats1[*k].as_u64().unwrap_or(0) - stats0[*k].as_u64().unwrap_or(0);
            ((*k).to_owned(), json!(d))
        })
        .collect();
    let consumer_ms: Vec<f64> = consumers
        .iter()
        .zip(&before)
        .flat_map(|((_, inv), from)| inv.durations_ms().split_off(*from))
        .collect();
    let callback_ms = rig
        .endpoints
        .callbacks
        .durations_ms()
        .split_off(callbacks_before);
    Ok(json!({
        "scenario": s.name,
        "label": s.label,
        "ordered": s.ordered,
        "subscribers": s.subscribers,
        "env": s.env.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>(),
        "events": events,
        "rate": plan.rate,
        "produced_secs": produced_secs,
        "wall_secs": wall_secs,
        "qstash": qstash,
        "relay": {"invocation_secs": invocation.as_secs_f64(), "durations_ms": relay_ms},
        "consumer": {"invocations": consumer_ms.len(), "durations_ms": consumer_ms},
        "callbacks": {"invocations": callback_ms.len(), "durations_ms": callback_ms},
        "postgres": postgres,
    }))
}
