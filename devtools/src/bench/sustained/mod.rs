//! `outbox-dev bench sustained`: a steady stream for an hour while retention deletes what is done — do the
//! outbox's size, its dead tuples and its latencies stay flat?
//!
//! Every other benchmark is a burst (drain a backlog, measure, drop the database). This one runs the pipeline as
//! deployed for `--minutes` minutes on a fresh database:
//!
//! * **producers** (tasks of this process, through `outbox::enqueue`, 1 to 3 events per transaction) write at
//!   `--rate` events/s: `--ordered-share` of them to an ordered topic over `--ordered-keys` keys, the rest to an
//!   unordered one;
//! * **relays**: `--relays` processes of `outbox relay` (simulated Lambda invocations of `--invocation-secs`
//!   through the relay function's handler, staggered like overlapping scheduled runs), configured with the
//!   relay's code defaults (delivery evidence from callbacks; the template deploys consumer and dedupe evidence)
//!   except the retention window: `OUTBOX_RETENTION_HOURS` and `PROCESSED_TTL_HOURS` are
//!   `--retention-minutes`, so the housekeeping each invocation starts with deletes as it does in production;
//! * the **consumer** and the **callback receiver** as processes (the functions' handlers over HTTP), the
//!   QStash-compatible dev server in this process delivering to them (no faults).
//!
//! Every `--minute-secs` (a minute) it writes one JSON line ([`sample::Minute`]): events produced, dispatched and
//! applied; the relays' claim p50/p99 (from the `ClaimLatencyP50/P99` metrics of the invocations that ended in the
//! minute, read from their EMF lines as CloudWatch would); commit → applied p50/p99 (the consumer's transaction
//! start minus the producer's, both Postgres clocks); size, index size, live and dead tuples and autovacuum runs
//! of `outbox`, `processed_messages`, `outbox_keys` and `dead_letters` ([`outbox::internals::health::read`]); the oldest
//! transaction's age; the CPU of the relays, the consumer, the callback receiver, Postgres and this process.
//!
//! `--long-transaction-at M` opens a `REPEATABLE READ` transaction at minute M that holds its snapshot (the xmin
//! horizon) for `--long-transaction-minutes`. At the end the producers stop, the pipeline drains, and every event
//! is accounted for ([`verdict::account`]): applied exactly once, none lost, per-key order kept, nothing left
//! leased. The targets ([`verdict::targets`]) are the command's verdict, printed and written, never a test's
//! assertion; the exit status is non-zero only when the accounting fails.
//!
//! `--quick` (seconds instead of minutes, a low rate) checks the command and the accounting; `scripts/test` runs
//! it. `--report DIR` adds the run to `DIR/benchmarks.md` (the sustained-load section), `DIR/benchmarks/*.svg`
//! and `DIR/benchmarks/figures.json` (`sustained`).

mod args;
pub mod report;
pub mod sample;
pub mod verdict;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::io::AsyncWriteExt;

use crate::soak::supervisor::{Kind, Spawner, Worker, kill, reserve_port, wait_listening};
use crate::soak::{ORDERED, SoakPayload, UNORDERED, create_table};
use outbox_cli::util::connect;
use outbox_testkit::db::with_database;

use super::support::{Machine, load_average};
use sample::{Minute, Sampler};

pub use args::SustainedArgs;

/// Counters the producers and the sampler share.
#[derive(Default)]
struct Shared {
    produced: AtomicU64,
    /// The producers have stopped.
    done: AtomicBool,
}

/// `outbox-dev bench sustained`.
pub async fn run(args: SustainedArgs) -> anyhow::Result<()> {
    let result = run_and_judge(args).await?;
    if !result["accounting"]["ok"].as_bool().unwrap_or(false) {
        anyhow::bail!(
            "the accounting failed: {}",
            result["accounting"]["problems"]
        );
    }
    Ok(())
}

