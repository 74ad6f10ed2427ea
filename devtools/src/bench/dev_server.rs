//! `outbox-dev bench dev-server`: throughput of the QStash-compatible dev server's `/v2/batch` on loopback.
//!
//! Starts the dev server in process and posts batches of `--batch` messages with 200-byte JSON bodies (each
//! shaped like the relay's contract-2 envelope to `/events/{topic}?contract=2`, with its own deduplication id,
//! the forwarded `x-outbox-id` copy and a retries header, like the relay sends) from `--clients` concurrent
//! keep-alive clients for `--secs`. Runs each mode `--runs` times: accept-only (`Config::deliver = false`) and
//! delivering to a trivial local sink. Prints human-readable figures and one `BENCH_JSON` line per mode. Server,
//! clients and sink share this process, so the per-CPU-second figures are the ones that survive other load.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use outbox_testkit::{median, percentile};
use qstash_dev::{Config, DevServer};

use super::support::{cpu_secs, load_average};

/// Arguments of `outbox-dev bench dev-server`.
#[derive(Args, Debug, Clone)]
pub struct DevServerBenchArgs {
    /// Seconds of publishing per run.
    #[arg(long, default_value_t = 5)]
    pub secs: u64,
    /// Runs per mode (medians are reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Concurrent clients.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// Messages per `/v2/batch` request.
    #[arg(long, default_value_t = 500)]
    pub batch: usize,
}

/// CPU seconds this process has used so far (0 where `/proc` is unreadable).
fn own_cpu_secs() -> f64 {
    cpu_secs(std::process::id()).unwrap_or(0.0)
}

/// A trivial destination: 200 for everything. Returns its base URL.
async fn start_sink() -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the sink")?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: hyper::Request<Incoming>| async move {
                    let _ = req.into_body().collect().await;
                    Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from_static(b"ok"))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok(format!("http://{addr}"))
}

/// A `/v2/batch` body of `n` messages to `dest`, outbox ids from `start_id`.
fn build_batch(dest: &str, start_id: u64, n: usize) -> anyhow::Result<Bytes> {
    // A 200-byte envelope body (the relay's wire contract 2), escaped as a JSON string inside the batch item.
    let mut out = String::with_capacity(n * 420);
    out.push('[');
    for i in 0..n {
        let id = start_id + i as u64;
        if i > 0 {
            out.push(',');
        }
        let head = format!(
            r#"{{"contract":2,"topic":"orders","events":[{{"id":{id},"key":"customer-{k}","created_at":"2026-11-30T12:00:00.000000Z","payload":{{"amount_cents":12345,"note":""#,
            k = id % 1000
        );
        let tail = "\"}}]}";
        let pad = 200usize.saturating_sub(head.len() + tail.len());
        let payload = format!("{head}{}{tail}", "x".repeat(pad));
        let escaped = serde_json::to_string(&payload)?;
        out.push_str(&format!(
            r#"{{"destination":"{dest}/events/orders?contract=2","headers":{{"content-type":"application/json","upstash-deduplication-id":"outbox-{id}","upstash-forward-x-outbox-id":"{id}","upstash-retries":"3","upstash-method":"POST"}},"body":{escaped}}}"#
        ));
    }
    out.push(']');
    Ok(Bytes::from(out))
}

