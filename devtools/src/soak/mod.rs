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
mod args;
mod chaos;
mod counts;
mod dev_server;
pub mod explore;
mod pool;
mod produce;
mod report;
pub(crate) mod supervisor;
mod topics;
pub(crate) mod verdict;
pub mod worker;
mod worker_env;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::SeedableRng;
use rand::rngs::StdRng;

use outbox_cli::util::connect;
use outbox_testkit::db::with_database;

pub use app::{Apply, SoakPayload, create_table, registry};
pub use args::{ScheduleKind, SoakArgs};
pub use report::{LINE_REASONS, REASON_CHARS, Reason, SoakReport, reason_of};
pub use topics::{ORDERED, POISON_REASON, UNORDERED};
pub use verdict::{explained_dead_letters, verdict};

use chaos::{chaos, chaos_pause};
use counts::Counts;
use dev_server::{TIME_SCALE, dev_server_config};
use pool::pool;
use produce::produce;
use supervisor::{
    Kind, Spawner, Worker, default_log_dir, kill, reserve_port, supervise, wait_listening,
};
use verdict::{account, busy, progress};
use worker_env::{drain_bound, worker_env};

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
