//! `outbox-dev soak`: the whole pipeline under chaos, then an account of every event.
//!
//! The command creates a fresh database, applies the library's migrations and creates the soak's own table
//! (`soak_applied`), starts the QStash dev server in process with its faults on (seeded), and spawns its own
//! executable as separate worker processes ([`worker`]): `--relays` relays, one consumer and one callback
//! receiver, each running the library code the Lambdas run and configured from the environment like them.
//! Producers (tasks of this process, through `outbox::enqueue`) write `--events` events over `--keys` keys to one
//! ordered and one unordered topic; one in `--poison-every` is poison (the consumer's handler rejects it as
//! permanent: it must end as a dead letter). Meanwhile a seeded chaos loop SIGKILLs relays, the consumer and the
//! callback receiver at random moments (transactions die mid-flight; each is restarted, the receivers on the
//! same port while QStash retries), terminates their Postgres backends (`pg_terminate_backend`, found by
//! `application_name`), optionally restarts Postgres (`--pg-restart-cmd`) and makes the dev server fail every
//! publish for `--outage-secs` (a QStash outage).
//!
//! Then it stops the producers and the chaos, waits for the pipeline to drain (bounded: a timeout fails the run)
//! and counts from the database ([`verdict`]): events enqueued, applied once, dead-lettered (poison, other, with
//! normalised reasons), applied twice, lost (neither applied nor dead-lettered), per-key order violations on the
//! ordered topic, rows left leased, and the kills. The consumer's table has no unique constraint, so a double
//! apply is visible. The unexpected (non-poison) dead letters are bounded by the dev server's own record
//! ([`explained_dead_letters`], `outbox_testkit::given_up`): they must be exactly the events QStash gave up on
//! after every delivery attempt of their message failed, and none when nothing could exhaust QStash's retries.
//! It prints one short line (and `--json FILE`) and fails when a must-be-zero figure is not zero or the dead
//! letters are out of their bound ([`SoakReport::judge`]).

mod app;
mod chaos;
pub mod explore;
mod produce;
mod report;
pub(crate) mod supervisor;
pub(crate) mod verdict;
pub mod worker;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Parser};
use outbox::Topic;
use rand::SeedableRng;
use rand::rngs::StdRng;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use outbox_cli::util::{DbArgs, connect};
use outbox_testkit::db::with_database;

pub use app::{Apply, SoakPayload, create_table, registry};
pub use report::{LINE_REASONS, REASON_CHARS, Reason, SoakReport, reason_of};
pub use verdict::{explained_dead_letters, verdict};

use chaos::{chaos, chaos_pause};
use produce::produce;
use supervisor::{
    Kind, Spawner, Worker, default_env, default_log_dir, kill, reserve_port, supervise,
    wait_listening,
};
use verdict::{account, busy, progress};

/// The soak's ordered topic (dead heads are skipped: `RELAY_SKIP_DEAD_HEAD_TOPICS`).
pub const ORDERED: Topic = Topic::ordered("soak_ordered");
/// The soak's unordered topic.
pub const UNORDERED: Topic = Topic::unordered("soak_unordered");
/// What the consumer's handler answers a poison event (the dead letter's recognisable reason).
pub const POISON_REASON: &str = "soak poison event";

