//! `qstash-dev`: run the QStash-compatible development server.

use std::net::IpAddr;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use qstash_dev::{Config, DevServer, NbfMode, NonRetryableMode, TimestampFormat, WaitlistOrder};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Order {
    Fifo,
    Shuffled,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Nbf {
    /// -62135596800, as production QStash sends since September 2024.
    GoZero,
    /// nbf = iat (older QStash).
    Now,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum NonRetryable {
    /// 489 + `Upstash-NonRetryable-Error: true` (documented).
    Require489,
    /// The header with any non-2xx status.
    HeaderAlone,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Timestamps {
    Number,
    String,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    qstash_dev::parse_compound(s)
}

/// A QStash-compatible development server: publish, deliver, sign, retry, flow control, queues, callbacks, DLQ.
#[derive(Parser, Debug)]
#[command(name = "qstash-dev", version, about)]
struct Args {
    /// Port to listen on (0 = any free port).
    #[arg(long, env = "QSTASH_DEV_PORT", default_value_t = 8080)]
    port: u16,
    /// Address to bind. Anything but loopback (127.0.0.0/8, ::1) needs --token.
    #[arg(long, env = "QSTASH_DEV_BIND", default_value = "127.0.0.1")]
    bind: IpAddr,
    /// Accepted bearer token, for the QStash API and /__dev/ (default: the documented dev token, loopback only).
    #[arg(long, env = "QSTASH_DEV_TOKEN", default_value = qstash_dev::DEV_TOKEN)]
    token: String,
    /// Signing key used for deliveries.
    #[arg(long, env = "QSTASH_DEV_CURRENT_SIGNING_KEY", default_value = qstash_dev::DEV_CURRENT_SIGNING_KEY)]
    current_signing_key: String,
    /// Next signing key.
    #[arg(long, env = "QSTASH_DEV_NEXT_SIGNING_KEY", default_value = qstash_dev::DEV_NEXT_SIGNING_KEY)]
    next_signing_key: String,
    /// Deduplication window, e.g. 10m, 1h, 90d.
    #[arg(long, env = "QSTASH_DEV_DEDUP_WINDOW", default_value = "10m", value_parser = parse_duration)]
    dedup_window: Duration,
    /// Multiplies every wait (delay, backoff, Retry-After, flow-control period); 0.001 = 1000x faster.
    #[arg(long, env = "QSTASH_DEV_TIME_SCALE", default_value_t = 1.0)]
    time_scale: f64,
    /// Retries when a publish does not set Upstash-Retries.
    #[arg(long, env = "QSTASH_DEV_DEFAULT_RETRIES", default_value_t = 3)]
    default_retries: u32,
    /// Flow-control waitlist order.
    #[arg(
        long,
        env = "QSTASH_DEV_WAITLIST_ORDER",
        value_enum,
        default_value = "shuffled"
    )]
    waitlist_order: Order,
    /// Seed for the waitlist shuffle and fault injection.
    #[arg(long, env = "QSTASH_DEV_SEED", default_value_t = 0)]
    seed: u64,
    /// Deliver messages (false = accept-only benchmark mode: nothing is stored or delivered).
    #[arg(long, env = "QSTASH_DEV_DELIVER", default_value_t = true, action = clap::ArgAction::Set)]
    deliver: bool,
    /// Maximum deliveries in flight.
    #[arg(long, env = "QSTASH_DEV_MAX_CONCURRENCY", default_value_t = 256)]
    max_concurrency: usize,
    /// Per-attempt HTTP timeout cap, e.g. 15m.
    #[arg(long, env = "QSTASH_DEV_MAX_TIMEOUT", default_value = "15m", value_parser = parse_duration)]
    max_timeout: Duration,
    /// nbf claim of signatures.
    #[arg(long, env = "QSTASH_DEV_NBF", value_enum, default_value = "go-zero")]
    nbf: Nbf,
    /// When a failed response skips the remaining retries.
    #[arg(
        long,
        env = "QSTASH_DEV_NON_RETRYABLE",
        value_enum,
        default_value = "require489"
    )]
    non_retryable: NonRetryable,
    /// Whether a Retry-After-scheduled retry uses up one of the message's retries.
    #[arg(long, env = "QSTASH_DEV_RETRY_AFTER_CONSUMES_RETRY", default_value_t = true, action = clap::ArgAction::Set)]
    retry_after_consumes_retry: bool,
    /// `upstash-region` header on deliveries (empty = leave it out).
    #[arg(long, env = "QSTASH_DEV_REGION", default_value = "EU-CENTRAL-1")]
    region: String,
    /// JSON type of notBefore / createdAt in callback bodies.
    #[arg(
        long,
        env = "QSTASH_DEV_CALLBACK_TIMESTAMPS",
        value_enum,
        default_value = "number"
    )]
    callback_timestamps: Timestamps,
    /// Attempts kept in memory for /__dev/attempts.
    #[arg(
        long,
        env = "QSTASH_DEV_ATTEMPT_LOG_CAPACITY",
        default_value_t = 50_000
    )]
    attempt_log_capacity: usize,
    /// DLQ retention, e.g. 7d.
    #[arg(long, env = "QSTASH_DEV_DLQ_RETENTION", default_value = "7d", value_parser = parse_duration)]
    dlq_retention: Duration,
    /// Log format.
    #[arg(
        long,
        env = "QSTASH_DEV_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    log_format: LogFormat,
}

