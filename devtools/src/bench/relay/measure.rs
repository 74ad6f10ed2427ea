//! The measuring steps every relay scenario and the report share: seeding scratch databases, the SQL-only
//! baselines, the relay as a child process, claim latency, and the ordered rig (dev server + real consumer).

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox::db::{DbConfig, Statements};
use outbox::internals::claim::ClaimStatements;
use outbox::internals::settle::{SettleItem, Settlement, settle};
use outbox_testkit::{median, percentile};
use serde_json::Value;
use sqlx::PgPool;
use tokio::process::Command;

use crate::bench::endpoints::{Invocations, ordered_endpoints};
use crate::bench::support::{
    DevServerProcess, Knobs, ScratchDb, cpu_secs, reaped_children_cpu_secs, sibling,
};

pub(crate) const SEED_SQL: &str = "INSERT INTO outbox (topic, partition_key, payload) \
    SELECT 'bench', 'k' || (g % 1000), jsonb_build_object('i', g, 'pad', repeat('x', 176)) \
    FROM generate_series(1, $1::bigint) g";

pub(crate) async fn seed_unordered(pool: &PgPool, n: u64) -> anyhow::Result<()> {
    sqlx::query("TRUNCATE outbox, dead_letters")
        .execute(pool)
        .await?;
    sqlx::query(SEED_SQL).bind(n as i64).execute(pool).await?;
    sqlx::query("VACUUM ANALYZE outbox").execute(pool).await?;
    Ok(())
}

/// Waits for the SQL-only workers, then returns the events they finished and the time since `started` (taken
/// before the pool is closed).
async fn join_workers(
    workers: impl IntoIterator<Item = impl std::future::Future<Output = Result<u64, sqlx::Error>>>,
    pool: &PgPool,
    started: Instant,
) -> anyhow::Result<(u64, Duration)> {
    let results = futures::future::join_all(workers).await;
    let elapsed = started.elapsed();
    let mut total = 0;
    for r in results {
        total += r?;
    }
    pool.close().await;
    Ok((total, elapsed))
}

/// CPU seconds spread over `events`, in microseconds per event.
fn us_per_event(cpu_secs: f64, events: u64) -> f64 {
    cpu_secs * 1e6 / events as f64
}

/// The SQL-only cycle: the relay's own claim and settle statements, no network.
pub(crate) async fn sql_only(
    url: &str,
    batch: u32,
    concurrency: u32,
    async_commit: bool,
) -> anyhow::Result<(u64, Duration)> {
    let mut cfg = DbConfig::defaults("bench-sql-only");
    cfg.async_commit = async_commit;
    cfg.max_connections = concurrency;
    let pool = cfg
        .pool(&secrecy::SecretString::from(url.to_owned()))
        .context("pool")?;
    let claims = ClaimStatements::new(batch, Statements::Prepared);
    let started = Instant::now();
    let workers = (0..concurrency).map(|_| {
        let pool = pool.clone();
        let claims = claims.clone();
        async move {
            let mut done = 0u64;
            let mut conn = pool.acquire().await?;
            loop {
                let evs = claims.claim_unordered(&mut conn, 30.0).await?;
                if evs.is_empty() {
                    break;
                }
                let items: Vec<SettleItem> = evs.iter().map(dispatched).collect();
                done += settle(
                    &mut conn,
                    &items,
                    Duration::from_secs(60),
                    Statements::Prepared,
                )
                .await?
                .dispatched;
            }
            Ok::<u64, sqlx::Error>(done)
        }
    });
    join_workers(workers, &pool, started).await
}

