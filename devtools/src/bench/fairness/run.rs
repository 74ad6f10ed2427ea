//! The runs of `outbox-dev bench fairness` (see the module above).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use outbox::producer::{NewEvent, Producer};
use outbox_cli::util::DbArgs;
use outbox_testkit::percentile;
use serde_json::{Value, json};

use super::super::steady::{Draining, TOPIC, consumer_endpoint};
use super::super::support::{DevServerProcess, Knobs, ScratchDb, load_average};

/// `outbox-dev bench fairness`.
#[derive(Args, Debug)]
pub struct FairnessArgs {
    /// Tenant A's flood, in events.
    #[arg(long, default_value_t = 100_000)]
    pub flood: u64,
    /// The other tenants.
    #[arg(long, default_value_t = 10)]
    pub tenants: u32,
    /// Events per second each other tenant writes.
    #[arg(long, default_value_t = 10)]
    pub rate: u32,
    /// QStash messages per second per tenant in the limited run (`RELAY_TENANT_LIMITS=<topic>:rate=N`).
    #[arg(long, default_value_t = 40)]
    pub limit_rate: u32,
    /// How long the others write in the runs without a flood, in seconds.
    #[arg(long, default_value_t = 15)]
    pub baseline_secs: u64,
    /// Small sizes (seconds): for checking the command.
    #[arg(long)]
    pub quick: bool,
    /// Also write the figures into DIR/benchmarks.md (its fairness section) and DIR/benchmarks/figures.json.
    #[arg(long)]
    pub report: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub db: DbArgs,
}

/// One run's traffic and relay settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The others alone.
    Others,
    /// A's flood alone.
    FloodAlone,
    /// Both, fair claims.
    Fair,
    /// Both, the claim before fairness keys.
    Unfair,
    /// Both, fair claims and every tenant limited at QStash.
    Limited,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Others => "others_alone",
            Kind::FloodAlone => "flood_alone",
            Kind::Fair => "flood_fair",
            Kind::Unfair => "flood_oldest_first",
            Kind::Limited => "flood_limited",
        }
    }
    fn flood(self) -> bool {
        self != Kind::Others
    }
    fn others(self) -> bool {
        self != Kind::FloodAlone
    }
}

const FLOOD_KEY: &str = "A";

pub async fn run(args: FairnessArgs) -> anyhow::Result<()> {
    let mut args = args;
    if args.quick {
        args.flood = args.flood.min(5_000);
        args.baseline_secs = args.baseline_secs.min(3);
        args.limit_rate = args.limit_rate.max(20);
    }
    let load_before = load_average();
    let mut runs = serde_json::Map::new();
    for kind in [
        Kind::Others,
        Kind::FloodAlone,
        Kind::Fair,
        Kind::Unfair,
        Kind::Limited,
    ] {
        let r = one_run(&args, kind).await?;
        println!("{}: {}", kind.name(), summary_line(&r));
        runs.insert(kind.name().to_owned(), r);
    }
    let runs = Value::Object(runs);
    let ratio = |run: &str, field: &str, base: &str| {
        let a = runs[run][field]["p99"].as_f64().unwrap_or(0.0);
        let b = runs[base][field]["p99"].as_f64().unwrap_or(0.0);
        if b > 0.0 { a / b } else { 0.0 }
    };
    let drain = |run: &str| {
        let a = runs[run]["flood_events_per_sec"].as_f64().unwrap_or(0.0);
        let b = runs["flood_alone"]["flood_events_per_sec"]
            .as_f64()
            .unwrap_or(0.0);
        if b > 0.0 { a / b } else { 0.0 }
    };
    let figures = json!({
        "flood": args.flood, "tenants": args.tenants, "rate_per_tenant": args.rate,
        "limit_rate": args.limit_rate, "quick": args.quick,
        "load_average_before": load_before, "load_average_after": load_average(),
        "runs": runs,
        "others_p99_vs_alone": {
            "fair": ratio("flood_fair", "others_applied_ms", "others_alone"),
            "oldest_first": ratio("flood_oldest_first", "others_applied_ms", "others_alone"),
            "limited": ratio("flood_limited", "others_applied_ms", "others_alone"),
        },
        "flood_drain_vs_alone": {
            "fair": drain("flood_fair"), "oldest_first": drain("flood_oldest_first"),
            "limited": drain("flood_limited"),
        },
    });
    println!("BENCH_JSON {}", serde_json::to_string(&figures)?);
    if let Some(dir) = &args.report {
        for path in super::report::write(dir, &figures)? {
            println!("wrote {}", path.display());
        }
    }
    Ok(())
}

