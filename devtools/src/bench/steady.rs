//! Scenario: commit → applied latency under a steady producer rate. A producer commits one event at a time at a
//! fixed rate (with the `NOTIFY` wake-up hint); the relay (built from the Lambda's configuration, listening for
//! the hint) publishes to the dev server, which delivers to the real consumer (signature, dedupe row, a handler
//! that stamps the time it applied the event). Every latency is a difference of two Postgres clock readings:
//! the event's `created_at` (its one-statement transaction) to the consumer's stamp, and, as the same-run
//! reference for the relay's share, `created_at` to `dispatched_at`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::bail;
use outbox::consumer::{Event, Handler, HandlerError};
use outbox::producer::{NewEvent, Producer, Topic};
use outbox_testkit::percentile;
use serde_json::{Value, json};
use sqlx::PgConnection;

use super::support::{DevServerProcess, Knobs, ScratchDb, in_process_relay};

pub(super) const TOPIC: Topic = Topic::unordered("bench_steady");

/// Stamps the moment the consumer applied the event, in the consumer's transaction.
struct Stamp;

impl Handler<Value> for Stamp {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        event: &Event<Value>,
    ) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO bench_applied (outbox_id) VALUES ($1)")
            .bind(event.meta.outbox_id)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

/// The real consumer on a local port, on `db_url`. Sending `true` stops it; the counter counts its HTTP requests.
pub(super) async fn consumer_endpoint(
    db_url: &str,
) -> anyhow::Result<(String, tokio::sync::watch::Sender<bool>, Arc<AtomicU64>)> {
    use outbox::ReceiverState;
    use outbox::config::{ConsumerConfig, Vars};
    use outbox::internals::receiver::{KeyRing, SigningKeys};
    let (tx, rx) = tokio::sync::watch::channel(false);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let mut cfg = ConsumerConfig::from_vars(&Vars::new(&std::collections::HashMap::<
        String,
        String,
    >::new()))?;
    cfg.public_base_url = Some(url.clone());
    let mut db = outbox::db::DbConfig::defaults("bench-consumer");
    db.max_connections = 8;
    let consumer = std::sync::Arc::new(outbox::consumer::ConsumerState::new(
        ReceiverState::new(
            cfg,
            db.handle(&secrecy::SecretString::from(db_url.to_owned()))?,
            KeyRing::fixed(SigningKeys::new(
                qstash_dev::DEV_CURRENT_SIGNING_KEY,
                Some(qstash_dev::DEV_NEXT_SIGNING_KEY.to_owned()),
            )),
        )
        .with_metrics(false),
        outbox::consumer::Registry::new().on(TOPIC.name(), Stamp),
    ));
    let requests = Arc::new(AtomicU64::new(0));
    let counted = requests.clone();
    let mut rx = rx.clone();
    tokio::spawn(outbox::local::serve(
        listener,
        move |req| {
            let c = consumer.clone();
            counted.fetch_add(1, Ordering::Relaxed);
            async move { outbox::consumer::handle_event(&c, req).await }
        },
        async move {
            let _ = rx.wait_for(|s| *s).await;
        },
    ));
    Ok((url, tx, requests))
}

/// The relay of a run, built from the Lambda's configuration, draining in the background.
pub(super) struct Draining {
    relay: Arc<outbox::relay::Relay>,
    task: tokio::task::JoinHandle<Result<outbox::relay::DrainSummary, outbox::relay::RelayError>>,
}

