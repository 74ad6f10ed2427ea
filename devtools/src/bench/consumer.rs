//! Consumer scenario (`outbox-dev bench consumer`, and a section of the report): verified-and-applied deliveries
//! through the consumer's handler (`outbox::consumer::handle_event`, no HTTP server), each pre-signed by the dev
//! server's signer as QStash would sign it, with a handler that writes one row; beside a SQL-only loop running the
//! same transaction (dedupe row + one row) in the same run. Reports throughput and the per-delivery latency
//! distribution.
//!
//! Per delivery the handler does what it does in production: cap, verify the HS256 token (HMAC + SHA-256 of the
//! body + claims), route, parse the envelope and compare the `x-outbox-id` copy, decode the typed payload, then
//! `BEGIN; INSERT dedupe row; INSERT one row; COMMIT`. The pool is the Lambda's (`DbConfig::pool`: a liveness
//! ping only on a connection idle for over a second); `--ping-always` pings on every acquire instead, the pool
//! before decision record 0008, to measure what that round trip costs.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use lambda_http::{Body, Request, RequestExt};
use outbox::ReceiverState;
use outbox::config::ConsumerConfig;
use outbox::consumer::{ConsumerState, Event, Handler, HandlerError, Registry, handle_event};
use outbox::db::{Db, Statements};
use outbox::internals::contract::{
    CONTRACT_QUERY, OUTBOX_ID, WireEvent, destination, write_envelope,
};
use outbox::internals::receiver::{Clock, KeyRing, SigningKeys};
use outbox_testkit::{median, percentile};
use sqlx::PgConnection;
use sqlx::postgres::PgPoolOptions;

use super::support::ScratchDb;
use outbox_cli::util::DbArgs;

const HOST: &str = "bench.lambda-url.eu-west-1.on.aws";
const NOW: i64 = 1_790_000_000;

#[derive(serde::Deserialize)]
struct Tick {
    n: i64,
}

struct WriteOneRow;

impl Handler<Tick> for WriteOneRow {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        event: &Event<Tick>,
    ) -> Result<(), HandlerError> {
        event
            .statements
            .query("INSERT INTO bench_effects (outbox_id, n) VALUES ($1, $2)")
            .bind(event.meta.outbox_id)
            .bind(event.payload.n)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

/// A pre-signed delivery.
struct Msg {
    id: i64,
    token: String,
    body: String,
}

fn request(m: &Msg) -> anyhow::Result<Request> {
    let id = m.id.to_string();
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("https://{HOST}/events/bench?{CONTRACT_QUERY}"))
        .header("host", HOST)
        .header("content-type", "application/json")
        .header("upstash-signature", &m.token)
        .header("upstash-message-id", "msg_bench")
        .header("upstash-retried", "0")
        .header(OUTBOX_ID, &id)
        .body(Body::Text(m.body.clone()))?;
    Ok(req.with_raw_http_path("/events/bench"))
}