/// Runs `outbox relay --until-empty` (the operator CLI, a sibling binary) as a child process with the Lambda's
/// configuration variables. Returns its summary, with the CPU seconds the child used added as `cpu_secs` (no
/// other child of this process ends meanwhile).
pub(crate) async fn relay_child(
    db_url: &str,
    qstash_url: &str,
    knobs: Knobs,
    extra_env: &[(&str, String)],
) -> anyhow::Result<Value> {
    let mut cmd = Command::new(sibling("outbox")?);
    cmd.args(["relay", "--until-empty", "--timeout-secs", "600"])
        .env("DATABASE_URL", db_url)
        .env("QSTASH_URL", qstash_url)
        .env("QSTASH_TOKEN", qstash_dev::DEV_TOKEN)
        // The dev server's public token: the relay refuses it without this opt-in.
        .env("OUTBOX_ALLOW_DEV_KEYS", "true")
        .env("CONSUMER_URL", "http://127.0.0.1:9")
        .env("CALLBACK_URL", "http://127.0.0.1:9")
        .env("RELAY_BATCH_SIZE", knobs.batch.to_string())
        .env("RELAY_CONCURRENCY", knobs.concurrency.to_string())
        .env("QSTASH_BATCH_SIZE", knobs.qstash_batch.to_string())
        .env("RELAY_POLL_INTERVAL_MS", "20")
        .env("RUST_LOG", "warn")
        .env_remove("OUTBOX_SECRET_ID")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let cpu0 = reaped_children_cpu_secs();
    let out = cmd.output().await.context("running the relay child")?;
    let cpu = reaped_children_cpu_secs()
        .zip(cpu0)
        .map(|(after, before)| after - before);
    if !out.status.success() {
        bail!("relay child failed: {}", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .context("relay child printed no summary")?;
    let mut summary: Value = serde_json::from_str(line)?;
    summary
        .as_object_mut()
        .context("the relay child's summary is not a JSON object")?
        .insert("cpu_secs".into(), cpu.into());
    Ok(summary)
}

pub(crate) async fn claim_latency_ms(
    pool: &PgPool,
    batch: u32,
    samples: usize,
) -> anyhow::Result<(f64, f64)> {
    let claims = ClaimStatements::new(batch, Statements::Prepared);
    let mut conn = pool.acquire().await?;
    let mut times = Vec::with_capacity(samples);
    for i in 0..samples + 5 {
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        let t = Instant::now();
        let got = claims.claim_unordered(&mut tx, 30.0).await?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        tx.rollback().await?;
        if got.len() != batch as usize {
            bail!("claim returned {} rows, expected {batch}", got.len());
        }
        if i >= 5 {
            times.push(ms); // the first executions use custom plans; measure the steady (generic) state
        }
    }
    Ok((median(&times), percentile(&times, 0.99)))
}

pub(crate) async fn seed_ordered(pool: &PgPool, keys: u64, per_key: u64) -> anyhow::Result<()> {
    sqlx::query("TRUNCATE outbox, outbox_keys, outbox_sequences, dead_letters, processed_messages, consumer_sequences")
        .execute(pool)
        .await?;
    sqlx::query(
        "INSERT INTO outbox (topic, partition_key, seq, payload) \
         SELECT 'bench_ordered', 'key-' || k, s, jsonb_build_object('k', k, 's', s, 'pad', repeat('x', 170)) \
         FROM generate_series(1, $2::bigint) s, generate_series(1, $1::bigint) k ORDER BY s, k",
    )
    .bind(keys as i64)
    .bind(per_key as i64)
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO outbox_sequences (topic, partition_key, last_seq) \
         SELECT 'bench_ordered', 'key-' || k, $2::bigint FROM generate_series(1, $1::bigint) k",
    )
    .bind(keys as i64)
    .bind(per_key as i64)
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO outbox_keys (topic, partition_key, done_seq) \
         SELECT 'bench_ordered', 'key-' || k, 0 FROM generate_series(1, $1::bigint) k",
    )
    .bind(keys as i64)
    .execute(pool)
    .await?;
    sqlx::query("VACUUM ANALYZE outbox").execute(pool).await?;
    sqlx::query("VACUUM ANALYZE outbox_keys")
        .execute(pool)
        .await?;
    Ok(())
}

/// A claimed event settled as dispatched, as the SQL-only cycles settle every event they claim.
fn dispatched(e: &outbox::internals::claim::ClaimedEvent) -> SettleItem {
    SettleItem {
        id: e.id,
        lease_token: e.lease_token,
        settlement: Settlement::Dispatched {
            message_id: "sql-only".into(),
        },
    }
}