/// Arguments of `outbox-dev soak`.
#[derive(Args, Debug, Clone)]
pub struct SoakArgs {
    /// The Postgres server; the soak runs in a fresh database (--database) on it.
    #[command(flatten)]
    pub db: DbArgs,
    /// Name of the soak's database on DATABASE_URL's server (dropped first if it exists, then created).
    #[arg(long, default_value = "outbox_soak")]
    pub database: String,
    /// Events to write (half to the ordered topic, half to the unordered one).
    #[arg(long, default_value_t = 20_000)]
    pub events: u64,
    /// Partition keys.
    #[arg(long, default_value_t = 500)]
    pub keys: u64,
    /// One event in N is poison (dead-lettered by the consumer); 0 disables.
    #[arg(long, default_value_t = 50)]
    pub poison_every: u64,
    /// Events per second, all producers together.
    #[arg(long, default_value_t = 150.0)]
    pub rate: f64,
    /// Concurrent producer tasks.
    #[arg(long, default_value_t = 4)]
    pub producers: usize,
    /// Relay processes.
    #[arg(long, default_value_t = 2)]
    pub relays: usize,
    /// Mean time between two chaos actions (a SIGKILL of a relay, the consumer or the callback receiver, or a
    /// pg_terminate_backend); each waits a random 0.5x to 1.5x of it. 0 disables the chaos.
    #[arg(long, default_value_t = 2000)]
    pub kill_every_ms: u64,
    /// A QStash outage: the dev server fails every publish (500) for this many seconds, from --outage-at-secs.
    #[arg(long, default_value_t = 0)]
    pub outage_secs: u64,
    /// When the outage starts, seconds after the producers start.
    #[arg(long, default_value_t = 10)]
    pub outage_at_secs: u64,
    /// A shell command that restarts Postgres, run once when half the events are written (e.g.
    /// "pg_ctlcluster --skip-systemctl-redirect 15 main restart"). Never in a shared test run.
    #[arg(long)]
    pub pg_restart_cmd: Option<String>,
    /// Seed of the chaos, the producers' choices and the dev server's faults.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Give up (and fail) when the pipeline has not drained this long after the producers and the outage end.
    #[arg(long, default_value_t = 300)]
    pub drain_timeout_secs: u64,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Directory for the workers' logs [default: target/outbox-dev/soak-{UTC time}-{pid}].
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// Seconds between two progress lines on stderr.
    #[arg(long, default_value_t = 10)]
    pub progress_secs: u64,
    /// The executable to run the workers with [default: this one]; tests pass the `outbox-dev` binary.
    #[arg(long, hide = true)]
    pub worker_exe: Option<PathBuf>,
    /// `steady`: the scenario the flags above describe. `random`: the schedule explorer — a timeline of traffic,
    /// faults (a Postgres crash among them) and operator actions drawn from --seed over --minutes, run on a
    /// Postgres cluster of its own (DATABASE_URL and --database are not used), then checked per event and
    /// subscriber; a violation prints the seed, the schedule and the events' histories.
    #[arg(long, value_enum, default_value_t = ScheduleKind::Steady)]
    pub schedule: ScheduleKind,
    /// Length of a random schedule in minutes (the drain comes after).
    #[arg(long, default_value_t = 2.0)]
    pub minutes: f64,
    /// Print the random schedule of --seed and --minutes, and exit.
    #[arg(long)]
    pub print_schedule: bool,
}

/// Which schedule a soak runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ScheduleKind {
    /// Steady producers, kills, the dev server's faults, one subscriber (`--events`, `--kill-every-ms`, …).
    Steady,
    /// A seeded random timeline of traffic, faults and operator actions (`--seed`, `--minutes`).
    Random,
}

#[derive(Parser)]
struct Wrapper {
    #[command(flatten)]
    args: SoakArgs,
}

impl SoakArgs {
    /// The arguments as the command line `outbox-dev soak ARGS…` would give them (defaults for the rest).
    pub fn parse(args: &[&str]) -> anyhow::Result<SoakArgs> {
        let argv = std::iter::once("soak").chain(args.iter().copied());
        Ok(Wrapper::try_parse_from(argv)?.args)
    }
}

/// Counters shared by the chaos loop and the report.
#[derive(Default)]
pub(crate) struct Counts {
    pub(crate) relay_kills: AtomicU64,
    pub(crate) consumer_kills: AtomicU64,
    pub(crate) callback_kills: AtomicU64,
    pub(crate) backend_kills: AtomicU64,
    pub(crate) restarts: AtomicU64,
    pub(crate) worker_exits: AtomicU64,
    pub(crate) pg_restarts: AtomicU64,
    pub(crate) written: AtomicU64,
}

/// A pool that survives Postgres restarts and terminated backends (connections are checked before use).
/// The dev server's clock: QStash's retry delays ×0.05.
const TIME_SCALE: f64 = 0.05;

/// The longest the drain can legitimately take once the chaos is off, from the workers' settings: a message's
/// retries then its failure callback's (each QStash's retry delays at the dev server's scale), or, when that
/// callback never reached a receiver, the reconciler's horizon plus one relay invocation and its accounting
/// pass; and a minute for the rest (backoff, the applied sweep, the last delivery). The soak waits at least this
/// long, whatever `--drain-timeout-secs` says.
fn drain_bound(spawner: &Spawner, time_scale: f64) -> anyhow::Result<Duration> {
    let var = |name: &str| -> anyhow::Result<u64> {
        let v = spawner
            .env
            .iter()
            .find(|(k, _)| k == name)
            .with_context(|| format!("{name} is not set for the workers"))?;
        v.1.parse()
            .with_context(|| format!("{name}={:?} is not a whole number", v.1))
    };
    let retries = u32::try_from(var("QSTASH_RETRIES")?)?;
    let qstash = outbox::config::qstash_retry_horizon(retries).mul_f64(2.0 * time_scale);
    let reconciler =
        Duration::from_secs(var("RELAY_RECONCILE_AFTER_SECS")? + spawner.relay_invocation_secs)
            + outbox::internals::handler::ACCOUNTING_BUDGET;
    Ok(qstash.max(reconciler) + Duration::from_secs(60))
}

