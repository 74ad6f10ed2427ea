//! Consumer throughput: verified-and-applied messages per second through `outbox::consumer::handle_event`
//! (no Lambda, no HTTP server), with a trivial handler that writes one row, on real Postgres.
//!
//! ```text
//! cargo run --release -p outbox --example consumer_bench
//! cargo run --release -p outbox --example consumer_bench -- --secs 5 --runs 5 --concurrency 16 --pool 8
//! cargo run --release -p outbox --example consumer_bench -- --ping-always   # ping on every acquire (the old pool)
//! ```
//!
//! Each message is a distinct event (its own outbox id), signed beforehand like QStash would (signing is not
//! the consumer's cost). Each is a delivery of the current wire contract (`outbox::contract`): a signed envelope
//! body sent to `/events/bench?contract=2`, with the informational `x-outbox-id` copy the relay adds. Per message
//! the handler does what it does in production: cap, verify the HS256 token (HMAC + SHA-256 of the body +
//! claims), route, parse the envelope and compare the header copy, decode the typed payload, then `BEGIN; INSERT
//! dedupe row; INSERT one row; COMMIT`. A scratch database `outbox_bench_<pid>` is created from `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`) and dropped at the end. Prints one line per run, the median
//! msgs/s, p50/p99 handler latency, and one JSON line.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use lambda_http::{Body, Request, RequestExt};
use outbox::config::ConsumerConfig;
use outbox::consumer::{
    ConsumerState, Event, Handler, HandlerError, ReceiverState, Registry, handle_event,
};
use outbox::contract::{CONTRACT_QUERY, OUTBOX_ID, WireEvent, destination, write_envelope};
use outbox::db::{Db, Statements};
use outbox::receiver::{Clock, DEV_SIGNING_KEYS, KeyRing, SigningKeys, sign};
use outbox_testkit::{median, percentile};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection};

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