impl Args {
    fn config(&self) -> Config {
        Config {
            bind: self.bind,
            port: self.port,
            token: self.token.clone(),
            current_signing_key: self.current_signing_key.clone(),
            next_signing_key: self.next_signing_key.clone(),
            dedup_window: self.dedup_window,
            time_scale: self.time_scale,
            default_retries: self.default_retries,
            waitlist_order: match self.waitlist_order {
                Order::Fifo => WaitlistOrder::Fifo,
                Order::Shuffled => WaitlistOrder::Shuffled,
            },
            seed: self.seed,
            deliver: self.deliver,
            max_concurrency: self.max_concurrency,
            max_timeout: self.max_timeout,
            nbf: match self.nbf {
                Nbf::GoZero => NbfMode::GoZero,
                Nbf::Now => NbfMode::Now,
            },
            non_retryable: match self.non_retryable {
                NonRetryable::Require489 => NonRetryableMode::Require489,
                NonRetryable::HeaderAlone => NonRetryableMode::HeaderAlone,
            },
            retry_after_consumes_retry: self.retry_after_consumes_retry,
            region: Some(self.region.clone()).filter(|r| !r.is_empty()),
            callback_timestamps: match self.callback_timestamps {
                Timestamps::Number => TimestampFormat::Number,
                Timestamps::String => TimestampFormat::String,
            },
            attempt_log_capacity: self.attempt_log_capacity,
            dlq_retention: self.dlq_retention,
            ..Config::default()
        }
    }
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    init_tracing(args.log_format);
    let server = DevServer::start(args.config()).await?;
    let keys = server.signing_keys();
    println!("qstash-dev listening on {}", server.url());
    println!();
    println!("QSTASH_URL={}", server.url());
    println!("QSTASH_TOKEN={}", server.token());
    println!("QSTASH_CURRENT_SIGNING_KEY={}", keys.current);
    println!("QSTASH_NEXT_SIGNING_KEY={}", keys.next);
    println!();
    println!(
        "inspection API (same token): {}/__dev/stats, /__dev/attempts, /__dev/faults (PUT), /__dev/reset (POST)",
        server.url()
    );

    let handle = server.handle();
    let summary = tokio::spawn(async move {
        let mut last = handle.stats();
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        tick.tick().await;
        loop {
            tick.tick().await;
            let s = handle.stats();
            if s != last {
                tracing::info!(
                    accepted = s.accepted,
                    deduplicated = s.deduplicated,
                    delivered = s.delivered,
                    failed_to_dlq = s.failed_to_dlq,
                    attempts = s.attempts,
                    in_flight = s.in_flight,
                    waiting = s.waiting,
                    "summary"
                );
                last = s;
            }
        }
    });

    shutdown_signal().await;
    tracing::info!("shutting down");
    summary.abort();
    server.shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