fn summary_line(r: &Value) -> String {
    format!(
        "others' commit → applied p50 {:.0} ms, p99 {:.0} ms ({} events); flood {:.0} events/s",
        r["others_applied_ms"]["p50"].as_f64().unwrap_or(0.0),
        r["others_applied_ms"]["p99"].as_f64().unwrap_or(0.0),
        r["others_events"],
        r["flood_events_per_sec"].as_f64().unwrap_or(0.0),
    )
}

async fn one_run(args: &FairnessArgs, kind: Kind) -> anyhow::Result<Value> {
    let db = ScratchDb::create(&args.db.database_url, "outbox_bench_fair").await?;
    sqlx::query(
        "CREATE TABLE bench_applied (outbox_id bigint PRIMARY KEY, \
         applied_at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(&db.pool)
    .await?;
    let dev = DevServerProcess::start(&["--deliver", "true"]).await?;
    let result = measure(args, kind, &db, &dev).await;
    dev.stop().await;
    db.drop_now().await?;
    result
}

async fn measure(
    args: &FairnessArgs,
    kind: Kind,
    db: &ScratchDb,
    dev: &DevServerProcess,
) -> anyhow::Result<Value> {
    let (consumer_url, stop_consumer, _) = consumer_endpoint(&db.url).await?;
    let mut env = vec![("RELAY_FAIR_CLAIMS", (kind != Kind::Unfair).to_string())];
    if kind == Kind::Limited {
        let limit = format!("{}:rate={},period=1s", TOPIC.name(), args.limit_rate);
        env.push(("RELAY_TENANT_LIMITS", limit));
    }
    let knobs = Knobs {
        batch: 500,
        concurrency: 8,
        qstash_batch: 100,
    };
    // The import is committed before the relay starts: a backlog of the whole flood, as a bulk import makes when
    // it writes faster than the relay drains (a flood the relay keeps pace with delays no one).
    if kind.flood() {
        flood(&db.pool, args.flood).await?;
    }
    let relay = Draining::start(&db.url, &dev.url, consumer_url, knobs, &env).await?;

    let flood_done = Arc::new(tokio::sync::Notify::new());
    let others = kind.others().then(|| {
        let pool = db.pool.clone();
        let (tenants, rate) = (args.tenants, args.rate);
        let min = Duration::from_secs(args.baseline_secs);
        let until = kind.flood().then(|| flood_done.clone());
        tokio::spawn(async move { produce_others(pool, tenants, rate, min, until).await })
    });
    if kind.flood() {
        wait_flood_applied(&db.pool, args.flood).await?;
        flood_done.notify_one();
    }
    let written = match others {
        Some(task) => task.await??,
        None => 0,
    };
    wait_all_applied(&db.pool).await?;
    relay.stop().await?;
    let _ = stop_consumer.send(true);
    figures(&db.pool, kind, written).await
}

/// A's flood: `n` events in transactions of 1,000, as fast as the producer writes them.
async fn flood(pool: &sqlx::PgPool, n: u64) -> anyhow::Result<()> {
    let producer = Producer::default().notify(true);
    let mut conn = pool.acquire().await?;
    let mut i = 0;
    while i < n {
        let events: Vec<NewEvent> = (i..(i + 1000).min(n))
            .map(|j| {
                NewEvent::new(&TOPIC, format!("a{}", j % 1000), &json!({"i": j}))
                    .map(|e| e.fairness_key(FLOOD_KEY))
            })
            .collect::<Result<_, _>>()?;
        producer.enqueue_batch(&mut conn, &events).await?;
        i += events.len() as u64;
    }
    Ok(())
}

/// The other tenants, `rate` events/s each, one event per transaction, round robin; for at least `min`, and
/// while a flood is under way until it is applied. Returns how many it wrote.
async fn produce_others(
    pool: sqlx::PgPool,
    tenants: u32,
    rate: u32,
    min: Duration,
    until: Option<Arc<tokio::sync::Notify>>,
) -> anyhow::Result<u64> {
    let producer = Producer::default().notify(true);
    let mut conn = pool.acquire().await?;
    let per_sec = f64::from(tenants * rate).max(1.0);
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / per_sec));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut done = until.is_none();
    let notified = until.map(|n| tokio::spawn(async move { n.notified().await }));
    let mut notified = notified;
    let mut i: u64 = 0;
    loop {
        if let Some(task) = &notified
            && task.is_finished()
        {
            done = true;
            notified = None;
        }
        if done && started.elapsed() >= min {
            return Ok(i);
        }
        tick.tick().await;
        let tenant = format!("t{:02}", i % u64::from(tenants.max(1)));
        let event =
            NewEvent::new(&TOPIC, format!("{tenant}-{i}"), &json!({"i": i}))?.fairness_key(tenant);
        producer.enqueue(&mut conn, event).await?;
        i += 1;
    }
}

