//! The schedule's faults, run from the explorer's main loop: SIGKILLs (the soak's [`kill`] and [`Spawner`]), a
//! worker kept down, a slow consumer, the dev server's faults for a while, terminated backends, a long producer
//! transaction, a real Postgres crash of the explorer's own cluster. Each is recorded in the history.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use sqlx::{Connection, PgPool};

use super::history::{History, Outcome, Record, Written};
use super::schedule::{DevFault, KEYS, Op, SUBSCRIBERS, TOPICS, Target};
use crate::soak::counts::Counts;
use crate::soak::supervisor::{Kind, Spawner, Worker, kill};

/// Crashes the explorer's Postgres cluster, one crash at a time (the faults' and the operator's).
pub struct Crasher {
    pg: Arc<outbox_testkit::pg_local::LocalPostgres>,
    /// A crash is under way (another one is refused).
    crashing: AtomicBool,
    history: Arc<Mutex<History>>,
}

impl Crasher {
    pub fn new(
        pg: Arc<outbox_testkit::pg_local::LocalPostgres>,
        history: Arc<Mutex<History>>,
    ) -> Crasher {
        Crasher {
            pg,
            crashing: AtomicBool::new(false),
            history,
        }
    }

    /// Whether Postgres is being crashed or started again.
    pub fn crashing(&self) -> bool {
        self.crashing.load(Ordering::SeqCst)
    }

    /// `after` from now, crashes Postgres and starts it again `down` later, in a task of its own, recorded as
    /// `what` (step `step`). False (and nothing done) when a crash is under way.
    pub fn crash(
        self: &Arc<Self>,
        step: usize,
        what: String,
        after: Duration,
        down: Duration,
    ) -> bool {
        if self.crashing.swap(true, Ordering::SeqCst) {
            return false;
        }
        let me = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let start = Utc::now();
            let outcome = crash(me.pg.clone(), down).await;
            me.crashing.store(false, Ordering::SeqCst);
            me.history
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .records
                .push(Record {
                    step: Some(step),
                    what,
                    kind: "postgres crash".into(),
                    start,
                    end: Utc::now(),
                    outcome,
                });
        });
        true
    }
}

/// What the faults share with the main loop.
pub struct Faults {
    pub base: qstash_dev::Faults,
    current: qstash_dev::Faults,
    /// Dev-server faults on, until when.
    active: Vec<(DevFault, Instant)>,
    pub dev: qstash_dev::Handle,
    pub db: PgPool,
    /// The application's database URL (a long transaction's own connection).
    pub app_url: String,
    /// The next event number (a long transaction writes an event).
    next_n: Arc<AtomicU64>,
    pub crasher: Arc<Crasher>,
    pub history: Arc<Mutex<History>>,
}

impl Faults {
    pub fn new(
        base: qstash_dev::Faults,
        dev: qstash_dev::Handle,
        db: PgPool,
        app_url: String,
        next_n: Arc<AtomicU64>,
        crasher: Arc<Crasher>,
        history: Arc<Mutex<History>>,
    ) -> Faults {
        Faults {
            current: base.clone(),
            base,
            active: Vec::new(),
            dev,
            db,
            app_url,
            next_n,
            crasher,
            history,
        }
    }

    /// Whether Postgres is being crashed or started again.
    pub fn crashing(&self) -> bool {
        self.crasher.crashing()
    }

    /// The dev server's faults as the active ones say (called every tick).
    pub fn tick(&mut self) {
        let now = Instant::now();
        self.active.retain(|(_, until)| *until > now);
        let mut f = self.base.clone();
        for (fault, _) in &self.active {
            match fault {
                DevFault::Outage => f.publish_5xx_rate = 1.0,
                DevFault::LoseMessages => f.message_loss_rate = 0.5,
                DevFault::DropPublishResponses => f.publish_drop_response_rate = 0.5,
                DevFault::LoseDeliveryResponses => f.delivery_lost_response_rate = 0.3,
            }
        }
        if f != self.current {
            match self.dev.set_faults(f.clone()) {
                Ok(()) => self.current = f,
                Err(e) => eprintln!("explore: setting the dev server's faults failed: {e}"),
            }
        }
    }