/// Runs the whole thing and returns what `sustained.json` holds.
pub async fn run_and_judge(args: SustainedArgs) -> anyhow::Result<Value> {
    let args = args.effective();
    anyhow::ensure!(args.rate > 0.0, "--rate must be positive");
    anyhow::ensure!(args.minutes > 0, "--minutes must be at least 1");
    anyhow::ensure!(args.minute_secs > 0, "--minute-secs must be at least 1");
    anyhow::ensure!(args.relays > 0, "--relays must be at least 1");
    anyhow::ensure!(args.producers > 0, "--producers must be at least 1");
    anyhow::ensure!(
        args.ordered_keys > 0 && args.unordered_keys > 0,
        "--ordered-keys and --unordered-keys must be at least 1"
    );
    anyhow::ensure!(
        (0.0..=1.0).contains(&args.ordered_share),
        "--ordered-share must be between 0 and 1"
    );
    anyhow::ensure!(
        args.retention_minutes > 0.0,
        "--retention-minutes must be positive"
    );
    if let Some(at) = args.long_transaction_at {
        anyhow::ensure!(
            at >= 1 && at < args.minutes && args.long_transaction_minutes >= 1,
            "--long-transaction-at must be a minute of the run before its last (1 to {}), and \
             --long-transaction-minutes at least 1",
            args.minutes - 1
        );
    }
    outbox::install_crypto_provider();
    let schema = outbox::schema::from_process_env()?;
    outbox::schema::install(&schema)?;
    let started = Instant::now();
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;

    // A fresh database, migrated, with the consumer's table.
    let name = args.database.replace('"', "");
    let admin = connect(&args.db.database_url).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
    )))
    .execute(&admin)
    .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
        .execute(&admin)
        .await
        .context("creating the run's database (the user needs CREATEDB)")?;
    admin.close().await;
    let url = with_database(&args.db.database_url, &name);
    let opts: PgConnectOptions = url.parse().context("DATABASE_URL")?;
    let db = PgPoolOptions::new()
        .max_connections(args.producers as u32 + 4)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(opts.application_name("sustained-producer"))
        .await?;
    outbox::migrate(&db, outbox::schema::current())
        .await
        .context("applying the outbox migrations")?;
    create_table(&db).await?;
    let machine = Machine::read(&db).await?;
    let autovacuum = autovacuum_settings(&db).await?;

    // The dev server (no faults), then the workers.
    let dev = qstash_dev::DevServer::start(qstash_dev::Config {
        port: 0,
        ..qstash_dev::Config::default()
    })
    .await
    .map_err(|e| anyhow::anyhow!("starting the QStash dev server: {e}"))?;
    let keys = dev.signing_keys();
    let log_dir = args.out.join("logs");
    let _ = std::fs::remove_dir_all(&log_dir);
    std::fs::create_dir_all(&log_dir)?;
    // Held until the run ends: each receiver's port stays its own across restarts.
    let (consumer_reserved, callback_reserved) = (reserve_port()?, reserve_port()?);
    let (consumer_port, callback_port) = (consumer_reserved.port(), callback_reserved.port());
    let retention = format!("{:.6}", args.retention_hours());
    let env: Vec<(String, String)> = vec![
        ("DATABASE_URL".into(), url.clone()),
        ("QSTASH_URL".into(), dev.url()),
        ("QSTASH_TOKEN".into(), dev.token().to_owned()),
        ("QSTASH_CURRENT_SIGNING_KEY".into(), keys.current.clone()),
        ("QSTASH_NEXT_SIGNING_KEY".into(), keys.next.clone()),
        // The dev server's public keys and token: the workers refuse them without it.
        ("OUTBOX_ALLOW_DEV_KEYS".into(), "true".into()),
        (
            "CONSUMER_URL".into(),
            format!("http://127.0.0.1:{consumer_port}"),
        ),
        (
            "CALLBACK_URL".into(),
            format!("http://127.0.0.1:{callback_port}"),
        ),
        ("CONSUMER_NAME".into(), "sustained".into()),
        ("OUTBOX_RETENTION_HOURS".into(), retention.clone()),
        ("PROCESSED_TTL_HOURS".into(), retention),
        // Dedupe rows kept minutes instead of days: a reconciler would outlive them, and the relay refuses to start
        // with one (nothing is lost here: no message ever waits for it).
        ("RELAY_RECONCILE_MAX_LOOKUPS".into(), "0".into()),
        // JSON logs whatever the caller's environment says: the sampler reads the relays' summary lines.
        ("LOG_FORMAT".into(), "json".into()),
        // Warnings, and the relay's one summary line per invocation (its housekeeping figures).
        // The log target is where the handler is defined, whatever path the seam gives it.
        ("RUST_LOG".into(), "warn,outbox::relay::handler=info".into()),
    ];
    let spawner = Spawner::new(
        args.worker_exe.as_ref(),
        env,
        log_dir.clone(),
        args.invocation_secs,
    )?;
    let mut receivers = vec![
        Worker::new(Kind::Consumer, 0, Some(consumer_port)),
        Worker::new(Kind::Callback, 0, Some(callback_port)),
    ];
    for w in &mut receivers {
        spawner.spawn(w)?;
    }
    for p in [consumer_port, callback_port] {
        wait_listening(p, Duration::from_secs(60)).await?;
    }
    let mut relays: Vec<Worker> = (0..args.relays)
        .map(|i| Worker::new(Kind::Relay, i, None))
        .collect();
    // Staggered like scheduled runs that overlap: relay i starts i/relays of an invocation later.
    let stagger = Duration::from_secs_f64(args.invocation_secs as f64 / args.relays as f64);
    spawner.spawn(&mut relays[0])?;
    eprintln!(
        "sustained: database {name}, {:.0} events/s for {} × {} s, retention {} min, {} relays, logs {}",
        args.rate,
        args.minutes,
        args.minute_secs,
        args.retention_minutes,
        args.relays,
        crate::dev::logs::display(&log_dir)
    );

    // Producers.
    let shared = Arc::new(Shared::default());
    let stop = Arc::new(AtomicBool::new(false));
    let produce_started = Instant::now();
    let producers: Vec<_> = (0..args.producers)
        .map(|i| {
            tokio::spawn(produce(
                db.clone(),
                args.clone(),
                i,
                shared.clone(),
                stop.clone(),
                produce_started,
            ))
        })
        .collect();

    // The minutes.
    let lines_path = args.out.join("minutes.jsonl");
    let mut lines = tokio::fs::File::create(&lines_path)
        .await
        .with_context(|| format!("creating {}", lines_path.display()))?;
    let mut sampler = Sampler::new(&url, &relays, &receivers, &log_dir).await?;
    let period = Duration::from_secs(args.minute_secs);
    let mut minutes: Vec<Minute> = Vec::new();
    let mut long_tx: Option<sqlx::PgConnection> = None;
    let mut next_relay = 1;
    for minute in 1..=args.minutes {
        let due = produce_started + period * minute;
        loop {
            let now = Instant::now();
            if now >= due {
                break;
            }
            // The next relay starts on its stagger; a relay that exited by itself is restarted.
            if next_relay < relays.len() && produce_started + stagger * next_relay as u32 <= now {
                spawner.spawn(&mut relays[next_relay])?;
                next_relay += 1;
            }
            restart_exited(&spawner, &mut relays[..next_relay]);
            restart_exited(&spawner, &mut receivers);
            sampler.track(&relays, &receivers);
            tokio::time::sleep((due - now).min(Duration::from_millis(500))).await;
        }
        let pinned = long_tx.is_some();
        let m = sampler
            .minute(minute, shared.produced.load(Ordering::Relaxed), pinned)
            .await?;
        eprintln!("sustained: {}", m.line());
        lines
            .write_all(format!("{}\n", serde_json::to_string(&m)?).as_bytes())
            .await?;
        lines.flush().await?;
        minutes.push(m);
        // The long transaction opens at the end of minute `at` and closes `long_transaction_minutes` later.
        if let Some(at) = args.long_transaction_at {
            if minute == at {
                long_tx = Some(pin_horizon(&url).await?);
                eprintln!("sustained: a long transaction holds the xmin horizon from now");
            } else if minute == at + args.long_transaction_minutes
                && let Some(mut c) = long_tx.take()
            {
                sqlx::query("ROLLBACK").execute(&mut c).await?;
                eprintln!("sustained: the long transaction ended");
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    let mut ledger: Vec<i64> = Vec::new();
    for p in producers {
        ledger.extend(p.await.context("a producer panicked")??);
    }
    shared.done.store(true, Ordering::SeqCst);
    if let Some(mut c) = long_tx.take() {
        let _ = sqlx::query("ROLLBACK").execute(&mut c).await;
    }
    let produced_secs = produce_started.elapsed().as_secs_f64();
    eprintln!(
        "sustained: producers stopped after {} events; draining",
        ledger.len()
    );

    // Drain: nothing pending or in flight, the dev server idle, every event applied or dead — three times in a row.
    let drain_until = Instant::now() + Duration::from_secs(args.drain_timeout_secs);
    let mut quiet = 0;
    let drained = loop {
        restart_exited(&spawner, &mut relays[..next_relay]);
        restart_exited(&spawner, &mut receivers);
        let done = dev.handle().is_idle()
            && !crate::soak::verdict::busy(&db).await.unwrap_or(true)
            && verdict::settled(&db, ledger.len() as i64)
                .await
                .unwrap_or(false);
        quiet = if done { quiet + 1 } else { 0 };
        if quiet >= 3 {
            break true;
        }
        if Instant::now() >= drain_until {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let drain_secs = produce_started.elapsed().as_secs_f64() - produced_secs;
    for w in relays.iter_mut().chain(receivers.iter_mut()) {
        kill(w).await;
    }
    let emf = sampler.all_invocations();
    dev.shutdown().await;

    let accounting = verdict::account(&db, ledger, drained).await?;
    let targets = verdict::targets(&args, &minutes, &emf);
    let load_after = load_average();
    let summary = json!({
        "generated_at": chrono::Utc::now().to_rfc3339(),
        "mode": if args.quick { "quick" } else { "full" },
        "settings": {
            "rate_per_sec": args.rate,
            "minutes": args.minutes,
            "minute_secs": args.minute_secs,
            "retention_minutes": args.retention_minutes,
            "ordered_share": args.ordered_share,
            "ordered_keys": args.ordered_keys,
            "unordered_keys": args.unordered_keys,
            "producers": args.producers,
            "relays": args.relays,
            "invocation_secs": args.invocation_secs,
            "long_transaction_at": args.long_transaction_at,
            "long_transaction_minutes": args.long_transaction_at.map(|_| args.long_transaction_minutes),
            "relay_settings": "the relay's code defaults (delivery evidence from callbacks, batches of 500, delivery batch 50, 8 cycles, 15 s lease, 500 ms poll), retention aside",
        },
        "machine": machine,
        "autovacuum": autovacuum,
        "load_after": load_after,
        "duration_secs": started.elapsed().as_secs_f64(),
        "produced_secs": produced_secs,
        "drain_secs": drain_secs,
        "per_minute": minutes,
        "invocations": emf.len(),
        "accounting": accounting,
        "targets": targets,
    });
    let path = args.out.join("sustained.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    println!("{}", report::text(&summary));
    println!(
        "BENCH_JSON {}",
        serde_json::to_string(&report::compact(&summary))?
    );
    println!("wrote {} and {}", lines_path.display(), path.display());
    if let Some(dir) = &args.report {
        let written = report::write(dir, &summary)?;
        for p in written {
            println!("wrote {}", p.display());
        }
    }
    db.close().await;
    Ok(summary)
}

/// Restarts workers that exited by themselves (a relay whose invocation failed on a connection keeps looping;
/// a process exit is a crash, logged in its file).
fn restart_exited(spawner: &Spawner, workers: &mut [Worker]) {
    for w in workers {
        let exited = match w.child.as_mut().map(|c| c.try_wait()) {
            Some(Ok(Some(_))) | Some(Err(_)) => true,
            Some(Ok(None)) | None => false,
        };
        if exited {
            eprintln!(
                "sustained: a {:?} worker exited by itself; restarting it (see its log)",
                w.kind
            );
            if let Err(e) = spawner.spawn(w) {
                eprintln!("sustained: restarting a worker failed: {e:#}");
            }
        }
    }
}

/// A connection holding a `REPEATABLE READ` snapshot (it read the outbox): nothing deleted after it started can
/// be vacuumed away until it ends.
async fn pin_horizon(url: &str) -> anyhow::Result<sqlx::PgConnection> {
    use sqlx::Connection;
    let opts: PgConnectOptions = url.parse()?;
    let mut c =
        sqlx::PgConnection::connect_with(&opts.application_name("sustained-long-transaction"))
            .await?;
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut c)
        .await?;
    sqlx::query(outbox::schema::q(
        "SELECT count(*) FROM (SELECT 1 FROM {schema}.outbox LIMIT 1) s",
    ))
    .execute(&mut c)
    .await?;
    Ok(c)
}

/// The server's autovacuum settings, as `SHOW` prints them (the report says how autovacuum ran).
async fn autovacuum_settings(db: &PgPool) -> anyhow::Result<Vec<(String, String)>> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, setting || coalesce(unit, '') FROM pg_settings \
         WHERE name LIKE 'autovacuum%' OR name IN ('vacuum_cost_limit', 'vacuum_cost_delay', 'maintenance_work_mem') \
         ORDER BY name",
    )
    .fetch_all(db)
    .await?;
    Ok(rows)
}

/// A producer task: takes its share of the rate, 1 to 3 events per transaction, and returns the outbox ids it
/// committed (the ledger the accounting checks against).
async fn produce(
    db: PgPool,
    args: SustainedArgs,
    index: usize,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    started: Instant,
) -> anyhow::Result<Vec<i64>> {
    let mut rng = StdRng::seed_from_u64(args.seed.wrapping_mul(7919).wrapping_add(index as u64));
    let share = args.rate / args.producers as f64;
    let mut ledger = Vec::new();
    let mut written = 0u64;
    let mut n = index as u64;
    while !stop.load(Ordering::Relaxed) {
        let batch = rng.random_range(1..=3u64);
        // Pace: this task's event `written` is due at written / share seconds after the start.
        let due = started + Duration::from_secs_f64(written as f64 / share);
        tokio::time::sleep_until(due.into()).await;
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let events: Vec<(bool, String, u64)> = (0..batch)
            .map(|_| {
                n += args.producers as u64;
                if rng.random_bool(args.ordered_share) {
                    (
                        true,
                        format!("k{}", rng.random_range(0..args.ordered_keys)),
                        n,
                    )
                } else {
                    (
                        false,
                        format!("u{}", rng.random_range(0..args.unordered_keys)),
                        n,
                    )
                }
            })
            .collect();
        let mut tries = 0u32;
        let ids = loop {
            match write(&db, &events).await {
                Ok(ids) => break ids,
                Err(e) => {
                    tries += 1;
                    if tries >= 20 {
                        return Err(e.context("a producer transaction failed 20 times"));
                    }
                    eprintln!("sustained: a producer transaction failed (retrying): {e:#}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        written += ids.len() as u64;
        shared
            .produced
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        ledger.extend(ids);
    }
    Ok(ledger)
}

async fn write(db: &PgPool, events: &[(bool, String, u64)]) -> anyhow::Result<Vec<i64>> {
    let mut tx = db.begin().await?;
    let mut ids = Vec::with_capacity(events.len());
    for (ordered, key, n) in events {
        let topic = if *ordered { &ORDERED } else { &UNORDERED };
        let event = outbox::NewEvent::new(
            topic,
            key.clone(),
            &SoakPayload {
                n: *n,
                ..SoakPayload::default()
            },
        )?;
        ids.push(outbox::enqueue(&mut tx, event).await?.id.get());
    }
    tx.commit().await?;
    Ok(ids)
}