/// The ordered SQL-only cycle, the relay's protocol without HTTP: claim runs of up to `delivery_batch` events per
/// key with the relay's own claim statement (key heads alone at 1, [`outbox::internals::ordering::CLAIM_RUNS_SQL`] above),
/// settle them dispatched with the relay's settle statement in pieces of whole runs of at most 500 rows as the
/// relay does, and record each run's delivery evidence with the statement the consumer runs
/// (`record_delivery_batch`, one per run) once its piece is settled; a claim's pieces run side by side (on up
/// to 8 more connections than workers), like the relay's requests and the consumer's deliveries. A key is claimed
/// again only after its run's evidence, as in the pipeline.
pub(crate) async fn sql_only_ordered(
    url: &str,
    batch: u32,
    concurrency: u32,
    delivery_batch: u32,
) -> anyhow::Result<(u64, Duration)> {
    let mut cfg = DbConfig::defaults("bench-sql-only");
    cfg.async_commit = true;
    cfg.max_connections = concurrency + 8;
    let pool = cfg
        .pool(&secrecy::SecretString::from(url.to_owned()))
        .context("pool")?;
    let batching = outbox::config::DeliveryBatching {
        default_n: delivery_batch.max(1),
        ..Default::default()
    };
    let claims =
        ClaimStatements::new(batch, Statements::Prepared).with_delivery_batching(&batching);
    let started = Instant::now();
    let workers = (0..concurrency).map(|_| {
        let pool = pool.clone();
        let claims = claims.clone();
        async move {
            let mut done = 0u64;
            let mut idle_rounds = 0;
            loop {
                let evs = {
                    let mut conn = pool.acquire().await?;
                    claims.claim_ordered(&mut conn, 30.0).await?
                };
                if evs.is_empty() {
                    let busy: bool = sqlx::query_scalar(
                        "SELECT EXISTS (SELECT 1 FROM outbox WHERE delivered_at IS NULL)",
                    )
                    .fetch_one(&pool)
                    .await?;
                    idle_rounds += 1;
                    if !busy || idle_rounds > 2000 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                idle_rounds = 0;
                // One run per key (the claim returns a key's rows together, in sequence order).
                let mut runs: Vec<Vec<&outbox::internals::claim::ClaimedEvent>> = Vec::new();
                for (i, e) in evs.iter().enumerate() {
                    let same_key = i > 0
                        && evs[i - 1].topic == e.topic
                        && evs[i - 1].partition_key == e.partition_key;
                    match runs.last_mut() {
                        Some(run) if same_key => run.push(e),
                        _ => runs.push(vec![e]),
                    }
                }
                // Like the relay (decision record 0018): whole runs settled in pieces of at most
                // SETTLE_PIECE_ROWS rows (the relay's own cut), each piece's evidence recorded once it is settled,
                // pieces side by side.
                let sizes: Vec<usize> = runs.iter().map(Vec::len).collect();
                let mut runs = runs.into_iter();
                let pieces: Vec<Vec<Vec<&outbox::internals::claim::ClaimedEvent>>> =
                    outbox::internals::cycle::pieces(
                        &sizes,
                        outbox::internals::cycle::SETTLE_PIECE_ROWS,
                    )
                    .into_iter()
                    .map(|n| runs.by_ref().take(n).collect())
                    .collect();
                let work = pieces.into_iter().map(|piece| {
                    let pool = pool.clone();
                    async move {
                        let mut conn = pool.acquire().await?;
                        let items: Vec<SettleItem> =
                            piece.iter().flatten().map(|e| dispatched(e)).collect();
                        settle(
                            &mut conn,
                            &items,
                            Duration::from_secs(60),
                            Statements::Prepared,
                        )
                        .await?;
                        for run in piece {
                            let ids: Vec<outbox::OutboxId> = run.iter().map(|e| e.id).collect();
                            outbox::internals::ordering::record_delivery_batch(
                                &mut conn,
                                &ids,
                                Statements::Prepared,
                            )
                            .await?;
                        }
                        Ok::<(), sqlx::Error>(())
                    }
                });
                for r in futures::future::join_all(work).await {
                    r?;
                }
                done += evs.len() as u64;
            }
            Ok::<u64, sqlx::Error>(done)
        }
    });
    join_workers(workers, &pool, started).await
}

/// One relay drain through the dev server, as the relay process reported it.
#[derive(Debug, Clone, Copy)]
pub struct RelayRun {
    pub events_per_sec: f64,
    pub peak_rss_mb: f64,
    /// CPU per event of the relay process, µs.
    pub relay_cpu_us: f64,
    /// CPU per event of the dev server process, µs.
    pub dev_cpu_us: f64,
    pub publish_p50_ms: f64,
}

/// Seeds `events` unordered events and drains them with the SQL-only cycle: events/s.
pub(crate) async fn unordered_sql_only_rate(
    db: &ScratchDb,
    events: u64,
    batch: u32,
    concurrency: u32,
    async_commit: bool,
) -> anyhow::Result<f64> {
    seed_unordered(&db.pool, events).await?;
    let (n, t) = sql_only(&db.url, batch, concurrency, async_commit).await?;
    if n != events {
        bail!("SQL-only cycle finished {n} of {events} events");
    }
    Ok(n as f64 / t.as_secs_f64())
}

/// Seeds `events` unordered events and drains them with the relay process (`outbox relay --until-empty`)
/// publishing to `dev`; fails unless every event was dispatched.
pub(crate) async fn unordered_relay_run(
    db: &ScratchDb,
    dev: &DevServerProcess,
    events: u64,
    knobs: Knobs,
) -> anyhow::Result<RelayRun> {
    seed_unordered(&db.pool, events).await?;
    let dev_cpu0 = dev.cpu_secs().unwrap_or(0.0);
    let out = relay_child(&db.url, &dev.url, knobs, &[]).await?;
    let dispatched = out["summary"]["dispatched"].as_u64().unwrap_or(0);
    if dispatched != events {
        bail!("relay dispatched {dispatched} of {events} events: {out}");
    }
    let secs = out["elapsed_secs"].as_f64().unwrap_or(f64::NAN);
    Ok(RelayRun {
        events_per_sec: events as f64 / secs,
        peak_rss_mb: out["peak_rss_kib"].as_f64().unwrap_or(0.0) / 1024.0,
        relay_cpu_us: us_per_event(out["cpu_secs"].as_f64().unwrap_or(0.0), events),
        dev_cpu_us: us_per_event(dev.cpu_secs().unwrap_or(0.0) - dev_cpu0, events),
        publish_p50_ms: out["summary"]["publish_p50_ms"].as_f64().unwrap_or(0.0),
    })
}

/// Seeds `keys` × `per_key` ordered events and runs the SQL-only ordered protocol over them with runs of up to
/// `delivery_batch` events per key (the relay's `RELAY_DELIVERY_BATCH`): events/s.
pub(crate) async fn ordered_sql_only_rate(
    db: &ScratchDb,
    keys: u64,
    per_key: u64,
    knobs: Knobs,
    delivery_batch: u32,
) -> anyhow::Result<f64> {
    let n = keys * per_key;
    seed_ordered(&db.pool, keys, per_key).await?;
    let (m, t) = sql_only_ordered(&db.url, knobs.batch, knobs.concurrency, delivery_batch).await?;
    if m != n {
        bail!("SQL-only ordered cycle finished {m} of {n} events");
    }
    Ok(n as f64 / t.as_secs_f64())
}

/// One ordered drain end to end: what it reached and where the time per key went.
#[derive(Debug, Clone, Copy)]
pub struct OrderedRun {
    pub events_per_sec: f64,
    /// Wall time of the drain (the relay process's own measure), seconds.
    pub secs: f64,
    /// Per key, median: accepted by the dev server → delivery evidence recorded, ms.
    pub to_evidence_ms: f64,
    /// Per key, median: evidence recorded → next event accepted, ms.
    pub to_next_ms: f64,
    pub relay_cpu_us: f64,
    pub dev_cpu_us: f64,
    /// CPU per event of this process (the receivers run here), µs.
    pub receivers_cpu_us: f64,
}

/// The ordered endpoints and the dev server delivering to them.
pub(crate) struct OrderedRig {
    pub consumer_url: String,
    pub callback_url: String,
    pub stop: tokio::sync::watch::Sender<bool>,
    /// The consumer's invocations (HTTP requests) so far.
    pub consumer: std::sync::Arc<Invocations>,
}

impl OrderedRig {
    /// HTTP requests the consumer has received so far (deliveries, retries included).
    pub fn consumer_requests(&self) -> u64 {
        self.consumer.count()
    }
}

/// Seeds `keys` × `per_key` ordered events and drains them with the relay process through the delivering dev
/// server into the real consumer; `mode` is `RELAY_ORDERED_EVIDENCE` (`callback` or `consumer`). Fails unless
/// every event has delivery evidence. `extra` adds relay variables (e.g. `RELAY_DELIVERY_BATCH`).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn ordered_relay_run(
    db: &ScratchDb,
    dev: &DevServerProcess,
    rig: &OrderedRig,
    keys: u64,
    per_key: u64,
    knobs: Knobs,
    mode: &str,
    extra: &[(&str, String)],
) -> anyhow::Result<OrderedRun> {
    let n = keys * per_key;
    seed_ordered(&db.pool, keys, per_key).await?;
    let dev_cpu0 = dev.cpu_secs().unwrap_or(0.0);
    let own_cpu0 = cpu_secs(std::process::id()).unwrap_or(0.0);
    let mut env = vec![
        ("CONSUMER_URL", rig.consumer_url.clone()),
        ("CALLBACK_URL", rig.callback_url.clone()),
        ("QSTASH_RETRIES", "3".into()),
        ("RELAY_ORDERED_EVIDENCE", mode.into()),
    ];
    env.extend(extra.iter().cloned());
    let out = relay_child(&db.url, &dev.url, knobs, &env).await?;
    let delivered: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE delivered_at IS NOT NULL")
            .fetch_one(&db.pool)
            .await?;
    if delivered as u64 != n {
        bail!(
            "{mode} evidence: only {delivered} of {n} ordered events have delivery evidence: {out}"
        );
    }
    let secs = out["elapsed_secs"].as_f64().unwrap_or(f64::NAN);
    let (to_evidence, to_next): (Option<f64>, Option<f64>) = sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM o.delivered_at - o.dispatched_at) * 1000)::float8, \
                percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM n.dispatched_at - o.delivered_at) * 1000)::float8 \
         FROM outbox o JOIN outbox n ON n.topic = o.topic AND n.partition_key = o.partition_key AND n.seq = o.seq + 1",
    )
    .fetch_one(&db.pool)
    .await?;
    Ok(OrderedRun {
        events_per_sec: n as f64 / secs,
        secs,
        to_evidence_ms: to_evidence.unwrap_or(f64::NAN),
        to_next_ms: to_next.unwrap_or(f64::NAN),
        relay_cpu_us: us_per_event(out["cpu_secs"].as_f64().unwrap_or(0.0), n),
        dev_cpu_us: us_per_event(dev.cpu_secs().unwrap_or(0.0) - dev_cpu0, n),
        receivers_cpu_us: us_per_event(cpu_secs(std::process::id()).unwrap_or(0.0) - own_cpu0, n),
    })
}

/// Starts the delivering dev server and the ordered endpoints on `db`.
pub(crate) async fn ordered_rig(db: &ScratchDb) -> anyhow::Result<(DevServerProcess, OrderedRig)> {
    let dev = DevServerProcess::start(&["--deliver", "true"]).await?;
    let e = ordered_endpoints(&db.url).await?;
    Ok((
        dev,
        OrderedRig {
            consumer_url: e.consumer_url,
            callback_url: e.callback_url,
            stop: e.stop,
            consumer: e.consumer,
        },
    ))
}
