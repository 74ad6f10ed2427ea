//! `outbox-dev dev`: the whole pipeline on one machine, with live progress. Ctrl-C stops the demo producer, lets
//! the relay and the dev server finish what is in flight (bounded by `--drain-secs`), then stops every component
//! after its current step: nothing that was committed is lost (a second Ctrl-C skips the wait).

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use outbox::relay::housekeeping;
use serde::Serialize;
use sqlx::PgPool;
use tokio::sync::watch;

use orders_example::demo::{self, DemoCounts, DemoOptions};
use outbox_cli::util::{connect, one_line, printable};
use outbox_testkit::db::with_database;
use outbox_testkit::stack::{LocalStack, StackOptions};

/// Arguments of `outbox-dev dev`.
#[derive(Args, Debug, Clone)]
pub struct DevArgs {
    /// Postgres server (its database is used only with --existing-db).
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub database_url: String,
    /// Run against DATABASE_URL's database as it is (migrated, never dropped) instead of a fresh `outbox_local`
    /// database.
    #[arg(long)]
    pub existing_db: bool,
    /// Do not run the demo producer (publish your own events, or just inspect).
    #[arg(long)]
    pub no_demo: bool,
    /// Fault injection: 10% of publishes fail with 5xx, 5% lose their response after being accepted, 10% of
    /// deliveries are duplicated, 5% fail on the network, and the flow-control waitlist is shuffled.
    #[arg(long)]
    pub faults: bool,
    /// Demo orders per second.
    #[arg(long, default_value_t = 20.0)]
    pub rate: f64,
    /// One demo order in N is poison (rejected as permanent, ends in the dead letters); 0 disables.
    #[arg(long, default_value_t = 25)]
    pub poison_every: u64,
    /// Port of the QStash dev server (falls back to a free port when taken; 0 = any).
    #[arg(long, default_value_t = 8080)]
    pub qstash_port: u16,
    /// Stop after this many seconds, as if Ctrl-C had been pressed.
    #[arg(long)]
    pub duration_secs: Option<u64>,
    /// On shutdown, wait at most this long for in-flight events.
    #[arg(long, default_value_t = 30)]
    pub drain_secs: u64,
    /// Print progress as JSON lines instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Figures of the pipeline at one moment.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Progress {
    /// Events written by producers.
    pub enqueued: i64,
    /// Accepted by QStash.
    pub dispatched: i64,
    /// Applied by the consumer (dedupe rows).
    pub applied: i64,
    /// Relay-side retries (attempts beyond the first).
    pub retried: i64,
    /// Dead letters (relay and QStash).
    pub dead_lettered: i64,
    /// Pending in the outbox.
    pub pending: i64,
    /// Oldest pending age, seconds.
    pub oldest_pending_secs: f64,
    /// Ordered heads waiting for delivery evidence.
    pub awaiting_evidence: i64,
    /// Ordered keys blocked by a dead head.
    pub blocked_keys: i64,
    /// Delivery attempts QStash made (all kinds).
    pub qstash_attempts: u64,
}

/// What `outbox-dev dev` ended with.
#[derive(Debug, Clone, Serialize)]
pub struct DevSummary {
    /// The last figures.
    pub progress: Progress,
    /// Demo producer counts.
    pub demo_orders: u64,
    /// Demo poison orders.
    pub demo_poison: u64,
    /// Everything in flight finished before shutdown.
    pub drained: bool,
    /// Seconds run.
    pub seconds: f64,
}

/// Reads the progress figures.
pub async fn progress(pool: &PgPool) -> anyhow::Result<Progress> {
    let (enqueued, dispatched, applied, retried, dead): (i64, i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox), \
                (SELECT count(*) FROM outbox WHERE dispatched_at IS NOT NULL), \
                (SELECT count(*) FROM processed_messages), \
                (SELECT coalesce(sum(attempts - 1), 0)::bigint FROM outbox WHERE attempts > 1), \
                (SELECT count(*) FROM dead_letters)",
    )
    .fetch_one(pool)
    .await?;
    let b = housekeeping::backlog(pool, true).await?;
    Ok(Progress {
        enqueued,
        dispatched,
        applied,
        retried,
        dead_lettered: dead,
        pending: b.pending,
        oldest_pending_secs: b.oldest_pending_age_secs,
        awaiting_evidence: b.awaiting_evidence,
        blocked_keys: b.blocked_keys,
        qstash_attempts: 0,
    })
}

async fn prepare_database(args: &DevArgs) -> anyhow::Result<String> {
    if args.existing_db {
        return Ok(args.database_url.clone());
    }
    let admin = connect(&args.database_url).await?;
    sqlx::query("DROP DATABASE IF EXISTS outbox_local WITH (FORCE)")
        .execute(&admin)
        .await?;
    sqlx::query("CREATE DATABASE outbox_local")
        .execute(&admin)
        .await
        .context(
            "creating the outbox_local database (the user needs CREATEDB, or use --existing-db)",
        )?;
    admin.close().await;
    Ok(with_database(&args.database_url, "outbox_local"))
}

async fn new_dead_letters(
    pool: &PgPool,
    after: i64,
) -> anyhow::Result<Vec<(i64, String, Option<String>, Option<String>, String)>> {
    Ok(sqlx::query_as(
        "SELECT id, source, topic, partition_key, error FROM dead_letters WHERE id > $1 ORDER BY id LIMIT 20",
    )
    .bind(after)
    .fetch_all(pool)
    .await?)
}