/// The dev server's configuration for a soak (seeded; QStash's clock at [`TIME_SCALE`]) and the faults it runs
/// with: 10 % of publishes fail, 5 % lose their response, 10 % of deliveries come twice, 5 % fail in the network.
pub(crate) fn dev_server_config(seed: u64) -> (qstash_dev::Config, qstash_dev::Faults) {
    let faults = qstash_dev::Faults {
        publish_5xx_rate: 0.10,
        publish_drop_response_rate: 0.05,
        duplicate_delivery_rate: 0.10,
        delivery_network_error_rate: 0.05,
        ..Default::default()
    };
    let cfg = qstash_dev::Config {
        port: 0,
        seed,
        time_scale: TIME_SCALE,
        waitlist_order: qstash_dev::WaitlistOrder::Shuffled,
        // Shorter than the relays' evidence timeout (20 s below): when an ordered head's delivery callback is
        // lost, the relay republishes it after that timeout with the same deduplication id, and within the
        // window QStash would swallow the republish — the key would wait out the whole window (10 min).
        dedup_window: Duration::from_secs(10),
        faults: faults.clone(),
        ..qstash_dev::Config::default()
    };
    (cfg, faults)
}

/// The workers' environment: the functions' variables for database `url`, the dev server, the default consumer
/// and the callback receiver, the dead heads of the topics `skip_dead_heads` skipped, and laptop-scale relay
/// settings (unless the caller's environment sets them).
pub(crate) fn worker_env(
    url: &str,
    dev: &qstash_dev::DevServer,
    consumer_url: &str,
    callback_url: &str,
    skip_dead_heads: &[&str],
) -> Vec<(String, String)> {
    let keys = dev.signing_keys();
    let mut env: Vec<(String, String)> = vec![
        ("DATABASE_URL".into(), url.to_owned()),
        ("QSTASH_URL".into(), dev.url()),
        ("QSTASH_TOKEN".into(), dev.token().to_owned()),
        ("QSTASH_CURRENT_SIGNING_KEY".into(), keys.current.clone()),
        ("QSTASH_NEXT_SIGNING_KEY".into(), keys.next.clone()),
        // The dev server's public keys and token: the workers (the functions' own setup) refuse them without it.
        ("OUTBOX_ALLOW_DEV_KEYS".into(), "true".into()),
        ("CONSUMER_URL".into(), consumer_url.to_owned()),
        ("CALLBACK_URL".into(), callback_url.to_owned()),
        ("CONSUMER_NAME".into(), "soak".into()),
        (
            "RELAY_SKIP_DEAD_HEAD_TOPICS".into(),
            skip_dead_heads.join(","),
        ),
    ];
    // Laptop-scale relay settings (like the local stack's), unless the environment sets them.
    for (k, v) in [
        ("RELAY_LEASE_SECS", "5"),
        ("RELAY_POLL_INTERVAL_MS", "100"),
        ("RELAY_DEADLINE_MARGIN_MS", "500"),
        ("RELAY_CONCURRENCY", "2"),
        // Short, so that a delivery callback lost with a killed callback receiver costs seconds, not the
        // production default (QStash's retry horizon + 1 h): the relay republishes the head, the consumer dedupes.
        ("RELAY_EVIDENCE_TIMEOUT_SECS", "20"),
        // Short for the same reason: an event whose failure callback never arrived (the callback receiver was
        // killed through all of the callback's retries) is looked up at QStash after this, not after the
        // production horizon (hours), so it ends as a dead letter within the drain. At least
        // RELAY_APPLIED_GRACE_SECS (30), so the applied sweep comes first.
        ("RELAY_RECONCILE_AFTER_SECS", "30"),
        ("RELAY_BACKOFF_BASE_SECS", "0.5"),
        ("RELAY_BACKOFF_CAP_SECS", "10"),
        ("RELAY_OUTAGE_PROBE_BASE_MS", "200"),
        ("RELAY_OUTAGE_PROBE_CAP_SECS", "2"),
        ("QSTASH_RETRIES", "3"),
        ("RUST_LOG", "warn"),
    ] {
        default_env(&mut env, k, v);
    }
    env
}