/// `n` deliveries with fresh outbox ids, signed like QStash would.
fn presign(next_id: &mut i64, n: usize, sub: &str) -> anyhow::Result<Arc<Vec<Msg>>> {
    let created_at = chrono::DateTime::from_timestamp(NOW, 0)
        .ok_or_else(|| anyhow::anyhow!("timestamp out of range"))?;
    let v: Vec<Msg> = (0..n)
        .map(|_| {
            let id = *next_id;
            *next_id += 1;
            let payload = format!(r#"{{"n":{id},"note":"bench"}}"#);
            let body = write_envelope(
                "bench",
                None,
                None,
                &[WireEvent {
                    id: id.into(),
                    event_id: id.into(),
                    key: "bench",
                    seq: None,
                    created_at,
                    schema_version: None,
                    headers: &[],
                    payload: &payload,
                    resent: false,
                }],
            );
            Msg {
                id,
                // The dev server's own signer, as QStash would sign the delivery.
                token: qstash_dev::sign::sign(
                    qstash_dev::DEV_CURRENT_SIGNING_KEY,
                    sub,
                    body.as_bytes(),
                    NOW,
                    qstash_dev::sign::NbfMode::GoZero,
                ),
                body,
            }
        })
        .collect();
    Ok(Arc::new(v))
}

/// What the consumer scenario measured.
#[derive(Debug, Clone)]
pub struct ConsumerFigures {
    /// Applied deliveries per second, one per round.
    pub rates: Vec<f64>,
    /// SQL-only transactions per second, one per round (alternating with the handler rounds).
    pub sql_only: Vec<f64>,
    /// Every handler call's latency over all rounds, ms.
    pub latencies_ms: Vec<f64>,
}

impl ConsumerFigures {
    pub fn to_json(&self) -> serde_json::Value {
        let (r, s) = (median(&self.rates), median(&self.sql_only));
        serde_json::json!({
            "msgs_per_sec": self.rates, "msgs_per_sec_median": r,
            "sql_only_tx_per_sec": self.sql_only, "sql_only_median": s,
            "ratio_to_sql_only": r / s,
            "samples": self.latencies_ms.len(),
            "latency_ms": {
                "p50": percentile(&self.latencies_ms, 0.5), "p90": percentile(&self.latencies_ms, 0.9),
                "p99": percentile(&self.latencies_ms, 0.99), "max": percentile(&self.latencies_ms, 1.0),
            },
        })
    }
}

/// Arguments of `outbox-dev bench consumer`.
#[derive(Args, Debug, Clone)]
pub struct ConsumerBenchArgs {
    /// Rounds (each a handler run, then a SQL-only run of the same length); medians are reported.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Seconds per run.
    #[arg(long, default_value_t = 5.0)]
    pub secs: f64,
    /// Concurrent callers.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Pool connections.
    #[arg(long, default_value_t = 8)]
    pub pool: u32,
    /// Ping every connection on acquire (the pool before decision record 0008) instead of only one idle for
    /// over a second.
    #[arg(long)]
    pub ping_always: bool,
    #[command(flatten)]
    pub db: DbArgs,
}

/// The consumer scenario's sizes.
#[derive(Debug, Clone, Copy)]
pub struct ConsumerPlan {
    pub rounds: usize,
    pub secs: f64,
    pub concurrency: usize,
    pub pool: u32,
    pub ping_always: bool,
}

impl ConsumerBenchArgs {
    fn plan(&self) -> ConsumerPlan {
        ConsumerPlan {
            rounds: self.rounds,
            secs: self.secs,
            concurrency: self.concurrency,
            pool: self.pool,
            ping_always: self.ping_always,
        }
    }
}

/// `outbox-dev bench consumer`: the scenario on its own, a line per round, then the medians and one
/// `BENCH_JSON` line.
pub async fn run_cli(args: ConsumerBenchArgs) -> anyhow::Result<()> {
    let plan = args.plan();
    println!(
        "consumer bench: {} round(s) of {} s, {} concurrent callers, pool of {} (ping on every acquire: {}), {} CPU(s)",
        plan.rounds,
        plan.secs,
        plan.concurrency,
        plan.pool,
        plan.ping_always,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    let figures = run(&args.db.database_url, plan).await?;
    let json = figures.to_json();
    println!(
        "consumer: median {:.0} applied/s, SQL-only median {:.0} tx/s ({:.0} %); latency p50 {:.2} ms, p99 {:.2} ms",
        json["msgs_per_sec_median"].as_f64().unwrap_or(f64::NAN),
        json["sql_only_median"].as_f64().unwrap_or(f64::NAN),
        100.0 * json["ratio_to_sql_only"].as_f64().unwrap_or(f64::NAN),
        json["latency_ms"]["p50"].as_f64().unwrap_or(f64::NAN),
        json["latency_ms"]["p99"].as_f64().unwrap_or(f64::NAN),
    );
    let mut line = json;
    line["bench"] = "consumer".into();
    line["concurrency"] = plan.concurrency.into();
    line["pool"] = plan.pool.into();
    line["ping_on_every_acquire"] = plan.ping_always.into();
    println!("BENCH_JSON {line}");
    Ok(())
}

/// Runs the scenario in a scratch database on `base_url`'s server: `plan.rounds` rounds of `plan.secs` each.
pub async fn run(base_url: &str, plan: ConsumerPlan) -> anyhow::Result<ConsumerFigures> {
    let db = ScratchDb::create(base_url, "outbox_bench_consumer").await?;
    let result = measure(&db, plan).await;
    db.drop_now().await?;
    result
}

async fn measure(db: &ScratchDb, plan: ConsumerPlan) -> anyhow::Result<ConsumerFigures> {
    let ConsumerPlan {
        rounds,
        secs,
        concurrency,
        ..
    } = plan;
    let mut cfg = outbox::db::DbConfig::defaults("bench-consumer");
    cfg.max_connections = plan.pool;
    let url = secrecy::SecretString::from(db.url.clone());
    let pool = if plan.ping_always {
        PgPoolOptions::new()
            .max_connections(plan.pool)
            .test_before_acquire(true)
            .connect_lazy_with(cfg.connect_options(&url)?)
    } else {
        cfg.pool(&url)?
    };
    sqlx::query("CREATE TABLE bench_effects (outbox_id bigint NOT NULL, n bigint NOT NULL)")
        .execute(&pool)
        .await?;
    let state = Arc::new(ConsumerState::new(
        ReceiverState::new(
            ConsumerConfig::defaults(),
            Db::new(pool.clone(), Statements::Prepared),
            KeyRing::fixed(SigningKeys::new(
                qstash_dev::DEV_CURRENT_SIGNING_KEY,
                Some(qstash_dev::DEV_NEXT_SIGNING_KEY.to_owned()),
            )),
        )
        .with_clock(Clock::Fixed(NOW))
        .with_metrics(false),
        Registry::new().on("bench", WriteOneRow),
    ));
    let sub = destination(&format!("https://{HOST}"), "bench");
    let mut next_id: i64 = 1;
    // Warm-up (connections, plans, caches), not counted.
    let warm = presign(&mut next_id, 1_000, &sub)?;
    one_round(&state, warm, concurrency, Duration::from_millis(500)).await?;
    let per_round = (secs * 10_000.0).ceil() as usize;
    let mut figures = ConsumerFigures {
        rates: Vec::new(),
        sql_only: Vec::new(),
        latencies_ms: Vec::new(),
    };
    for r in 1..=rounds {
        let msgs = presign(&mut next_id, per_round, &sub)?;
        let (lat, elapsed) =
            one_round(&state, msgs, concurrency, Duration::from_secs_f64(secs)).await?;
        let rate = lat.len() as f64 / elapsed;
        let (sn, ssecs) =
            sql_only_round(&pool, concurrency, Duration::from_secs_f64(secs), next_id).await?;
        next_id += sn as i64 + 1;
        println!(
            "consumer round {r}: {rate:.0} applied/s, latency p50 {:.2} ms, p99 {:.2} ms | SQL-only {:.0} tx/s",
            percentile(&lat, 0.5),
            percentile(&lat, 0.99),
            sn as f64 / ssecs
        );
        figures.rates.push(rate);
        figures.sql_only.push(sn as f64 / ssecs);
        figures.latencies_ms.extend(lat);
    }
    // Every applied delivery wrote exactly one row with its dedupe row (the warm-up and the SQL-only rounds
    // included): a handler that applied twice, or not at all, is not a throughput.
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM bench_effects")
        .fetch_one(&pool)
        .await?;
    let dedupe: i64 = sqlx::query_scalar(outbox::schema::q(
        "SELECT count(*) FROM {schema}.processed_messages",
    ))
    .fetch_one(&pool)
    .await
    .context("counting the dedupe rows")?;
    pool.close().await;
    if rows != dedupe {
        bail!("{rows} rows written for {dedupe} dedupe rows: one effect per dedupe row expected");
    }
    Ok(figures)
}

/// The consumer's database work alone: the same statements on the same pool.
async fn sql_only_round(
    pool: &sqlx::PgPool,
    concurrency: usize,
    dur: Duration,
    first_id: i64,
) -> anyhow::Result<(usize, f64)> {
    let cursor = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let deadline = started + dur;
    let tasks = (0..concurrency).map(|_| {
        let (pool, cursor) = (pool.clone(), cursor.clone());
        tokio::spawn(async move {
            let mut n = 0usize;
            while Instant::now() < deadline {
                let id = first_id + cursor.fetch_add(1, Ordering::Relaxed) as i64;
                let mut tx = pool.begin().await?;
                sqlx::query(outbox::schema::q(outbox::once::DEDUPE_SQL))
                    .bind("sql-only")
                    .bind(id.to_string())
                    .execute(&mut *tx)
                    .await?;
                sqlx::query("INSERT INTO bench_effects (outbox_id, n) VALUES ($1, $2)")
                    .bind(id)
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                n += 1;
            }
            Ok::<_, sqlx::Error>(n)
        })
    });
    let mut total = 0;
    for r in futures::future::join_all(tasks).await {
        total += r??;
    }
    Ok((total, started.elapsed().as_secs_f64()))
}

/// `concurrency` callers until `dur` has passed or the messages run out: every call's latency (ms) and the
/// seconds taken. Fails if any call did not answer 200.
async fn one_round(
    state: &Arc<ConsumerState>,
    msgs: Arc<Vec<Msg>>,
    concurrency: usize,
    dur: Duration,
) -> anyhow::Result<(Vec<f64>, f64)> {
    let cursor = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let deadline = started + dur;
    let tasks = (0..concurrency).map(|_| {
        let (state, msgs, cursor) = (state.clone(), msgs.clone(), cursor.clone());
        tokio::spawn(async move {
            let mut lat = Vec::with_capacity(4096);
            let mut failed = None;
            while Instant::now() < deadline {
                let i = cursor.fetch_add(1, Ordering::Relaxed);
                let Some(m) = msgs.get(i) else { break };
                let req = request(m)?;
                let t = Instant::now();
                let resp = handle_event(&state, req).await;
                let ms = t.elapsed().as_secs_f64() * 1000.0;
                if resp.status() == 200 {
                    lat.push(ms);
                } else if failed.is_none() {
                    failed = Some(format!(
                        "{} {}",
                        resp.status(),
                        String::from_utf8_lossy(resp.body().as_ref())
                    ));
                }
            }
            Ok::<_, anyhow::Error>((lat, failed))
        })
    });
    let mut lat = Vec::new();
    for r in futures::future::join_all(tasks).await {
        let (l, failed) = r??;
        if let Some(f) = failed {
            bail!("a delivery did not answer 200: {f}");
        }
        lat.extend(l);
    }
    Ok((lat, started.elapsed().as_secs_f64()))
}
