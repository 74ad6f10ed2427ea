//! Throughput of `/v2/batch` on loopback: `cargo run --release -p qstash-dev --example batch_bench`.
//!
//! Starts the dev server in-process and posts batches of 500 messages with 200-byte JSON bodies (each shaped
//! like the relay's contract-2 envelope to `/events/{topic}?contract=2`, with its own deduplication id, the
//! forwarded `x-outbox-id` copy and a retries header, like the relay sends) from a few concurrent clients for a
//! fixed time. Runs twice: accept-only (`Config::deliver = false`) and delivering
//! to a trivial local sink. Prints human-readable figures and one JSON line per mode.
//!
//! Options (env): BENCH_SECS (default 5), BENCH_RUNS (3), BENCH_CLIENTS (4), BENCH_BATCH (500).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use outbox_testkit::{median, percentile};
use qstash_dev::{Config, DevServer};

/// CPU seconds (user + system) used by this process so far, from /proc (Linux); 0 elsewhere.
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15 (1-based).
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A trivial destination: 200 for everything.
async fn start_sink() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind sink");
    let addr = listener.local_addr().expect("sink addr");
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
    format!("http://{addr}")
}

fn build_batch(dest: &str, start_id: u64, n: usize) -> Bytes {
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
        debug_assert_eq!(payload.len(), 200);
        let escaped = serde_json::to_string(&payload).expect("string");
        out.push_str(&format!(
            r#"{{"destination":"{dest}/events/orders?contract=2","headers":{{"content-type":"application/json","upstash-deduplication-id":"outbox-{id}","upstash-forward-x-outbox-id":"{id}","upstash-retries":"3","upstash-method":"POST"}},"body":{escaped}}}"#
        ));
    }
    out.push(']');
    Bytes::from(out)
}

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

async fn run_once(deliver: bool, secs: u64, clients: usize, batch: usize) -> RunResult {
    let sink = if deliver {
        start_sink().await
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
    .expect("server");
    let url = format!("{}/v2/batch", server.url());
    let auth = format!("Bearer {}", server.token());
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(conn);
    let next_id = Arc::new(AtomicU64::new(1));
    let stop = Arc::new(AtomicBool::new(false));
    let accepted = Arc::new(AtomicU64::new(0));
    let cpu0 = cpu_seconds();
    let start = Instant::now();
    let mut tasks = vec![];
    for _ in 0..clients {
        let (client, url, auth, sink) = (client.clone(), url.clone(), auth.clone(), sink.clone());
        let (next_id, stop, accepted) = (next_id.clone(), stop.clone(), accepted.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = vec![];
            while !stop.load(Ordering::Relaxed) {
                let id = next_id.fetch_add(batch as u64, Ordering::Relaxed);
                let body = build_batch(&sink, id, batch);
                let req = hyper::Request::post(&url)
                    .header("authorization", &auth)
                    .header("content-type", "application/json")
                    .body(Full::new(body))
                    .expect("request");
                let t = Instant::now();
                let resp = client.request(req).await.expect("batch request");
                let status = resp.status();
                let bytes = resp.into_body().collect().await.expect("body").to_bytes();
                lat.push(t.elapsed().as_secs_f64() * 1000.0);
                assert!(
                    status.is_success(),
                    "batch failed: {status} {}",
                    String::from_utf8_lossy(&bytes)
                );
                let ok = bytes.windows(11).filter(|w| w == b"\"messageId\"").count();
                accepted.fetch_add(ok as u64, Ordering::Relaxed);
            }
            lat
        }));
    }
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = vec![];
    for t in tasks {
        latencies.extend(t.await.expect("client task"));
    }
    let elapsed = start.elapsed().as_secs_f64();
    let cpu = (cpu_seconds() - cpu0).max(0.01);
    let h = server.handle();
    let delivered_during = h.stats().delivered;
    let mut drain_s = None;
    let mut delivered_per_cpu_s = 0.0;
    if deliver {
        let t = Instant::now();
        let cpu_drain0 = cpu_seconds();
        if h.wait_idle(Duration::from_secs(120)).await.is_ok() {
            drain_s = Some(t.elapsed().as_secs_f64());
        }
        let drained = h.stats().delivered.saturating_sub(delivered_during);
        delivered_per_cpu_s = drained as f64 / (cpu_seconds() - cpu_drain0).max(0.01);
    }
    let total_delivered = h.stats().delivered;
    let delivered_per_s = if deliver {
        total_delivered as f64 / (elapsed + drain_s.unwrap_or(0.0))
    } else {
        0.0
    };
    server.shutdown().await;
    RunResult {
        accepted_per_s: accepted.load(Ordering::Relaxed) as f64 / elapsed,
        accepted_per_cpu_s: accepted.load(Ordering::Relaxed) as f64 / cpu,
        latencies_ms: latencies,
        delivered_per_s,
        delivered_per_cpu_s,
        drain_s,
    }
}

#[tokio::main]
async fn main() {
    let secs = env_num("BENCH_SECS", 5);
    let runs = env_num("BENCH_RUNS", 3) as usize;
    let clients = env_num("BENCH_CLIENTS", 4) as usize;
    let batch = env_num("BENCH_BATCH", 500) as usize;
    println!(
        "qstash-dev /v2/batch benchmark: {runs} runs x {secs}s, {clients} clients, {batch} items x 200 B"
    );
    for (mode, deliver) in [("accept-only", false), ("deliver-to-sink", true)] {
        let mut rates = vec![];
        let mut per_cpu = vec![];
        let mut delivered_cpu = vec![];
        let mut delivered = vec![];
        let mut lat = vec![];
        for r in 0..runs {
            let res = run_once(deliver, secs, clients, batch).await;
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
        println!(
            "{mode}: median {med:.0} accepted messages/s ({:.0} per CPU-second, load average {:.1}); batch latency p50 {p50:.1} ms, p99 {p99:.1} ms{}",
            median(&per_cpu),
            load_avg(),
            if deliver {
                format!("; median delivered {:.0}/s", median(&delivered))
            } else {
                String::new()
            }
        );
        println!(
            "{}",
            serde_json::json!({
                "bench": "qstash-dev-batch",
                "mode": mode,
                "accepted_per_s_median": med.round(),
                "accepted_per_s_runs": rates.iter().map(|r| r.round()).collect::<Vec<_>>(),
                "accepted_per_cpu_s_median": median(&per_cpu).round(),
                "load_avg_1m": load_avg(),
                "delivered_per_s_median": if deliver { Some(median(&delivered).round()) } else { None },
                "delivered_per_cpu_s_median": if deliver { Some(median(&delivered_cpu).round()) } else { None },
                "batch_latency_p50_ms": (p50 * 10.0).round() / 10.0,
                "batch_latency_p99_ms": (p99 * 10.0).round() / 10.0,
                "clients": clients,
                "items_per_batch": batch,
                "body_bytes": 200,
                "secs_per_run": secs,
            })
        );
    }
}

fn load_avg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}