fn pool(url: &str, name: &str, max: u32) -> anyhow::Result<PgPool> {
    let opts: PgConnectOptions = url.parse().context("DATABASE_URL")?;
    Ok(PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .test_before_acquire(true)
        .connect_lazy_with(opts.application_name(name)))
}

/// Runs a soak; the report says whether it passed (the caller decides the exit status).
pub async fn run(args: SoakArgs) -> anyhow::Result<SoakReport> {
    let started = Instant::now();
    outbox::install_crypto_provider();
    let schema = outbox::schema::from_process_env()?;
    outbox::schema::install(&schema)?;
    anyhow::ensure!(args.keys > 0, "--keys must be at least 1");
    anyhow::ensure!(args.relays > 0, "--relays must be at least 1");
    anyhow::ensure!(args.producers > 0, "--producers must be at least 1");
    anyhow::ensure!(args.rate > 0.0, "--rate must be positive");

    // A fresh database, migrated, with the soak's table.
    let admin = connect(&args.db.database_url).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
        args.database.replace('"', "")
    )))
    .execute(&admin)
    .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE \"{}\"",
        args.database.replace('"', "")
    )))
    .execute(&admin)
    .await
    .context("creating the soak database (the user needs CREATEDB)")?;
    admin.close().await;
    let url = with_database(&args.db.database_url, &args.database);
    let db = pool(&url, "soak-producer", (args.producers + 4) as u32)?;
    outbox::migrate(&db, outbox::schema::current())
        .await
        .context("applying the outbox migrations")?;
    create_table(&db).await?;

    // The dev server, faults on, seeded.
    let (dev_cfg, faults) = dev_server_config(args.seed);
    let dev = qstash_dev::DevServer::start(dev_cfg)
        .await
        .map_err(|e| anyhow::anyhow!("starting the QStash dev server: {e}"))?;

    // The workers.
    let log_dir = args.log_dir.clone().unwrap_or_else(default_log_dir);
    std::fs::create_dir_all(&log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
    // Held until the run ends: each receiver's port stays its own across kills and restarts.
    let (consumer_reserved, callback_reserved) = (reserve_port()?, reserve_port()?);
    let (consumer_port, callback_port) = (consumer_reserved.port(), callback_reserved.port());
    let consumer_url = format!("http://127.0.0.1:{consumer_port}");
    let callback_url = format!("http://127.0.0.1:{callback_port}");
    let env = worker_env(&url, &dev, &consumer_url, &callback_url, &[ORDERED.name()]);
    let spawner = Spawner::new(args.worker_exe.as_ref(), env, log_dir.clone(), 30)?;
    let mut workers: Vec<Worker> = (0..args.relays)
        .map(|i| Worker::new(Kind::Relay, i, None))
        .collect();
    workers.push(Worker::new(Kind::Consumer, 0, Some(consumer_port)));
    workers.push(Worker::new(Kind::Callback, 0, Some(callback_port)));
    for w in &mut workers {
        spawner.spawn(w)?;
    }
    for p in [consumer_port, callback_port] {
        wait_listening(p, Duration::from_secs(60)).await?;
    }
    eprintln!(
        "soak: database {}, dev server {}, {} relays, consumer {consumer_url}, callbacks {callback_url}, logs {}",
        args.database,
        dev.url(),
        args.relays,
        crate::dev::logs::display(&log_dir)
    );

    // Producers, chaos, outage.
    let counts = Arc::new(Counts::default());
    let next = Arc::new(AtomicU64::new(0));
    let produce_started = Instant::now();
    let producers: Vec<_> = (0..args.producers)
        .map(|i| {
            tokio::spawn(produce(
                db.clone(),
                args.clone(),
                i,
                next.clone(),
                counts.clone(),
                produce_started,
            ))
        })
        .collect();
    let outage_over = Arc::new(AtomicBool::new(args.outage_secs == 0));
    let outage = (args.outage_secs > 0).then(|| {
        let handle = dev.handle();
        let (at, secs, over) = (args.outage_at_secs, args.outage_secs, outage_over.clone());
        let normal = faults.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(at)).await;
            eprintln!("soak: QStash outage for {secs} s (every publish fails)");
            let _ = handle.set_faults(qstash_dev::Faults {
                publish_5xx_rate: 1.0,
                ..normal.clone()
            });
            tokio::time::sleep(Duration::from_secs(secs)).await;
            let _ = handle.set_faults(normal);
            eprintln!("soak: QStash is back");
            over.store(true, Ordering::SeqCst);
        })
    });

    let mut rng = StdRng::seed_from_u64(args.seed ^ 0x50a4);
    let mut pg_restart_pending = args.pg_restart_cmd.clone();
    let mut next_chaos = Instant::now() + chaos_pause(&mut rng, args.kill_every_ms);
    let mut next_progress = Instant::now() + Duration::from_secs(args.progress_secs.max(1));
    let dev_handle = dev.handle();
    loop {
        let producing = !producers.iter().all(|p| p.is_finished());
        if !producing && outage_over.load(Ordering::SeqCst) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        supervise(&spawner, &mut workers, &counts).await;
        if args.kill_every_ms > 0 && Instant::now() >= next_chaos {
            chaos(&mut rng, &spawner, &mut workers, &db, &counts).await;
            next_chaos = Instant::now() + chaos_pause(&mut rng, args.kill_every_ms);
        }
        if let Some(cmd) = &pg_restart_pending
            && counts.written.load(Ordering::Relaxed) >= args.events / 2
        {
            eprintln!("soak: restarting Postgres: {cmd}");
            let status = tokio::process::Command::new("sh")
                .args(["-c", cmd])
                .status()
                .await;
            match status {
                Ok(s) if s.success() => {
                    counts.pg_restarts.fetch_add(1, Ordering::Relaxed);
                }
                other => eprintln!("soak: the Postgres restart command failed: {other:?}"),
            }
            pg_restart_pending = None;
        }
        if Instant::now() >= next_progress {
            progress(&db, &counts, &dev_handle, started, "running").await;
            next_progress = Instant::now() + Duration::from_secs(args.progress_secs.max(1));
        }
    }
    for p in producers {
        p.await.context("a producer panicked")?;
    }
    if let Some(o) = outage {
        let _ = o.await;
    }

    // Drain: every worker up, nothing pending or in flight, the dev server idle — twice in a row.
    eprintln!("soak: producers done; chaos off; draining");
    let drain_secs = args
        .drain_timeout_secs
        .max(drain_bound(&spawner, TIME_SCALE)?.as_secs());
    let drain_until = Instant::now() + Duration::from_secs(drain_secs);
    let mut quiet_twice = 0;
    let drained = loop {
        supervise(&spawner, &mut workers, &counts).await;
        let quiet = dev_handle.is_idle() && matches!(busy(&db).await, Ok(false));
        quiet_twice = if quiet { quiet_twice + 1 } else { 0 };
        if quiet_twice >= 3 {
            break true;
        }
        if Instant::now() >= drain_until {
            break false;
        }
        if Instant::now() >= next_progress {
            progress(&db, &counts, &dev_handle, started, "draining").await;
            next_progress = Instant::now() + Duration::from_secs(args.progress_secs.max(1));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    if !drained {
        eprintln!("soak: NOT drained after {drain_secs} s: counting what is there (the run fails)");
    }
    for w in &mut workers {
        kill(w).await;
    }
    // What QStash gave up on, by the dev server's own record (its DLQ), before it goes away.
    let dlq = dev_handle.dlq_entries();
    dev.shutdown().await;

    let mut report = account(&db).await?;
    report.explained_dead_letters = explained_dead_letters(&db, &dlq).await?;
    // Delivery faults, killed receivers and terminated backends can each make QStash give up on a message.
    report.retries_exhaustible =
        outbox_testkit::given_up::can_exhaust_retries(&faults) || args.kill_every_ms > 0;
    report.drained = drained;
    report.relay_kills = counts.relay_kills.load(Ordering::Relaxed);
    report.consumer_kills = counts.consumer_kills.load(Ordering::Relaxed);
    report.callback_kills = counts.callback_kills.load(Ordering::Relaxed);
    report.backend_kills = counts.backend_kills.load(Ordering::Relaxed);
    report.restarts = counts.restarts.load(Ordering::Relaxed);
    report.worker_exits = counts.worker_exits.load(Ordering::Relaxed);
    report.pg_restarts = counts.pg_restarts.load(Ordering::Relaxed);
    report.outage_secs = args.outage_secs;
    report.seed = args.seed;
    report.seconds = started.elapsed().as_secs_f64();
    report.judge();
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    db.close().await;
    Ok(report)
}