struct Args {
    secs: f64,
    runs: usize,
    concurrency: usize,
    pool: u32,
    ping: bool,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        secs: 5.0,
        runs: 5,
        concurrency: 16,
        pool: 8,
        ping: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--ping-always" {
            a.ping = true;
            continue;
        }
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {v}: {e}");
        match flag.as_str() {
            "--secs" => a.secs = v.parse().map_err(|e| bad(&e))?,
            "--runs" => a.runs = v.parse().map_err(|e| bad(&e))?,
            "--concurrency" => a.concurrency = v.parse().map_err(|e| bad(&e))?,
            "--pool" => a.pool = v.parse().map_err(|e| bad(&e))?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

/// A pre-signed delivery.
struct Msg {
    id: i64,
    token: String,
    body: String,
}

fn request(m: &Msg) -> Request {
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
        .body(Body::Text(m.body.clone()))
        .expect("request");
    req.with_raw_http_path("/events/bench")
}

/// `n` deliveries with fresh outbox ids, signed like QStash would.
fn presign(next_id: &mut i64, n: usize, sub: &str) -> Arc<Vec<Msg>> {
    let v: Vec<Msg> = (0..n)
        .map(|_| {
            let id = *next_id;
            *next_id += 1;
            let payload = format!(r#"{{"n":{id},"note":"bench"}}"#);
            let body = write_envelope(
                "bench",
                None,
                &[WireEvent {
                    id,
                    key: "bench",
                    seq: None,
                    created_at: chrono::DateTime::from_timestamp(NOW, 0).expect("valid time"),
                    schema_version: None,
                    headers: &[],
                    payload: &payload,
                }],
            );
            Msg {
                id,
                token: sign(DEV_SIGNING_KEYS.0, sub, body.as_bytes(), NOW, 300),
                body,
            }
        })
        .collect();
    Arc::new(v)
}

/// Latencies in µs as milliseconds.
fn ms(us: &[u32]) -> Vec<f64> {
    us.iter().map(|&u| f64::from(u) / 1000.0).collect()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = args()?;
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let admin_opts = PgConnectOptions::from_str(&url)?;
    let db = format!("outbox_bench_{}", std::process::id());
    let mut admin = admin_opts.connect().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&mut admin)
        .await?;
    let result = run(&a, admin_opts.clone().database(&db)).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await?;
    admin.close().await?;
    result
}

async fn run(a: &Args, opts: PgConnectOptions) -> Result<(), Box<dyn std::error::Error>> {
    // Like the Lambda pool (`DbConfig::pool`): a liveness ping only on connections idle for over a second;
    // --ping-always pings on every acquire (one extra round trip per message).
    let options = PgPoolOptions::new().max_connections(a.pool);
    let options = if a.ping {
        options.test_before_acquire(true)
    } else {
        outbox::db::ping_when_idle(options)
    };
    let pool = options.connect_with(opts).await?;
    outbox::MIGRATOR.run(&pool).await?;
    sqlx::query("CREATE TABLE bench_effects (outbox_id bigint NOT NULL, n bigint NOT NULL)")
        .execute(&pool)
        .await?;
    let state = Arc::new(ConsumerState::new(
        ReceiverState::new(
            ConsumerConfig::defaults(),
            Db::new(pool.clone(), Statements::Prepared),
            KeyRing::fixed(SigningKeys::new(
                DEV_SIGNING_KEYS.0,
                Some(DEV_SIGNING_KEYS.1.into()),
            )),
        )
        .with_clock(Clock::Fixed(NOW))
        .with_metrics(false),
        Registry::new().on("bench", WriteOneRow),
    ));
    let sub = destination(&format!("https://{HOST}"), "bench");
    let mut next_id: i64 = 1;
    // Enough pre-signed messages for 10 000 msgs/s per run.
    let per_run = (a.secs * 10_000.0).ceil() as usize;
    println!(
        "consumer bench: {} run(s) of {} s, {} concurrent callers, pool {} connections (ping on every acquire: {}), {} CPU(s)",
        a.runs,
        a.secs,
        a.concurrency,
        a.pool,
        a.ping,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    // Warm-up (connections, plans, caches), not counted.
    let warm = presign(&mut next_id, 2_000, &sub);
    one_run(&state, warm, a.concurrency, Duration::from_secs(1)).await?;

    let mut rates = Vec::new();
    let mut all_lat: Vec<u32> = Vec::new();
    let mut applied_total = 0usize;
    // Alternating with each handler run: the same database work with nothing else (no request, signature,
    // routing or decoding) — the ceiling this machine's Postgres sets under the same conditions (table sizes,
    // checkpoints, autovacuum, whatever else the machine runs).
    let mut sql_rates = Vec::new();
    for r in 0..a.runs {
        let msgs = presign(&mut next_id, per_run, &sub);
        let (n, secs, lat) =
            one_run(&state, msgs, a.concurrency, Duration::from_secs_f64(a.secs)).await?;
        let rate = n as f64 / secs;
        println!(
            "run {}: {n} applied in {secs:.2} s = {rate:.0} msgs/s; latency p50 {:.2} ms, p99 {:.2} ms",
            r + 1,
            percentile(&ms(&lat), 0.50),
            percentile(&ms(&lat), 0.99)
        );
        rates.push(rate);
        all_lat.extend(lat);
        applied_total += n;
        let (sn, ssecs) = sql_only_run(
            &pool,
            a.concurrency,
            Duration::from_secs_f64(a.secs),
            next_id,
        )
        .await?;
        next_id += sn as i64 + 1;
        sql_rates.push(sn as f64 / ssecs);
        println!(
            "      SQL only (BEGIN; INSERT dedupe; INSERT row; COMMIT): {:.0} tx/s",
            sn as f64 / ssecs
        );
    }
    let sql_median = median(&sql_rates);
    rates.sort_by(|x, y| x.total_cmp(y));
    let rates_median = median(&rates);
    let all_ms = ms(&all_lat);
    let (p50, p99) = (percentile(&all_ms, 0.50), percentile(&all_ms, 0.99));
    // Every applied message wrote exactly one row and one dedupe row (the warm-up included).
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM bench_effects")
        .fetch_one(&pool)
        .await?;
    let dedupe: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_messages")
        .fetch_one(&pool)
        .await?;
    assert_eq!(rows, dedupe, "one effect per dedupe row");
    println!(
        "median {rates_median:.0} msgs/s over {} runs (min {:.0}, max {:.0}); SQL-only median {sql_median:.0} tx/s; handler latency p50 {p50:.2} ms, p99 {p99:.2} ms; target >= 3000 msgs/s: {}",
        rates.len(),
        rates[0],
        rates[rates.len() - 1],
        if rates_median >= 3000.0 {
            "met"
        } else {
            "NOT met"
        }
    );
    println!(
        "{}",
        serde_json::json!({
            "bench": "consumer",
            "runs": rates.len(),
            "secs_per_run": a.secs,
            "concurrency": a.concurrency,
            "pool": a.pool,
            "ping_on_every_acquire": a.ping,
            "msgs_per_sec_median": rates_median.round(),
            "msgs_per_sec_min": rates[0].round(),
            "msgs_per_sec_max": rates[rates.len() - 1].round(),
            "latency_ms_p50": (p50 * 1000.0).round() / 1000.0,
            "latency_ms_p99": (p99 * 1000.0).round() / 1000.0,
            "applied": applied_total,
            "sql_only_tx_per_sec_median": sql_median.round(),
            "ratio_to_sql_only": ((rates_median / sql_median) * 100.0).round() / 100.0,
        })
    );
    pool.close().await;
    Ok(())
}

/// The consumer's database work alone, same statements, same pool.
async fn sql_only_run(
    pool: &sqlx::PgPool,
    concurrency: usize,
    dur: Duration,
    first_id: i64,
) -> Result<(usize, f64), Box<dyn std::error::Error>> {
    let cursor = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let deadline = started + dur;
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (pool, cursor) = (pool.clone(), cursor.clone());
        tasks.push(tokio::spawn(async move {
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
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    Ok((total, started.elapsed().as_secs_f64()))
}

/// Runs `concurrency` callers until `dur` has passed or the messages run out. Returns (applied, seconds,
/// per-call latencies in µs).
async fn one_run(
    state: &Arc<ConsumerState>,
    msgs: Arc<Vec<Msg>>,
    concurrency: usize,
    dur: Duration,
) -> Result<(usize, f64, Vec<u32>), Box<dyn std::error::Error>> {
    let cursor = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let deadline = started + dur;
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (state, msgs, cursor) = (state.clone(), msgs.clone(), cursor.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(8192);
            let mut errors = 0usize;
            while Instant::now() < deadline {
                let i = cursor.fetch_add(1, Ordering::Relaxed);
                let Some(m) = msgs.get(i) else { break };
                let req = request(m);
                let t = Instant::now();
                let resp = handle_event(&state, req).await;
                let us = t.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
                if resp.status() == 200 {
                    lat.push(us);
                } else {
                    errors += 1;
                    if errors == 1 {
                        eprintln!(
                            "non-200: {} {:?}",
                            resp.status(),
                            String::from_utf8_lossy(resp.body().as_ref())
                        );
                    }
                }
            }
            (lat, errors)
        }));
    }
    let mut lat = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await?;
        lat.extend(l);
        errors += e;
    }
    let secs = started.elapsed().as_secs_f64();
    if errors > 0 {
        return Err(format!("{errors} request(s) did not answer 200").into());
    }
    Ok((lat.len(), secs, lat))
}
