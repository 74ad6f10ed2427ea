//! `outbox-dev soak --schedule random --seed S --minutes M`: the schedule explorer (decision record 0070). From
//! the seed it draws a timeline ([`schedule`]) of traffic on four topics (ordered and unordered, bursts and
//! quiet, delayed and poison events), faults (SIGKILL of any worker, a consumer or the callback receiver down
//! for a while, a slow consumer, the dev server's outages and lost messages, responses and callbacks, terminated
//! backends, a long transaction pinning the xmin horizon, a real Postgres crash and restart) and operator
//! actions through the library calls the CLI makes ([`operator`]: subscribers added with and without `--from`,
//! removed, added again, replays interrupted and resumed, filtered redrives and purges, prune and partition
//! maintenance at a short retention, curing the poison). It runs the timeline over the soak's real components —
//! the dev server in process, relays, one consumer per subscriber and the callback receiver as processes
//! ([`super::worker`], [`super::supervisor`]) — on a Postgres cluster of its own (`outbox_testkit::pg_local`,
//! so that it may crash it), drains, and checks the history against what the run left ([`check`]). A violation
//! prints the seed, the schedule and the history of each event involved.
//!
//! | Rule | Why |
//! |---|---|
//! | The schedule is drawn in full from the seed before the run, and printed | Same seed, same schedule (the processes' timing aside): a failing seed is a regression case |
//! | A cluster of its own, `synchronous_commit = on` except where the library turns it off (the relay's pool) | A crash loses exactly what production would lose: the relay's last settles, never a producer's or a consumer's commit |
//! | One consumer process per subscriber, each recording its own applications (`soak_applied.subscriber`, the copy, the time) in its dedupe transaction | What each subscriber applied is read, not inferred |
//! | The checker reads the explorer's own history and the database's rows, never the library's accounting | A defect in the library cannot hide itself |
//! | Traffic stops at 85 % of the length; faults and actions go on; then every worker is up, actions are finished and the pipeline drains within a bound computed from the workers' settings | Every event ends with an outcome the checker can judge |

pub mod check;
mod console;
mod faults;
pub mod history;
pub mod kept;
mod operator;
mod retry;
pub mod schedule;
mod traffic;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, watch};

use super::app::create_table;
use super::args::SoakArgs;
use super::counts::Counts;
use super::dev_server::{TIME_SCALE, dev_server_config};
use super::pool::pool;
use super::supervisor::{
    Kind, Spawner, Worker, default_log_dir, kill, reserve_port, supervise, wait_listening,
};
use super::worker_env::{drain_bound, worker_env};
use check::{Checked, World};
use history::History;
use schedule::{INITIAL, Op, RELAYS, SKIP_DEAD_HEADS, SUBSCRIBERS, Schedule, TOPICS};

/// What an explorer run ended with.
#[derive(Debug, Serialize)]
pub struct ExploreReport {
    pub seed: u64,
    pub minutes: f64,
    /// Steps of the schedule by kind.
    pub drawn: std::collections::BTreeMap<String, u64>,
    /// Actions and faults as they ran, by kind: (done, refused, failed).
    pub ran: std::collections::BTreeMap<String, (u64, u64, u64)>,
    pub checked: Checked,
    /// Still unfinished when the drain began (replays, removals).
    pub unfinished: Vec<String>,
    pub drained: bool,
    pub seconds: f64,
    /// No violation.
    pub ok: bool,
    /// The violations' report (seed, schedule, events' histories); empty when ok.
    #[serde(skip)]
    pub details: String,
    /// What each Postgres crash overlapped: the operator's actions under way, or the drain after the traffic.
    pub crashes: Vec<String>,
}

impl ExploreReport {
    /// The one summary line.
    pub fn line(&self) -> String {
        let f = &self.checked.figures;
        let mut kinds: std::collections::BTreeMap<&str, usize> = Default::default();
        for v in &self.checked.violations {
            *kinds.entry(v.kind).or_default() += 1;
        }
        let actions: u64 = self.ran.values().map(|(d, r, x)| d + r + x).sum();
        format!(
            "explore {}: seed {}, {:.1} min, events {}, copies {}, applications {}, owed {} (applied {}, dead letter \
             {}, behind a dead head {}, purged {}), may {} (applied {}), actions and faults {}, violations {}{}, {:.0} s",
            if self.ok { "OK" } else { "FAILED" },
            self.seed,
            self.minutes,
            f.events,
            f.copies,
            f.applications,
            f.owed,
            f.owed_applied,
            f.owed_dead_letter,
            f.owed_pending_behind_dead_head,
            f.owed_purged,
            f.may,
            f.may_applied,
            actions,
            self.checked.violations.len(),
            if kinds.is_empty() {
                String::new()
            } else {
                format!(
                    " ({})",
                    kinds
                        .iter()
                        .map(|(k, n)| format!("{k}: {n}"))
                        .collect::<Vec<_>>()
                        .join("; ")
                )
            },
            self.seconds
        )
    }
}