    /// Ends every dev-server fault now.
    pub fn calm(&mut self) {
        self.active.clear();
        self.tick();
    }

    fn record(
        history: &Mutex<History>,
        step: usize,
        op: &Op,
        start: chrono::DateTime<Utc>,
        outcome: Outcome,
    ) {
        history
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .records
            .push(Record {
                step: Some(step),
                what: op.to_string(),
                kind: op.kind(),
                start,
                end: Utc::now(),
                outcome,
            });
    }

    /// Runs fault `op` (step `step` of the schedule).
    pub async fn run(
        &mut self,
        step: usize,
        op: &Op,
        spawner: &Spawner,
        workers: &mut [Worker],
        counts: &Counts,
    ) {
        let start = Utc::now();
        let outcome = match op {
            Op::Kill(target) => {
                let Some(w) = worker(workers, *target) else {
                    return;
                };
                kill(w).await;
                count_kill(counts, w.kind);
                if w.kind != Kind::Relay {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                w.down_until = None;
                match spawner.spawn(w) {
                    Ok(()) => {
                        counts.restarts.fetch_add(1, Ordering::Relaxed);
                        Outcome::Done("killed and restarted".into())
                    }
                    Err(e) => Outcome::Failed(format!("restarting: {e:#}")),
                }
            }
            Op::Down { target, secs } => {
                let Some(w) = worker(workers, *target) else {
                    return;
                };
                kill(w).await;
                count_kill(counts, w.kind);
                w.down_until = Some(Instant::now() + Duration::from_secs_f64(*secs));
                Outcome::Done("killed; restarted later".into())
            }
            Op::Slow { sub, secs, ms } => {
                let (db, name, ms, secs) = (self.db.clone(), SUBSCRIBERS[*sub], *ms, *secs);
                tokio::spawn(async move {
                    set_slow(&db, name, ms).await;
                    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
                    set_slow(&db, name, 0).await;
                });
                Outcome::Done("slow".into())
            }
            Op::Dev { fault, secs } => {
                self.active
                    .push((*fault, Instant::now() + Duration::from_secs_f64(*secs)));
                self.tick();
                Outcome::Done("on".into())
            }
            Op::Backends { relays } => {
                let pattern = if *relays { "soak-relay%" } else { "soak-c%" };
                let killed: Result<i64, _> = sqlx::query_scalar(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
                     WHERE datname = current_database() AND application_name LIKE $1 AND pid <> pg_backend_pid()",
                )
                .bind(pattern)
                .fetch_one(&self.db)
                .await;
                match killed {
                    Ok(n) => {
                        counts.backend_kills.fetch_add(n as u64, Ordering::Relaxed);
                        Outcome::Done(format!("{n} backends terminated"))
                    }
                    Err(e) => Outcome::Failed(e.to_string()),
                }
            }
            Op::LongTransaction { secs, topic } => {
                let n = self.next_n.fetch_add(1, Ordering::SeqCst);
                let (url, secs, topic, history, op) = (
                    self.app_url.clone(),
                    *secs,
                    *topic,
                    self.history.clone(),
                    op.clone(),
                );
                tokio::spawn(async move {
                    let result = long_transaction(&url, secs, topic, n).await;
                    let end = Utc::now();
                    let mut h = history.lock().unwrap_or_else(|e| e.into_inner());
                    h.written.push(Written {
                        n,
                        topic,
                        key: LONG_KEY,
                        poison_for: Vec::new(),
                        delayed: false,
                        start,
                        end,
                        committed: match &result {
                            Ok(()) => Some(true),
                            Err(LongError::BeforeCommit(_)) => Some(false),
                            Err(LongError::Commit(_)) => None,
                        },
                    });
                    let outcome = match result {
                        Ok(()) => Outcome::Done(format!("event {n} committed")),
                        Err(LongError::BeforeCommit(e) | LongError::Commit(e)) => {
                            Outcome::Failed(e)
                        }
                    };
                    h.records.push(Record {
                        step: Some(step),
                        what: op.to_string(),
                        kind: op.kind(),
                        start,
                        end,
                        outcome,
                    });
                });
                return;
            }
            Op::PgCrash { down_secs } => {
                let down = Duration::from_secs_f64(*down_secs);
                if !self
                    .crasher
                    .crash(step, op.to_string(), Duration::ZERO, down)
                {
                    Outcome::Refused("a crash is under way".into())
                } else {
                    counts.pg_restarts.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
            _ => return,
        };
        Faults::record(&self.history, step, op, start, outcome);
    }
}

fn worker(workers: &mut [Worker], target: Target) -> Option<&mut Worker> {
    workers.iter_mut().find(|w| match target {
        Target::Relay(i) => w.kind == Kind::Relay && w.index == i,
        Target::Consumer(s) => w.kind == Kind::Consumer && w.index == s,
        Target::Callback => w.kind == Kind::Callback,
    })
}

fn count_kill(counts: &Counts, kind: Kind) {
    match kind {
        Kind::Relay => &counts.relay_kills,
        Kind::Consumer => &counts.consumer_kills,
        Kind::Callback => &counts.callback_kills,
    }
    .fetch_add(1, Ordering::Relaxed);
}

async fn set_slow(db: &PgPool, name: &str, ms: u32) {
    for _ in 0..30 {
        let r = sqlx::query(
            "INSERT INTO soak_control (name, value) VALUES ('slow:' || $1, $2) \
             ON CONFLICT (name) DO UPDATE SET value = excluded.value",
        )
        .bind(name)
        .bind(i64::from(ms))
        .execute(db)
        .await;
        if r.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The key of the long transactions' events, one no producer task uses: on an ordered topic a transaction holds
/// its key's sequence until it ends, and the producers' own keys should not wait for it.
const LONG_KEY: u32 = KEYS;

enum LongError {
    BeforeCommit(String),
    Commit(String),
}

/// A producer transaction, on a connection of its own, that writes event `n` (key [`LONG_KEY`] of `topic`) and commits
/// `secs` later: the xmin horizon stays where it was meanwhile, `subscribers add|remove` wait for it (if they can
/// see it), and its event must reach a subscriber added meanwhile by the copy its statement made or by the replay.
async fn long_transaction(url: &str, secs: f64, topic: usize, n: u64) -> Result<(), LongError> {
    let before = |e: sqlx::Error| LongError::BeforeCommit(e.to_string());
    let opts: sqlx::postgres::PgConnectOptions = url.parse().map_err(before)?;
    let mut conn =
        sqlx::PgConnection::connect_with(&opts.application_name("explore-long-transaction"))
            .await
            .map_err(before)?;
    let mut tx = conn.begin().await.map_err(before)?;
    let payload = crate::soak::SoakPayload {
        n,
        ..Default::default()
    };
    let event = outbox::NewEvent::new(&TOPICS[topic], format!("k{LONG_KEY}"), &payload)
        .map_err(|e| LongError::BeforeCommit(e.to_string()))?;
    outbox::enqueue(&mut tx, event)
        .await
        .map_err(|e| LongError::BeforeCommit(e.to_string()))?;
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    tx.commit()
        .await
        .map_err(|e| LongError::Commit(e.to_string()))
}

/// `pg_ctl stop -m immediate`, `down` of nothing, then `pg_ctl start` (crash recovery).
async fn crash(pg: Arc<outbox_testkit::pg_local::LocalPostgres>, down: Duration) -> Outcome {
    let p = pg.clone();
    let stopped = tokio::task::spawn_blocking(move || p.crash()).await;
    tokio::time::sleep(down).await;
    let mut last = None;
    for _ in 0..10 {
        let p = pg.clone();
        match tokio::task::spawn_blocking(move || p.start_again()).await {
            Ok(Ok(())) => {
                return match stopped {
                    Ok(Ok(())) => Outcome::Done("crashed and started again".into()),
                    Ok(Err(e)) => Outcome::Failed(format!("stop: {e:#}; started again")),
                    Err(e) => Outcome::Failed(format!("stop: {e}; started again")),
                };
            }
            Ok(Err(e)) => last = Some(format!("{e:#}")),
            Err(e) => last = Some(e.to_string()),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Outcome::Failed(format!(
        "Postgres did not start again: {}",
        last.unwrap_or_default()
    ))
}