/// One run's figures.
struct RunResult {
    accepted_per_s: f64,
    /// Accepted messages per CPU-second of the whole process (server + clients + sink): a figure that
    /// survives other load on the machine.
    accepted_per_cpu_s: f64,
    latencies_ms: Vec<f64>,
    delivered_per_s: f64,
    /// Deliveries per CPU-second (server + sink) while draining after publishing stopped.
    delivered_per_cpu_s: f64,
    drain_s: Option<f64>,
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// What the clients of one run share.
struct Publishing {
    /// The dev server's `/v2/batch` URL.
    url: String,
    /// Its `Authorization` header value.
    auth: String,
    /// Where the messages go.
    sink: String,
    batch: usize,
    next_id: AtomicU64,
    stop: AtomicBool,
    accepted: AtomicU64,
}

/// One client: posts batches until `stop`, counting the accepted messages; returns each request's latency (ms).
async fn client_loop(client: HttpClient, p: Arc<Publishing>) -> anyhow::Result<Vec<f64>> {
    let mut lat = vec![];
    while !p.stop.load(Ordering::Relaxed) {
        let id = p.next_id.fetch_add(p.batch as u64, Ordering::Relaxed);
        let body = build_batch(&p.sink, id, p.batch)?;
        let req = hyper::Request::post(&p.url)
            .header("authorization", &p.auth)
            .header("content-type", "application/json")
            .body(Full::new(body))?;
        let t = Instant::now();
        let resp = client.request(req).await.context("batch request")?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        lat.push(t.elapsed().as_secs_f64() * 1000.0);
        if !status.is_success() {
            bail!("batch failed: {status} {}", String::from_utf8_lossy(&bytes));
        }
        let ok = bytes.windows(11).filter(|w| w == b"\"messageId\"").count();
        p.accepted.fetch_add(ok as u64, Ordering::Relaxed);
    }
    Ok(lat)
}

async fn run_once(deliver: bool, args: &DevServerBenchArgs) -> anyhow::Result<RunResult> {
    let sink = if deliver {
        start_sink().await?
    } else {
        "http://127.0.0.1:9".to_string()
    };
    let server = DevServer::start(Config {
        port: 0,
        deliver,
        attempt_log_capacity: 10_000,
        ..Config::default()
    })
    .await
    .context("starting the dev server")?;
    let publishing = Arc::new(Publishing {
        url: format!("{}/v2/batch", server.url()),
        auth: format!("Bearer {}", server.token()),
        sink,
        batch: args.batch,
        next_id: AtomicU64::new(1),
        stop: AtomicBool::new(false),
        accepted: AtomicU64::new(0),
    });
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new()).build(conn);
    let cpu0 = own_cpu_secs();
    let start = Instant::now();
    let tasks: Vec<_> = (0..args.clients)
        .map(|_| tokio::spawn(client_loop(client.clone(), publishing.clone())))
        .collect();
    tokio::time::sleep(Duration::from_secs(args.secs)).await;
    publishing.stop.store(true, Ordering::Relaxed);
    let mut latencies = vec![];
    for t in tasks {
        latencies.extend(t.await??);
    }
    let elapsed = start.elapsed().as_secs_f64();
    let cpu = (own_cpu_secs() - cpu0).max(0.01);
    let h = server.handle();
    let delivered_during = h.stats().delivered;
    let mut drain_s = None;
    let mut delivered_per_cpu_s = 0.0;
    if deliver {
        let t = Instant::now();
        let cpu_drain0 = own_cpu_secs();
        if h.wait_idle(Duration::from_secs(120)).await.is_ok() {
            drain_s = Some(t.elapsed().as_secs_f64());
        }
        let drained = h.stats().delivered.saturating_sub(delivered_during);
        delivered_per_cpu_s = drained as f64 / (own_cpu_secs() - cpu_drain0).max(0.01);
    }
    let total_delivered = h.stats().delivered;
    let delivered_per_s = if deliver {
        total_delivered as f64 / (elapsed + drain_s.unwrap_or(0.0))
    } else {
        0.0
    };
    server.shutdown().await;
    let accepted = publishing.accepted.load(Ordering::Relaxed) as f64;
    Ok(RunResult {
        accepted_per_s: accepted / elapsed,
        accepted_per_cpu_s: accepted / cpu,
        latencies_ms: latencies,
        delivered_per_s,
        delivered_per_cpu_s,
        drain_s,
    })
}

/// `outbox-dev bench dev-server`: both modes, `--runs` runs each.
pub async fn run(args: DevServerBenchArgs) -> anyhow::Result<()> {
    println!(
        "qstash-dev /v2/batch benchmark: {} runs x {}s, {} clients, {} items x 200 B",
        args.runs, args.secs, args.clients, args.batch
    );
    for (mode, deliver) in [("accept-only", false), ("deliver-to-sink", true)] {
        let mut rates = vec![];
        let mut per_cpu = vec![];
        let mut delivered_cpu = vec![];
        let mut delivered = vec![];
        let mut lat = vec![];
        for r in 0..args.runs {
            let res = run_once(deliver, &args).await?;
            println!(
                "  {mode} run {}: {:.0} accepted/s ({:.0} per CPU-second), batch p50 {:.1} ms{}",
                r + 1,
                res.accepted_per_s,
                res.accepted_per_cpu_s,
                percentile(&res.latencies_ms, 0.5),
                if deliver {
                    format!(
                        ", delivered {:.0}/s overall, {:.0} per CPU-second while draining (drain took {})",
                        res.delivered_per_s,
                        res.delivered_per_cpu_s,
                        res.drain_s
                            .map(|d| format!("{d:.1}s"))
                            .unwrap_or_else(|| "did not finish".into())
                    )
                } else {
                    String::new()
                }
            );
            rates.push(res.accepted_per_s);
            per_cpu.push(res.accepted_per_cpu_s);
            delivered.push(res.delivered_per_s);
            delivered_cpu.push(res.delivered_per_cpu_s);
            lat.extend(res.latencies_ms);
        }
        let (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
        let med = median(&rates);
        let load = load_average()[0];
        println!(
            "{mode}: median {med:.0} accepted messages/s ({:.0} per CPU-second, load average {load:.1}); batch latency p50 {p50:.1} ms, p99 {p99:.1} ms{}",
            median(&per_cpu),
            if deliver {
                format!("; median delivered {:.0}/s", median(&delivered))
            } else {
                String::new()
            }
        );
        println!(
            "BENCH_JSON {}",
            serde_json::json!({
                "bench": "qstash-dev-batch",
                "mode": mode,
                "accepted_per_s_median": med.round(),
                "accepted_per_s_runs": rates.iter().map(|r| r.round()).collect::<Vec<_>>(),
                "accepted_per_cpu_s_median": median(&per_cpu).round(),
                "load_avg_1m": load,
                "delivered_per_s_median": if deliver { Some(median(&delivered).round()) } else { None },
                "delivered_per_cpu_s_median": if deliver { Some(median(&delivered_cpu).round()) } else { None },
                "batch_latency_p50_ms": (p50 * 10.0).round() / 10.0,
                "batch_latency_p99_ms": (p99 * 10.0).round() / 10.0,
                "clients": args.clients,
                "items_per_batch": args.batch,
                "body_bytes": 200,
                "secs_per_run": args.secs,
            })
        );
    }
    Ok(())
}