enum ToOperator {
    Run(usize, Op),
    Finish(Duration, oneshot::Sender<Vec<String>>),
}

/// Runs the schedule of `args.seed` over `args.minutes`; the report says whether it found a violation.
pub async fn run(args: SoakArgs) -> anyhow::Result<ExploreReport> {
    let started = Instant::now();
    outbox::install_crypto_provider();
    let schema = outbox::schema::from_process_env()?;
    outbox::schema::install(&schema)?;
    anyhow::ensure!(
        args.minutes > 0.0 && args.minutes.is_finite(),
        "--minutes must be positive"
    );
    let length = Duration::from_secs_f64(args.minutes * 60.0);
    let schedule = Schedule::draw(args.seed, length);
    eprint!("{schedule}");

    // A cluster of our own (it will crash), durable commits except where the library turns them off.
    let pg_parent = std::env::temp_dir().join("outbox-explore-pg");
    let pg = Arc::new(
        tokio::task::spawn_blocking(move || {
            outbox_testkit::pg_local::LocalPostgres::start(&pg_parent)
        })
        .await
        .context("starting Postgres")??,
    );
    let admin = outbox_cli::util::connect(&pg.url()).await?;
    for sql in [
        "ALTER SYSTEM SET synchronous_commit = on",
        "SELECT pg_reload_conf()",
        // The roles the deployment docs describe: `outbox` owns the tables (it ran `outbox migrate`) and is what
        // the relays, the receivers and the operator connect as; the application writes events as a role of
        // its own. Neither is a superuser, nor may read other roles' activity.
        "CREATE ROLE outbox LOGIN",
        "CREATE ROLE explore_app LOGIN",
        "CREATE DATABASE explore OWNER outbox",
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&admin)
            .await?;
    }
    admin.close().await;
    let super_url = outbox_testkit::db::with_database(&pg.url(), "explore");
    let url = with_user(&super_url, "outbox")?;
    let app_url = with_user(&super_url, "explore_app")?;
    let owner = pool(&url, "explore-operator", 4)?;
    outbox::migrate(&owner, outbox::schema::current())
        .await
        .context("applying the outbox migrations")?;
    create_table(&owner).await?;
    for sql in [
        "GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA public TO explore_app",
        "GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO explore_app",
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&owner)
            .await?;
    }
    // The explorer's own reads and faults (pg_terminate_backend) as the superuser; the producers as the
    // application.
    let db = pool(&super_url, "explore", 4)?;
    let app_db = pool(&app_url, "explore-producer", 6)?;

    // The dev server, faults on, seeded.
    let (dev_cfg, base_faults) = dev_server_config(args.seed);
    let dev = qstash_dev::DevServer::start(dev_cfg)
        .await
        .map_err(|e| anyhow::anyhow!("starting the QStash dev server: {e}"))?;
    let dev_handle = dev.handle();

    // The workers: relays, a consumer per subscriber, the callback receiver.
    let log_dir = args.log_dir.clone().unwrap_or_else(default_log_dir);
    std::fs::create_dir_all(&log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
    // Each receiver's port is held by this process for the whole run (a killed receiver's port cannot be taken
    // meanwhile): the reservations live until the run ends.
    let reserved: Vec<outbox_testkit::ports::ReservedPort> = (0..SUBSCRIBERS.len())
        .map(|_| reserve_port())
        .collect::<Result<_, _>>()?;
    let ports: Vec<u16> = reserved.iter().map(|r| r.port()).collect();
    let urls: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let callback_reserved = reserve_port()?;
    let callback_port = callback_reserved.port();
    let mut env = worker_env(
        &url,
        &dev,
        &urls[0],
        &format!("http://127.0.0.1:{callback_port}"),
        &[TOPICS[SKIP_DEAD_HEADS].name()],
    );
    // A message the dev server lost is not published again by the reconciler: its event is dead ("unaccounted")
    // at once, so that a redrive and a second loss fit in a run.
    super::supervisor::default_env(&mut env, "RELAY_RECONCILE_MAX_REPUBLISH", "0");
    let spawner = Spawner::new(args.worker_exe.as_ref(), env, log_dir.clone(), 30)?;
    let topics = TOPICS
        .iter()
        .map(|t| t.name())
        .collect::<Vec<_>>()
        .join(",");
    let mut workers: Vec<Worker> = (0..RELAYS)
        .map(|i| Worker::new(Kind::Relay, i, None))
        .collect();
    for (i, name) in SUBSCRIBERS.iter().enumerate() {
        let mut w = Worker::new(Kind::Consumer, i, Some(ports[i]));
        w.env = vec![
            (
                "CONSUMER_NAME".into(),
                if name.is_empty() { "soak" } else { name }.to_owned(),
            ),
            ("SOAK_SUBSCRIBER".into(), (*name).to_owned()),
            ("SOAK_TOPICS".into(), topics.clone()),
        ];
        workers.push(w);
    }
    workers.push(Worker::new(Kind::Callback, 0, Some(callback_port)));

    // The subscribers at the start, before any traffic.
    let odb = outbox::db::Db::new(owner.clone(), outbox::db::Statements::Prepared);
    for (t, subs) in INITIAL.iter().enumerate() {
        for (s, on) in subs.iter().enumerate() {
            if *on && s > 0 {
                outbox::subscribers::add(
                    &odb,
                    TOPICS[t].name(),
                    SUBSCRIBERS[s],
                    Some(&urls[s]),
                    outbox::subscribers::Start::Now,
                    Duration::ZERO,
                )
                .await
                .context("adding the initial subscribers")?;
            }
        }
    }
    let history = Arc::new(Mutex::new(History::default()));
    {
        let mut h = history.lock().unwrap_or_else(|e| e.into_inner());
        for (t, subs) in INITIAL.iter().enumerate() {
            for (s, on) in subs.iter().enumerate() {
                if *on {
                    h.periods.push(history::Period {
                        topic: t,
                        sub: s,
                        add_start: None,
                        add_end: None,
                        replay: None,
                        removal: None,
                    });
                }
            }
        }
    }

    for w in &mut workers {
        spawner.spawn(w)?;
    }
    for p in ports.iter().chain([&callback_port]) {
        wait_listening(*p, Duration::from_secs(60)).await?;
    }
    eprintln!(
        "explore: seed {}, Postgres {} (its own cluster), dev server {}, {} relays, consumers {}, logs {}",
        args.seed,
        pg.url(),
        dev.url(),
        RELAYS,
        urls.join(" "),
        crate::dev::logs::display(&log_dir)
    );

    // Producers, the operator, the faults.
    let t0 = chrono::Utc::now();
    let counts = Counts::default();
    let next_n = Arc::new(AtomicU64::new(1));
    let (phase_tx, phase_rx) = watch::channel(traffic::Phase::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let producers: Vec<_> = (0..traffic::PRODUCERS)
        .map(|i| {
            tokio::spawn(traffic::produce(
                app_db.clone(),
                args.seed,
                i,
                phase_rx.clone(),
                next_n.clone(),
                history.clone(),
                stop_rx.clone(),
            ))
        })
        .collect();
    let (op_tx, mut op_rx) = mpsc::unbounded_channel::<ToOperator>();
    let crasher = Arc::new(faults::Crasher::new(pg.clone(), history.clone()));
    let mut operator = operator::Operator::new(
        owner.clone(),
        url.clone(),
        urls.clone(),
        history.clone(),
        next_n.clone(),
        crasher.clone(),
    );
    let operator_task = tokio::spawn(async move {
        loop {
            tokio::select! {
                msg = op_rx.recv() => match msg {
                    Some(ToOperator::Run(step, op)) => operator.run(step, &op).await,
                    Some(ToOperator::Finish(within, reply)) => {
                        let _ = reply.send(operator.finish(within).await);
                    }
                    None => return,
                },
                _ = tokio::time::sleep(Duration::from_secs(3)) => operator.follow_up().await,
            }
        }
    });
    let mut faults = faults::Faults::new(
        base_faults.clone(),
        dev_handle.clone(),
        db.clone(),
        app_url.clone(),
        next_n.clone(),
        crasher.clone(),
        history.clone(),
    );

    let begin = Instant::now();
    let mut next_step = 0;
    let mut next_progress = Instant::now() + Duration::from_secs(args.progress_secs.max(1));
    while begin.elapsed() < length || next_step < schedule.steps.len() {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if !faults.crashing() {
            supervise(&spawner, &mut workers, &counts).await;
        }
        faults.tick();
        while next_step < schedule.steps.len() && schedule.steps[next_step].at <= begin.elapsed() {
            let step = &schedule.steps[next_step];
            match &step.op {
                Op::Traffic {
                    rate,
                    poison,
                    delayed,
                } => {
                    let _ = phase_tx.send(traffic::Phase {
                        rate: *rate,
                        poison: *poison,
                        delayed: *delayed,
                    });
                }
                op if op.is_action() => {
                    let _ = op_tx.send(ToOperator::Run(next_step, op.clone()));
                }
                op => {
                    faults
                        .run(next_step, op, &spawner, &mut workers, &counts)
                        .await
                }
            }
            next_step += 1;
        }
        if Instant::now() >= next_progress {
            progress(&db, &history, started).await;
            next_progress = Instant::now() + Duration::from_secs(args.progress_secs.max(1));
        }
    }

    // The end: no more traffic or faults, every action finished, every worker up; then the drain.
    eprintln!("explore: schedule over; finishing the operator's work and draining");
    let _ = stop_tx.send(true);
    for p in producers {
        let _ = p.await;
    }
    faults.calm();
    while faults.crashing() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for w in &mut workers {
        w.down_until = None;
    }
    let _ = sqlx::query("DELETE FROM soak_control WHERE name LIKE 'slow:%'")
        .execute(&db)
        .await;
    let (reply_tx, mut reply_rx) = oneshot::channel();
    let _ = op_tx.send(ToOperator::Finish(Duration::from_secs(120), reply_tx));
    let unfinished = loop {
        tokio::select! {
            r = &mut reply_rx => break r.unwrap_or_default(),
            _ = tokio::time::sleep(Duration::from_millis(200)) => {
                supervise(&spawner, &mut workers, &counts).await;
            }
        }
    };
    drop(op_tx);
    let _ = operator_task.await;

    // Drained: nothing with work left (but what waits behind a dead head), the dev server idle, three times in a
    // row. Not drained: the bound from the workers' settings ran out, or nothing moved for longer than any of
    // the relays' own timers (evidence 20 s, reconciler 30 s plus an invocation) while the dev server was idle.
    let bound = drain_bound(&spawner, TIME_SCALE)?;
    let until = Instant::now() + bound;
    let mut quiet = 0;
    let mut last_state = None;
    let mut still_since = Instant::now();
    let drained = loop {
        supervise(&spawner, &mut workers, &counts).await;
        let dev_idle = dev_handle.is_idle();
        let idle = dev_idle && matches!(busy(&db).await, Ok(false));
        quiet = if idle { quiet + 1 } else { 0 };
        if quiet >= 3 {
            break true;
        }
        let state = drain_state(&db).await.ok();
        if state != last_state || !dev_idle {
            last_state = state;
            still_since = Instant::now();
        }
        if Instant::now() >= until || still_since.elapsed() >= STILL {
            break false;
        }
        if Instant::now() >= next_progress {
            progress(&db, &history, started).await;
            next_progress = Instant::now() + Duration::from_secs(args.progress_secs.max(1));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    for w in &mut workers {
        kill(w).await;
    }
    let dlq = dev_handle.dlq_entries();
    let lost = dev_handle.lost_messages();
    dev.shutdown().await;

    let mut world = World::read(&db).await?.with_dev_server(&dlq, lost);
    world.drained = drained;
    db.close().await;
    owner.close().await;
    app_db.close().await;
    let history = Arc::try_unwrap(history)
        .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()))
        .unwrap_or_else(|h| std::mem::take(&mut *h.lock().unwrap_or_else(|e| e.into_inner())));
    let checked = check::check(&history, &world);
    let mut ran: std::collections::BTreeMap<String, (u64, u64, u64)> = Default::default();
    for r in &history.records {
        let e = ran.entry(r.kind.clone()).or_default();
        match r.outcome {
            history::Outcome::Done(_) => e.0 += 1,
            history::Outcome::Refused(_) => e.1 += 1,
            history::Outcome::Failed(_) => e.2 += 1,
        }
    }
    let crashes = crash_overlaps(&schedule, &history, t0);
    for c in &crashes {
        eprintln!("explore: {c}");
    }
    let ok = checked.violations.is_empty();
    let details = if ok {
        String::new()
    } else {
        check::report(&schedule, &history, &world, &checked, t0, 5)
    };
    if let Some(path) = &args.json {
        let all =
            serde_json::json!({ "schedule": &schedule, "history": &history, "checked": &checked });
        std::fs::write(path, serde_json::to_string_pretty(&all)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    drop(pg);
    Ok(ExploreReport {
        seed: args.seed,
        minutes: args.minutes,
        drawn: schedule.counts(),
        ran,
        checked,
        unfinished,
        drained,
        seconds: started.elapsed().as_secs_f64(),
        ok,
        details,
        crashes,
    })
}

/// One line per Postgres crash that happened: when, and the operator's actions it overlapped (a replay, a
/// removal, a partition drop, …), or that it came after the traffic stopped (the drain).
fn crash_overlaps(
    schedule: &Schedule,
    history: &History,
    t0: chrono::DateTime<chrono::Utc>,
) -> Vec<String> {
    let rel = |t: chrono::DateTime<chrono::Utc>| (t - t0).num_milliseconds() as f64 / 1000.0;
    let traffic_end = schedule
        .steps
        .iter()
        .filter(|s| matches!(s.op, Op::Traffic { rate, .. } if rate > 0.0))
        .map(|s| s.at.as_secs_f64())
        .fold(0.0, f64::max);
    history
        .records
        .iter()
        .filter(|r| r.kind == "postgres crash" && matches!(r.outcome, history::Outcome::Done(_)))
        .map(|c| {
            let mut during: Vec<String> = history
                .records
                .iter()
                .filter(|a| a.kind != "postgres crash" && a.start < c.end && a.end > c.start)
                .filter(|a| {
                    schedule
                        .steps
                        .get(a.step.unwrap_or(usize::MAX))
                        .is_none_or(|s| s.op.is_action())
                })
                .map(|a| a.what.clone())
                .collect();
            if rel(c.start) > traffic_end {
                during.push("the drain after the traffic".into());
            }
            format!(
                "postgres crash {:.1}–{:.1} s, during: {}",
                rel(c.start),
                rel(c.end),
                if during.is_empty() {
                    "traffic".into()
                } else {
                    during.join("; ")
                }
            )
        })
        .collect()
}

/// How long the drain waits with nothing moving before it gives up (longer than the relays' evidence timeout and
/// the reconciler's wait plus an invocation).
const STILL: Duration = Duration::from_secs(90);

/// What moves while the pipeline drains: unfinished copies, applications, dead letters, lanes in flight.
async fn drain_state(db: &PgPool) -> Result<(i64, i64, i64, i64), sqlx::Error> {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox WHERE delivered_at IS NULL AND dead_lettered_at IS NULL), \
                (SELECT count(*) FROM soak_applied), (SELECT count(*) FROM dead_letters), \
                (SELECT count(*) FROM outbox_keys WHERE inflight_id IS NOT NULL)",
    )
    .fetch_one(db)
    .await
}

/// `url` with `user` as its user name.
fn with_user(url: &str, user: &str) -> anyhow::Result<String> {
    let mut u = url::Url::parse(url).context("the cluster's URL")?;
    u.set_username(user)
        .map_err(|()| anyhow::anyhow!("cannot set the user of {url}"))?;
    Ok(u.to_string())
}

/// Whether any copy still has work that is not held by a dead head of its lane: pending, leased or in flight,
/// or an ordered lane waits for evidence.
async fn busy(db: &PgPool) -> anyhow::Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM outbox o WHERE o.delivered_at IS NULL AND o.dead_lettered_at IS NULL \
                         AND NOT EXISTS (SELECT 1 FROM outbox_keys k WHERE k.topic = o.topic \
                                           AND k.partition_key = o.partition_key AND k.subscriber = o.subscriber \
                                           AND k.blocked_at IS NOT NULL)) \
             OR EXISTS (SELECT 1 FROM outbox_keys WHERE inflight_id IS NOT NULL)",
    )
    .fetch_one(db)
    .await?)
}

async fn progress(db: &PgPool, history: &Mutex<History>, started: Instant) {
    let figures: Result<(i64, i64, i64, i64), _> = sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox), \
                (SELECT count(*) FROM outbox WHERE delivered_at IS NULL AND dead_lettered_at IS NULL), \
                (SELECT count(*) FROM soak_applied), (SELECT count(*) FROM dead_letters)",
    )
    .fetch_one(db)
    .await;
    let (written, actions) = {
        let h = history.lock().unwrap_or_else(|e| e.into_inner());
        (h.written.len(), h.records.len())
    };
    match figures {
        Ok((copies, unfinished, applied, dead)) => eprintln!(
            "explore: {:>5.0} s: written {written}, copies {copies} ({unfinished} unfinished), applied {applied}, \
             dead letters {dead}, actions and faults {actions}",
            started.elapsed().as_secs_f64()
        ),
        Err(e) => eprintln!("explore: progress query failed: {e}"),
    }
}