/// Runs the local pipeline until Ctrl-C (or `--duration-secs`).
pub async fn run(args: DevArgs) -> anyhow::Result<DevSummary> {
    if std::env::var_os("RUST_LOG").is_none() {
        // Keep the terminal for the progress lines; warnings and errors still show.
        outbox::telemetry::init_with_default(outbox::telemetry::LogFormat::Pretty, "warn");
    } else {
        outbox::telemetry::init_from_env();
    }
    let url = prepare_database(&args).await?;
    let mut opts = StackOptions::new(&url)?;
    opts.dev.port = if args.qstash_port != 0
        && std::net::TcpListener::bind(("127.0.0.1", args.qstash_port)).is_ok()
    {
        args.qstash_port
    } else {
        0
    };
    if args.faults {
        opts.dev.faults = qstash_dev::Faults {
            publish_5xx_rate: 0.10,
            publish_drop_response_rate: 0.05,
            duplicate_delivery_rate: 0.10,
            delivery_network_error_rate: 0.05,
            ..Default::default()
        };
        opts.dev.waitlist_order = qstash_dev::WaitlistOrder::Shuffled;
        opts.dev.time_scale = 0.05; // QStash's 12 s first retry becomes 0.6 s
    }
    let stack = LocalStack::start(opts).await?;
    let keys = stack.dev.signing_keys();
    println!("outbox-dev dev — the whole pipeline, locally");
    println!("  database          {}", redact(&url));
    println!(
        "  QStash dev server {}  (token {})",
        stack.dev.url(),
        stack.dev.token()
    );
    println!(
        "  signing keys      current {}  next {}",
        keys.current, keys.next
    );
    println!(
        "  consumer          {}/events/{{topic}}",
        stack.consumer_url
    );
    println!(
        "  failure callback  {}/failure   delivery callback {}/delivered",
        stack.callback_url, stack.callback_url
    );
    println!(
        "  demo producer     {}",
        if args.no_demo {
            "off".to_string()
        } else {
            format!("{} orders/s, 1 in {} poison", args.rate, args.poison_every)
        }
    );
    if args.faults {
        println!(
            "  fault injection   ON (publish 5xx 10%, lost responses 5%, duplicate deliveries 10%, network errors 5%, shuffled waitlist)"
        );
    }
    println!(
        "  inspect           outbox status --database-url {}   (Ctrl-C to stop)\n",
        redact(&url)
    );

    let (stop_tx, stop_rx) = watch::channel(false);
    let (counts_tx, counts_rx) = watch::channel(DemoCounts::default());
    let demo_task = (!args.no_demo).then(|| {
        tokio::spawn(demo::run(
            stack.pool.clone(),
            DemoOptions {
                orders_per_sec: args.rate,
                poison_every: args.poison_every,
            },
            stop_rx.clone(),
            counts_tx,
        ))
    });

    let started = Instant::now();
    let mut last = Progress::default();
    let mut last_dead_id = 0i64;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let stop_at = args.duration_secs.map(|s| started + Duration::from_secs(s));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = &mut ctrl_c => break,
        }
        last = report(&stack, &args, started, last, &mut last_dead_id).await?;
        if stop_at.is_some_and(|t| Instant::now() >= t) {
            break;
        }
    }

    println!(
        "\nstopping: demo producer off; waiting up to {} s for in-flight events (Ctrl-C again to skip)",
        args.drain_secs
    );
    let _ = stop_tx.send(true);
    if let Some(t) = demo_task {
        let _ = t.await;
    }
    let drained = tokio::select! {
        d = stack.wait_quiet(Duration::from_secs(args.drain_secs)) => d,
        _ = tokio::signal::ctrl_c() => false,
    };
    last = report(&stack, &args, started, last, &mut last_dead_id).await?;
    stack.stop().await;
    let c = *counts_rx.borrow();
    let summary = DevSummary {
        progress: last,
        demo_orders: c.orders,
        demo_poison: c.poison,
        drained,
        seconds: started.elapsed().as_secs_f64(),
    };
    if drained {
        println!(
            "stopped cleanly: everything committed was dispatched and delivered (or dead-lettered)."
        );
    } else {
        println!(
            "stopped before the pipeline was idle: {} event(s) still pending in the outbox will be relayed on the next run \
             with --existing-db; messages the dev server had not delivered yet are gone with it.",
            last.pending
        );
    }
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    }
    Ok(summary)
}

async fn report(
    stack: &LocalStack,
    args: &DevArgs,
    started: Instant,
    prev: Progress,
    last_dead: &mut i64,
) -> anyhow::Result<Progress> {
    let mut p = progress(&stack.pool).await?;
    p.qstash_attempts = stack.dev.handle().stats().attempts;
    let t = started.elapsed().as_secs_f64();
    if args.json {
        println!("{}", serde_json::json!({"t": t, "progress": p}));
    } else {
        println!(
            "t={t:>5.0}s enqueued {:>6} (+{:<4}) dispatched {:>6} (+{:<4}) applied {:>6} (+{:<4}) retried {:>4} dead-lettered {:>3} \
             | pending {:>4} oldest {:>5.1}s awaiting-evidence {:>3} blocked-keys {}",
            p.enqueued,
            p.enqueued - prev.enqueued,
            p.dispatched,
            p.dispatched - prev.dispatched,
            p.applied,
            p.applied - prev.applied,
            p.retried,
            p.dead_lettered,
            p.pending,
            p.oldest_pending_secs,
            p.awaiting_evidence,
            p.blocked_keys
        );
    }
    for (id, source, topic, key, error) in new_dead_letters(&stack.pool, *last_dead).await? {
        *last_dead = id;
        println!(
            "  dead letter #{id} [{}] {}/{}: {}",
            printable(&source),
            printable(&topic.unwrap_or_default()),
            printable(&key.unwrap_or_default()),
            one_line(&error, 160)
        );
    }
    Ok(p)
}

fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("****"));
            u.to_string()
        }
        _ => url.to_owned(),
    }
}