async fn wait_flood_applied(pool: &sqlx::PgPool, n: u64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let applied: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM bench_applied a JOIN outbox o ON o.id = a.outbox_id \
             WHERE o.fairness_key = $1",
        )
        .bind(FLOOD_KEY)
        .fetch_one(pool)
        .await?;
        if applied as u64 >= n {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("only {applied} of the flood's {n} events were applied in 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_all_applied(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let missing: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox o WHERE NOT EXISTS \
             (SELECT 1 FROM bench_applied a WHERE a.outbox_id = o.id)",
        )
        .fetch_one(pool)
        .await?;
        if missing == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{missing} events not applied within 120 s of the last commit");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The run's figures, from Postgres clock readings only: the others' commit → applied (while the flood had
/// events waiting, in a run with a flood), the flood's events over first commit → last applied.
async fn figures(pool: &sqlx::PgPool, kind: Kind, written: u64) -> anyhow::Result<Value> {
    let (flood_n, flood_secs): (i64, Option<f64>) = sqlx::query_as(
        "SELECT count(*), extract(epoch FROM max(a.applied_at) - min(o.created_at))::float8 \
         FROM outbox o JOIN bench_applied a ON a.outbox_id = o.id WHERE o.fairness_key = $1",
    )
    .bind(FLOOD_KEY)
    .fetch_one(pool)
    .await?;
    let others: Vec<f64> = sqlx::query_scalar(
        "WITH f AS (SELECT min(o.created_at) AS start, max(a.applied_at) AS done \
                    FROM outbox o JOIN bench_applied a ON a.outbox_id = o.id WHERE o.fairness_key = $1) \
         SELECT (extract(epoch FROM a.applied_at - o.created_at) * 1000)::float8 \
         FROM outbox o JOIN bench_applied a ON a.outbox_id = o.id, f \
         WHERE o.fairness_key <> $1 \
           AND (f.start IS NULL OR (o.created_at >= f.start AND o.created_at <= f.done))",
    )
    .bind(FLOOD_KEY)
    .fetch_all(pool)
    .await?;
    let pct = |v: &[f64]| {
        json!({"p50": percentile(v, 0.5), "p90": percentile(v, 0.9), "p99": percentile(v, 0.99),
               "max": percentile(v, 1.0)})
    };
    let flood_rate = match flood_secs {
        Some(s) if s > 0.0 => flood_n as f64 / s,
        _ => 0.0,
    };
    Ok(json!({
        "kind": kind.name(),
        "others_written": written,
        "others_events": others.len(),
        "others_applied_ms": pct(&others),
        "flood_events": flood_n,
        "flood_secs": flood_secs.unwrap_or(0.0),
        "flood_events_per_sec": flood_rate,
    }))
}