impl Draining {
    /// Builds the relay for the dev server at `dev_url` and the consumer at `consumer_url`, listening for the
    /// `NOTIFY` hint with the default 500 ms poll (the hint, not polling, keeps latency low), `extra` on top; starts
    /// its drain and gives it half a second to connect and listen before the first event.
    pub(super) async fn start(
        db_url: &str,
        dev_url: &str,
        consumer_url: String,
        knobs: Knobs,
        extra: &[(&str, String)],
    ) -> anyhow::Result<Draining> {
        let mut env = vec![
            ("CONSUMER_URL", consumer_url),
            ("RELAY_LISTEN_NOTIFY", "true".into()),
            ("RELAY_POLL_INTERVAL_MS", "500".into()),
        ];
        env.extend(extra.iter().cloned());
        let relay = Arc::new(in_process_relay(db_url, dev_url, knobs, &env).await?);
        let task = {
            let relay = relay.clone();
            tokio::spawn(async move {
                relay
                    .drain(Instant::now() + Duration::from_secs(3600))
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok(Draining { relay, task })
    }

    /// Stops the drain after its current cycles (every claim settled) and closes the relay's pool.
    pub(super) async fn stop(self) -> anyhow::Result<outbox::relay::DrainSummary> {
        self.relay.stop_handle().stop();
        let summary = self.task.await??;
        self.relay.pool().close().await;
        Ok(summary)
    }
}

/// Produces at `rate` events/s for `secs` seconds, waits until every event is applied, and returns the latency
/// distributions. `extra` adds relay configuration variables (e.g. `RELAY_DELIVERY_BATCH`).
pub async fn run(
    base_url: &str,
    rate: u32,
    secs: f64,
    knobs: Knobs,
    extra: &[(&str, String)],
) -> anyhow::Result<Value> {
    let db = ScratchDb::create(base_url, "outbox_bench_steady").await?;
    sqlx::query(
        "CREATE TABLE bench_applied (outbox_id bigint PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(&db.pool)
    .await?;
    let dev = DevServerProcess::start(&["--deliver", "true"]).await?;
    let result = measure(&db, &dev, rate, secs, knobs, extra).await;
    dev.stop().await;
    db.drop_now().await?;
    result
}

async fn measure(
    db: &ScratchDb,
    dev: &DevServerProcess,
    rate: u32,
    secs: f64,
    knobs: Knobs,
    extra: &[(&str, String)],
) -> anyhow::Result<Value> {
    let (consumer_url, stop_consumer, requests) = consumer_endpoint(&db.url).await?;
    let accepted0 = dev.accepted().await?;
    let relay = Draining::start(&db.url, &dev.url, consumer_url, knobs, extra).await?;

    let total = (f64::from(rate) * secs).round() as u64;
    let producer = Producer::default().notify(true);
    let mut conn = db.pool.acquire().await?;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate.max(1))));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    for i in 0..total {
        tick.tick().await;
        producer
            .enqueue(
                &mut conn,
                NewEvent::new(&TOPIC, format!("k{}", i % 100), &json!({"i": i}))?,
            )
            .await?;
    }
    let produced_in = started.elapsed().as_secs_f64();
    drop(conn);
    let wait_until = Instant::now() + Duration::from_secs(60);
    loop {
        let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM bench_applied")
            .fetch_one(&db.pool)
            .await?;
        if applied as u64 >= total {
            break;
        }
        if Instant::now() > wait_until {
            bail!("only {applied} of {total} events were applied within 60 s of the last commit");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let summary = relay.stop().await?;
    let _ = stop_consumer.send(true);
    let messages = dev.accepted().await? - accepted0;
    let consumer_requests = requests.load(Ordering::Relaxed);
    let rows: Vec<(f64, f64)> = sqlx::query_as(
        "SELECT (extract(epoch FROM o.dispatched_at - o.created_at) * 1000)::float8, \
                (extract(epoch FROM a.applied_at - o.created_at) * 1000)::float8 \
         FROM outbox o JOIN bench_applied a ON a.outbox_id = o.id",
    )
    .fetch_all(&db.pool)
    .await?;
    let dispatched: Vec<f64> = rows.iter().map(|r| r.0).collect();
    let applied: Vec<f64> = rows.iter().map(|r| r.1).collect();
    let pct = |v: &[f64]| {
        json!({
            "p50": percentile(v, 0.5), "p90": percentile(v, 0.9), "p99": percentile(v, 0.99),
            "max": percentile(v, 1.0),
        })
    };
    println!(
        "steady {rate}/s for {secs} s ({total} events, produced in {produced_in:.1} s): commit → dispatched p50 {:.1} ms, \
         p99 {:.1} ms; commit → applied p50 {:.1} ms, p99 {:.1} ms",
        percentile(&dispatched, 0.5),
        percentile(&dispatched, 0.99),
        percentile(&applied, 0.5),
        percentile(&applied, 0.99)
    );
    Ok(json!({
        "rate_per_sec": rate, "secs": secs, "events": total,
        "achieved_rate_per_sec": total as f64 / produced_in,
        "relay_cycles": summary.cycles,
        "qstash_messages": messages,
        "consumer_requests": consumer_requests,
        "commit_to_dispatched_ms": pct(&dispatched),
        "commit_to_applied_ms": pct(&applied),
        "applied_vs_dispatched_p50": percentile(&applied, 0.5) / percentile(&dispatched, 0.5),
        "samples_ms": {"dispatched": dispatched, "applied": applied},
    }))
}
