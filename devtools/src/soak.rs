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

pub mod worker;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Parser};
use outbox::consumer::{Event, Handler, HandlerError, Registry};
use outbox::{NewEvent, Topic};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool};
use tokio::process::{Child, Command};

use outbox_cli::util::connect;
use outbox_testkit::db::with_database;

/// The soak's ordered topic (dead heads are skipped: `RELAY_SKIP_DEAD_HEAD_TOPICS`).
pub const ORDERED: Topic = Topic::ordered("soak_ordered");
/// The soak's unordered topic.
pub const UNORDERED: Topic = Topic::unordered("soak_unordered");
/// What the consumer's handler answers a poison event (the dead letter's recognisable reason).
pub const POISON_REASON: &str = "soak poison event";

/// Arguments of `outbox-dev soak`.
#[derive(Args, Debug, Clone)]
pub struct SoakArgs {
    /// Postgres server; the soak runs in a fresh database (--database) on it, dropped first if it exists.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub database_url: String,
    /// Name of the soak's database (dropped and created).
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

/// A dead-letter reason and how many events ended with it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Reason {
    /// Whether these are the soak's poison events.
    pub poison: bool,
    /// The dead letters' error, normalised ([`reason_of`]): alike failures count together.
    pub reason: String,
    /// Distinct events.
    pub count: i64,
}

/// At most this many characters of one reason ([`reason_of`]).
pub const REASON_CHARS: usize = 50;
/// At most this many reasons in the summary line ([`SoakReport::line`]; the JSON keeps them all).
pub const LINE_REASONS: usize = 2;

/// What a soak ended with.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SoakReport {
    /// Events in the outbox (committed by the producers).
    pub enqueued: i64,
    /// Poison events among them.
    pub poison: i64,
    /// Events the consumer applied exactly once.
    pub applied_once: i64,
    /// Events dead-lettered (and not applied), poison ones.
    pub dead_lettered_poison: i64,
    /// Events dead-lettered (and not applied) that were not poison.
    pub dead_lettered_other: i64,
    /// Their outbox ids: the unexpected dead letters.
    pub unexpected_dead_letters: Vec<i64>,
    /// The events the dev server's DLQ says QStash gave up on after faults, not applied and not poison
    /// (`outbox_testkit::given_up`): the unexpected dead letters must be exactly these.
    pub explained_dead_letters: Vec<i64>,
    /// Something in the run can exhaust QStash's retries (delivery faults, killed receivers, terminated
    /// backends); without it no unexpected dead letter is allowed at all.
    pub retries_exhaustible: bool,
    /// The dead letters' reasons.
    pub dead_letter_reasons: Vec<Reason>,
    /// Events applied more than once (must be 0).
    pub applied_twice: i64,
    /// Poison events applied (must be 0).
    pub poison_applied: i64,
    /// Events neither applied nor dead-lettered (must be 0).
    pub lost: i64,
    /// Ordered-topic applications whose sequence is not above the key's previous one (must be 0).
    pub order_violations: i64,
    /// Outbox rows and keys still leased, or events still pending, at the end (must be 0).
    pub left_leased: i64,
    pub relay_kills: u64,
    pub consumer_kills: u64,
    pub callback_kills: u64,
    /// Postgres backends terminated (relay, consumer and callback connections).
    pub backend_kills: u64,
    /// Worker processes started again (after a kill, or after exiting by themselves).
    pub restarts: u64,
    /// Workers that exited without being killed (restarted too).
    pub worker_exits: u64,
    pub pg_restarts: u64,
    pub outage_secs: u64,
    /// The pipeline drained before the timeout.
    pub drained: bool,
    pub seconds: f64,
    pub seed: u64,
    /// Every must-be-zero figure is zero and the unexpected dead letters are within their bound
    /// ([`SoakReport::dead_letter_bound`]).
    pub ok: bool,
}

impl SoakReport {
    /// The unexpected dead letters against their bound: none when nothing could exhaust QStash's retries, else
    /// exactly the events the dev server's DLQ explains. `Err` names the events on either side.
    pub fn dead_letter_bound(&self) -> Result<(), String> {
        outbox_testkit::given_up::check_unexpected_dead_letters(
            &self.unexpected_dead_letters.iter().copied().collect(),
            &self.explained_dead_letters.iter().copied().collect(),
            self.retries_exhaustible,
        )
    }

    /// Sets [`SoakReport::ok`]: drained, every must-be-zero figure zero, the dead letters within their bound.
    pub fn judge(&mut self) {
        self.ok = self.drained
            && self.applied_twice == 0
            && self.lost == 0
            && self.order_violations == 0
            && self.left_leased == 0
            && self.poison_applied == 0
            && self.dead_letter_bound().is_ok();
    }

    /// The one summary line: short whatever the dead letters say (the non-poison reasons only, at most
    /// [`LINE_REASONS`] of them, each normalised and capped by [`reason_of`]).
    pub fn line(&self) -> String {
        let other: Vec<&Reason> = self
            .dead_letter_reasons
            .iter()
            .filter(|r| !r.poison)
            .collect();
        let mut reasons: Vec<String> = other
            .iter()
            .take(LINE_REASONS)
            .map(|r| format!("{}× \"{}\"", r.count, r.reason))
            .collect();
        if other.len() > LINE_REASONS {
            reasons.push(format!("+{} more", other.len() - LINE_REASONS));
        }
        let explained = if self.dead_lettered_other > 0 || !self.explained_dead_letters.is_empty() {
            format!(", DLQ explains {}", self.explained_dead_letters.len())
        } else {
            String::new()
        };
        format!(
            "soak {}: enqueued {}, applied once {}, dead-lettered {} (poison {}, other {}{explained}{}{}), applied \
             twice {}, lost {}, order violations {}, left leased {}, poison applied {}, relay kills {}, consumer \
             kills {}, callback kills {}, backend kills {}, restarts {}, worker exits {}, pg restarts {}, outage {} \
             s, drained {}, {:.0} s, seed {}",
            if self.ok { "OK" } else { "FAILED" },
            self.enqueued,
            self.applied_once,
            self.dead_lettered_poison + self.dead_lettered_other,
            self.dead_lettered_poison,
            self.dead_lettered_other,
            if reasons.is_empty() { "" } else { ": " },
            reasons.join("; "),
            self.applied_twice,
            self.lost,
            self.order_violations,
            self.left_leased,
            self.poison_applied,
            self.relay_kills,
            self.consumer_kills,
            self.callback_kills,
            self.backend_kills,
            self.restarts,
            self.worker_exits,
            self.pg_restarts,
            self.outage_secs,
            self.drained,
            self.seconds,
            self.seed,
        )
    }
}

/// A dead letter's reason as the soak groups it: its `error` (for an event of a batch, the message's status and
/// the consumer's words about that event), plus what the consumer said about this event in its response
/// (`events[]` entry with its outbox id; the top-level `error` of a response without that list) when the error
/// does not say it already; then normalised — cut before any JSON (`{` or `[`), runs of digits as `N`, the
/// library's fixed wording shortened (`last status N: soak poison event`), one printable line of at most
/// [`REASON_CHARS`] characters — so that alike failures count together and the summary stays short whatever the
/// reasons say.
pub fn reason_of(error: &str, response_body: Option<&str>, outbox_id: i64) -> String {
    let said: Option<String> = response_body
        .and_then(|b| serde_json::from_str::<serde_json::Value>(b).ok())
        .and_then(|v| match v.get("events").and_then(|e| e.as_array()) {
            Some(list) => list
                .iter()
                .find(|e| e.get("id").and_then(|i| i.as_i64()) == Some(outbox_id))
                .and_then(|e| e.get("error"))
                .and_then(|e| e.as_str())
                .map(str::to_owned),
            None => v.get("error").and_then(|e| e.as_str()).map(str::to_owned),
        });
    let mut text = error.to_owned();
    if let Some(said) = said.filter(|s| !s.trim().is_empty() && !error.contains(s.as_str())) {
        text.push_str(CONSUMER_SAID);
        text.push_str(&said);
    }
    if let Some(json) = text.find(['{', '[']) {
        text.truncate(json);
    }
    let text = crate::dev::dead_letters::generalise(text.trim_end_matches([' ', ':', ';', ',']))
        // The library's wording, shortened: the words that tell failures apart fit in the cap.
        .replace("QStash gave up after N attempt(s); ", "")
        .replace(CONSUMER_SAID, ": ")
        .replace("; the consumer said about this event: ", ": ");
    outbox_cli::util::one_line(&text, REASON_CHARS)
}

const CONSUMER_SAID: &str = "; the consumer said: ";

/// A soak event's payload.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SoakPayload {
    /// The producer's number of this event.
    pub n: u64,
    /// The consumer rejects it as permanent.
    pub poison: bool,
}

/// The consumer's handler: records the application (no unique constraint: a double apply shows) or rejects a
/// poison event as permanent.
pub struct Apply;

impl Handler<SoakPayload> for Apply {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        event: &Event<SoakPayload>,
    ) -> Result<(), HandlerError> {
        if event.payload.poison {
            return Err(HandlerError::permanent(POISON_REASON));
        }
        event.statements.query(
            "INSERT INTO soak_applied (outbox_id, topic, partition_key, seq, n) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(event.meta.outbox_id)
        .bind(&event.meta.topic)
        .bind(event.meta.key.as_deref())
        .bind(event.meta.seq)
        .bind(event.payload.n as i64)
        .execute(conn)
        .await?;
        Ok(())
    }
}

/// The soak consumer's topics.
pub fn registry() -> Registry {
    Registry::new()
        .on(ORDERED.name(), Apply)
        .on(UNORDERED.name(), Apply)
}

const SOAK_TABLE: &str = "CREATE TABLE soak_applied (
    ord           bigserial   PRIMARY KEY,   -- application order (commit order is close enough per key: one key's
                                              -- events are applied one after the other)
    outbox_id     bigint      NOT NULL,      -- no unique constraint: a double apply must be visible
    topic         text        NOT NULL,
    partition_key text,
    seq           bigint,
    n             bigint      NOT NULL,
    applied_at    timestamptz NOT NULL DEFAULT now()
)";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Relay,
    Consumer,
    Callback,
}

impl Kind {
    fn app_name(self) -> &'static str {
        match self {
            Kind::Relay => "soak-relay",
            Kind::Consumer => "soak-consumer",
            Kind::Callback => "soak-callback",
        }
    }
}

/// One worker process and how to start it again.
struct Worker {
    kind: Kind,
    index: usize,
    port: Option<u16>,
    child: Option<Child>,
}

/// Everything a worker needs to start.
struct Spawner {
    exe: PathBuf,
    env: Vec<(String, String)>,
    log_dir: PathBuf,
}

impl Spawner {
    fn spawn(&self, w: &mut Worker) -> anyhow::Result<()> {
        let mut cmd = Command::new(&self.exe);
        cmd.arg("soak-worker");
        match (w.kind, w.port) {
            (Kind::Relay, _) => cmd.args(["relay", "--invocation-secs", "30"]),
            (Kind::Consumer, Some(p)) => cmd
                .args(["consumer", "--port", &p.to_string()])
                .env("PUBLIC_BASE_URL", format!("http://127.0.0.1:{p}")),
            (Kind::Callback, Some(p)) => cmd
                .args(["callback", "--port", &p.to_string()])
                .env("PUBLIC_BASE_URL", format!("http://127.0.0.1:{p}")),
            _ => anyhow::bail!("a receiver needs a port"),
        };
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        let name = format!("{}-{}", w.kind.app_name(), w.index);
        cmd.env("DB_APPLICATION_NAME", &name);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_dir.join(format!("{name}.log")))
            .context("opening a worker log")?;
        cmd.stdout(log.try_clone()?)
            .stderr(log)
            .stdin(std::process::Stdio::null());
        cmd.kill_on_drop(true);
        w.child = Some(cmd.spawn().with_context(|| format!("starting {name}"))?);
        Ok(())
    }
}

async fn kill(w: &mut Worker) {
    if let Some(mut c) = w.child.take() {
        let _ = c.start_kill(); // SIGKILL
        let _ = c.wait().await;
    }
}

/// Counters shared by the chaos loop and the report.
#[derive(Default)]
struct Counts {
    relay_kills: AtomicU64,
    consumer_kills: AtomicU64,
    callback_kills: AtomicU64,
    backend_kills: AtomicU64,
    restarts: AtomicU64,
    worker_exits: AtomicU64,
    pg_restarts: AtomicU64,
    written: AtomicU64,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

async fn wait_listening(port: u16, timeout: Duration) -> anyhow::Result<()> {
    let until = Instant::now() + timeout;
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        anyhow::ensure!(
            Instant::now() < until,
            "no worker listening on port {port} after {timeout:?} (see the worker logs)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

fn default_log_dir() -> PathBuf {
    let file = crate::dev::logs::default_path();
    let parent = file.parent().map(PathBuf::from).unwrap_or_default();
    parent.join(format!(
        "soak-{}-{}",
        chrono::Utc::now().format("%Y%m%dT%H%M%SZ"),
        std::process::id()
    ))
}

/// A pool that survives Postgres restarts and terminated backends (connections are checked before use).
fn pool(url: &str, name: &str, max: u32) -> anyhow::Result<PgPool> {
    let opts: PgConnectOptions = url.parse().context("DATABASE_URL")?;
    Ok(PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .test_before_acquire(true)
        .connect_lazy_with(opts.application_name(name)))
}

/// Sets `name` in `env` unless the process environment has it (the caller's relay settings pass through).
fn default_env(env: &mut Vec<(String, String)>, name: &str, value: &str) {
    if std::env::var_os(name).is_none() {
        env.push((name.to_owned(), value.to_owned()));
    }
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
    let admin = connect(&args.database_url).await?;
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
    let url = with_database(&args.database_url, &args.database);
    let db = pool(&url, "soak-producer", (args.producers + 4) as u32)?;
    outbox::migrate(&db, outbox::schema::current())
        .await
        .context("applying the outbox migrations")?;
    create_table(&db).await?;

    // The dev server, faults on, seeded.
    let mut dev_cfg = qstash_dev::Config {
        port: 0,
        seed: args.seed,
        time_scale: 0.05,
        waitlist_order: qstash_dev::WaitlistOrder::Shuffled,
        // Shorter than the relays' evidence timeout (20 s below): when an ordered head's delivery callback is
        // lost, the relay republishes it after that timeout with the same deduplication id, and within the
        // window QStash would swallow the republish — the key would wait out the whole window (10 min).
        dedup_window: Duration::from_secs(10),
        ..qstash_dev::Config::default()
    };
    let faults = qstash_dev::Faults {
        publish_5xx_rate: 0.10,
        publish_drop_response_rate: 0.05,
        duplicate_delivery_rate: 0.10,
        delivery_network_error_rate: 0.05,
        ..Default::default()
    };
    dev_cfg.faults = faults.clone();
    let dev = qstash_dev::DevServer::start(dev_cfg)
        .await
        .map_err(|e| anyhow::anyhow!("starting the QStash dev server: {e}"))?;
    let keys = dev.signing_keys();

    // The workers.
    let log_dir = args.log_dir.clone().unwrap_or_else(default_log_dir);
    std::fs::create_dir_all(&log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
    let consumer_port = free_port()?;
    let callback_port = free_port()?;
    let consumer_url = format!("http://127.0.0.1:{consumer_port}");
    let callback_url = format!("http://127.0.0.1:{callback_port}");
    let mut env: Vec<(String, String)> = vec![
        ("DATABASE_URL".into(), url.clone()),
        ("QSTASH_URL".into(), dev.url()),
        ("QSTASH_TOKEN".into(), dev.token().to_owned()),
        ("QSTASH_CURRENT_SIGNING_KEY".into(), keys.current.clone()),
        ("QSTASH_NEXT_SIGNING_KEY".into(), keys.next.clone()),
        // The dev server's public keys and token: the workers (the functions' own setup) refuse them without it.
        ("OUTBOX_ALLOW_DEV_KEYS".into(), "true".into()),
        ("CONSUMER_URL".into(), consumer_url.clone()),
        ("CALLBACK_URL".into(), callback_url.clone()),
        ("CONSUMER_NAME".into(), "soak".into()),
        (
            "RELAY_SKIP_DEAD_HEAD_TOPICS".into(),
            ORDERED.name().to_owned(),
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
        ("RELAY_BACKOFF_BASE_SECS", "0.5"),
        ("RELAY_BACKOFF_CAP_SECS", "10"),
        ("RELAY_OUTAGE_PROBE_BASE_MS", "200"),
        ("RELAY_OUTAGE_PROBE_CAP_SECS", "2"),
        ("QSTASH_RETRIES", "3"),
        ("RUST_LOG", "warn"),
    ] {
        default_env(&mut env, k, v);
    }
    let spawner = Spawner {
        exe: match &args.worker_exe {
            Some(p) => p.clone(),
            None => std::env::current_exe().context("finding this executable")?,
        },
        env,
        log_dir: log_dir.clone(),
    };
    let mut workers: Vec<Worker> = (0..args.relays)
        .map(|i| Worker {
            kind: Kind::Relay,
            index: i,
            port: None,
            child: None,
        })
        .collect();
    workers.push(Worker {
        kind: Kind::Consumer,
        index: 0,
        port: Some(consumer_port),
        child: None,
    });
    workers.push(Worker {
        kind: Kind::Callback,
        index: 0,
        port: Some(callback_port),
        child: None,
    });
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
    let drain_until = Instant::now() + Duration::from_secs(args.drain_timeout_secs);
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
        eprintln!(
            "soak: NOT drained after {} s: counting what is there (the run fails)",
            args.drain_timeout_secs
        );
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

fn chaos_pause(rng: &mut StdRng, mean_ms: u64) -> Duration {
    let mean = mean_ms.max(1) as f64;
    Duration::from_millis(rng.random_range(mean * 0.5..=mean * 1.5) as u64)
}

/// Restarts workers that exited by themselves.
async fn supervise(spawner: &Spawner, workers: &mut [Worker], counts: &Counts) {
    for w in workers.iter_mut() {
        let exited = match w.child.as_mut().map(|c| c.try_wait()) {
            Some(Ok(Some(_))) | Some(Err(_)) | None => true,
            Some(Ok(None)) => false,
        };
        if exited {
            counts.worker_exits.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = spawner.spawn(w) {
                eprintln!("soak: restarting a worker failed: {e:#}");
            } else {
                counts.restarts.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// One chaos action, chosen at random: SIGKILL a relay, the consumer or the callback receiver (and start it
/// again), or terminate the relays' or the receivers' Postgres backends.
async fn chaos(
    rng: &mut StdRng,
    spawner: &Spawner,
    workers: &mut [Worker],
    db: &PgPool,
    counts: &Counts,
) {
    let roll = rng.random_range(0..8u32);
    let kind = match roll {
        0..=2 => Some(Kind::Relay),
        3 | 4 => Some(Kind::Consumer),
        5 => Some(Kind::Callback),
        _ => None,
    };
    match kind {
        Some(kind) => {
            let candidates: Vec<usize> = (0..workers.len())
                .filter(|&i| workers[i].kind == kind)
                .collect();
            let i = candidates[rng.random_range(0..candidates.len())];
            let w = &mut workers[i];
            kill(w).await;
            match kind {
                Kind::Relay => &counts.relay_kills,
                Kind::Consumer => &counts.consumer_kills,
                Kind::Callback => &counts.callback_kills,
            }
            .fetch_add(1, Ordering::Relaxed);
            // The receivers stay down a moment (QStash retries meanwhile); a relay comes back at once, and its
            // killed claims wait for their lease to end.
            if kind != Kind::Relay {
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..300))).await;
            }
            match spawner.spawn(w) {
                Ok(()) => {
                    counts.restarts.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => eprintln!("soak: restarting a worker failed: {e:#}"),
            }
        }
        None => {
            let pattern = if roll == 6 { "soak-relay%" } else { "soak-c%" };
            let killed: Result<i64, _> = sqlx::query_scalar(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE datname = current_database() AND application_name LIKE $1 AND pid <> pg_backend_pid()",
            )
            .bind(pattern)
            .fetch_one(db)
            .await;
            match killed {
                Ok(n) => {
                    counts.backend_kills.fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(e) => eprintln!("soak: pg_terminate_backend failed: {e}"),
            }
        }
    }
}

/// A producer task: takes the next event numbers, writes 1 to 3 events per transaction through the library's
/// producer API, paced to its share of `--rate`. A failed transaction is retried (a commit whose answer was lost
/// may have written its events: the report counts what the outbox holds).
async fn produce(
    db: PgPool,
    args: SoakArgs,
    index: usize,
    next: Arc<AtomicU64>,
    counts: Arc<Counts>,
    started: Instant,
) {
    let mut rng = StdRng::seed_from_u64(args.seed.wrapping_mul(1000).wrapping_add(index as u64));
    loop {
        let batch = rng.random_range(1..=3u64);
        let first = next.fetch_add(batch, Ordering::SeqCst);
        if first >= args.events {
            return;
        }
        let last = (first + batch).min(args.events);
        let events: Vec<(u64, bool, String)> = (first..last)
            .map(|n| {
                (
                    n,
                    args.poison_every > 0 && n % args.poison_every == args.poison_every - 1,
                    format!("k{}", rng.random_range(0..args.keys)),
                )
            })
            .collect();
        // Pace: event `first` is due at first / rate seconds after the start.
        let due = started + Duration::from_secs_f64(first as f64 / args.rate);
        tokio::time::sleep_until(due.into()).await;
        let mut tries = 0u32;
        loop {
            match write(&db, &events).await {
                Ok(()) => break,
                Err(e) => {
                    tries += 1;
                    if tries % 10 == 1 {
                        eprintln!("soak: a producer transaction failed (retrying): {e:#}");
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        counts
            .written
            .fetch_add(events.len() as u64, Ordering::Relaxed);
    }
}

async fn write(db: &PgPool, events: &[(u64, bool, String)]) -> anyhow::Result<()> {
    let mut tx = db.begin().await?;
    for (n, poison, key) in events {
        let topic = if n % 2 == 0 { &ORDERED } else { &UNORDERED };
        let event = NewEvent::new(
            topic,
            key.clone(),
            &SoakPayload {
                n: *n,
                poison: *poison,
            },
        )?;
        outbox::enqueue(&mut tx, event).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Whether anything is pending, awaiting evidence, or leased in the outbox.
async fn busy(db: &PgPool) -> anyhow::Result<bool> {
    Ok(sqlx::query_scalar(outbox::schema::q(
        "SELECT EXISTS (SELECT 1 FROM {schema}.outbox WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL) \
         OR EXISTS (SELECT 1 FROM {schema}.outbox_keys WHERE inflight_id IS NOT NULL)",
    ))
    .fetch_one(db)
    .await?)
}

async fn progress(
    db: &PgPool,
    counts: &Counts,
    dev: &qstash_dev::Handle,
    started: Instant,
    state: &str,
) {
    let figures: Result<(i64, i64, i64, i64), _> = sqlx::query_as(outbox::schema::q(
        "SELECT (SELECT count(*) FROM {schema}.outbox), \
                (SELECT count(*) FROM {schema}.outbox WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL), \
                (SELECT count(*) FROM soak_applied), \
                (SELECT count(*) FROM {schema}.dead_letters)",
    ))
    .fetch_one(db)
    .await;
    match figures {
        Ok((enqueued, pending, applied, dead)) => eprintln!(
            "soak: {:>5.0} s {state}: enqueued {enqueued}, pending {pending}, applied {applied}, dead letters {dead}, \
             relay kills {}, consumer kills {}, callback kills {}, backend kills {}, qstash attempts {}",
            started.elapsed().as_secs_f64(),
            counts.relay_kills.load(Ordering::Relaxed),
            counts.consumer_kills.load(Ordering::Relaxed),
            counts.callback_kills.load(Ordering::Relaxed),
            counts.backend_kills.load(Ordering::Relaxed),
            dev.stats().attempts,
        ),
        Err(e) => eprintln!("soak: progress query failed: {e}"),
    }
}

/// Counts every event's fate from the database ([`verdict`]), retrying while Postgres comes back from a restart.
async fn account(db: &PgPool) -> anyhow::Result<SoakReport> {
    let mut tries = 0;
    loop {
        match verdict(db).await {
            Ok(r) => return Ok(r),
            // Postgres may still be coming back from a restart.
            Err(e) if tries < 20 => {
                tries += 1;
                eprintln!("soak: counting failed (retrying): {e:#}");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Creates the soak consumer's table, `soak_applied` (in a database the library's migrations ran on).
pub async fn create_table(db: &PgPool) -> anyhow::Result<()> {
    sqlx::query(SOAK_TABLE).execute(db).await?;
    Ok(())
}

/// The soak's verdict on a database (the library's tables and `soak_applied`, [`create_table`]): every figure of
/// [`SoakReport`] that the database holds — enqueued, poison, applied once and twice, poison applied,
/// dead-lettered (poison, other, the unexpected events' ids, the reasons), lost, order violations, left leased —
/// in one transaction. The rest (kills, the dead letters the dev server explains, `ok`) is the caller's.
pub async fn verdict(db: &PgPool) -> anyhow::Result<SoakReport> {
    let mut tx = db.begin().await?;
    sqlx::query(outbox::schema::q(
        "CREATE TEMP TABLE soak_fate ON COMMIT DROP AS
         SELECT o.id, o.topic, coalesce((o.payload->>'poison')::boolean, false) AS poison,
                coalesce(a.applied, 0) AS applied,
                EXISTS (SELECT 1 FROM {schema}.dead_letters d WHERE d.outbox_id = o.id) AS dead
           FROM {schema}.outbox o
           LEFT JOIN (SELECT outbox_id, count(*) AS applied FROM soak_applied GROUP BY 1) a ON a.outbox_id = o.id
          WHERE o.topic IN ('soak_ordered', 'soak_unordered')",
    ))
    .execute(&mut *tx)
    .await?;
    let (enqueued, poison, once, twice, poison_applied, dead_poison, dead_other, lost): (
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
    ) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE poison),
                count(*) FILTER (WHERE applied = 1), count(*) FILTER (WHERE applied > 1),
                count(*) FILTER (WHERE poison AND applied > 0),
                count(*) FILTER (WHERE dead AND applied = 0 AND poison),
                count(*) FILTER (WHERE dead AND applied = 0 AND NOT poison),
                count(*) FILTER (WHERE NOT dead AND applied = 0)
           FROM soak_fate",
    )
    .fetch_one(&mut *tx)
    .await?;
    let unexpected: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM soak_fate WHERE dead AND applied = 0 AND NOT poison ORDER BY id",
    )
    .fetch_all(&mut *tx)
    .await?;
    let dead_letters: Vec<(bool, i64, String, Option<String>)> = sqlx::query_as(outbox::schema::q(
        "SELECT f.poison, f.id, d.error, d.response_body
           FROM soak_fate f JOIN {schema}.dead_letters d ON d.outbox_id = f.id
          WHERE f.applied = 0",
    ))
    .fetch_all(&mut *tx)
    .await?;
    // Ordered topic: in application order, each key's sequence must rise (a skipped dead head is just absent).
    let violations: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (
             SELECT seq, lag(seq) OVER (PARTITION BY partition_key ORDER BY ord) AS prev
               FROM soak_applied WHERE topic = 'soak_ordered') s
          WHERE prev IS NOT NULL AND seq <= prev",
    )
    .fetch_one(&mut *tx)
    .await?;
    let leased: i64 = sqlx::query_scalar(outbox::schema::q(
        "SELECT (SELECT count(*) FROM {schema}.outbox
                  WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL)
              + (SELECT count(*) FROM {schema}.outbox_keys
                  WHERE locked_until > now() OR inflight_id IS NOT NULL)",
    ))
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    // Grouped by normalised reason, counting distinct events (an event may carry several dead letters).
    let mut merged: BTreeMap<(bool, String), std::collections::BTreeSet<i64>> = BTreeMap::new();
    for (poison, id, error, response_body) in dead_letters {
        merged
            .entry((poison, reason_of(&error, response_body.as_deref(), id)))
            .or_default()
            .insert(id);
    }
    let mut dead_letter_reasons: Vec<Reason> = merged
        .into_iter()
        .map(|((poison, reason), ids)| Reason {
            poison,
            reason,
            count: ids.len() as i64,
        })
        .collect();
    dead_letter_reasons.sort_by_key(|r| std::cmp::Reverse(r.count));
    Ok(SoakReport {
        enqueued,
        poison,
        applied_once: once,
        applied_twice: twice,
        poison_applied,
        dead_lettered_poison: dead_poison,
        dead_lettered_other: dead_other,
        unexpected_dead_letters: unexpected,
        dead_letter_reasons,
        lost,
        order_violations: violations,
        left_leased: leased,
        ..SoakReport::default()
    })
}

/// The events the dev server's DLQ (`dlq`, its own record) says QStash gave up on after faults, less the ones the
/// soak's consumer applied (`soak_applied`) and the poison ones: what [`SoakReport::explained_dead_letters`]
/// holds (`outbox_testkit::given_up`).
pub async fn explained_dead_letters(
    db: &PgPool,
    dlq: &[qstash_dev::DlqEntryInfo],
) -> anyhow::Result<Vec<i64>> {
    let given_up = outbox_testkit::given_up::given_up(dlq);
    let ids: Vec<i64> = given_up
        .iter()
        .flat_map(|m| m.events.iter().copied())
        .collect();
    let applied: std::collections::BTreeSet<i64> =
        sqlx::query_scalar("SELECT DISTINCT outbox_id FROM soak_applied WHERE outbox_id = ANY($1)")
            .bind(&ids)
            .fetch_all(db)
            .await?
            .into_iter()
            .collect();
    let poison: std::collections::BTreeSet<i64> = sqlx::query_scalar(outbox::schema::q(
        "SELECT id FROM {schema}.outbox WHERE id = ANY($1) AND coalesce((payload->>'poison')::boolean, false)",
    ))
    .bind(&ids)
    .fetch_all(db)
    .await?
    .into_iter()
    .collect();
    Ok(outbox_testkit::given_up::explained_dead_letters(
        &given_up,
        |id| applied.contains(&id),
        |id| poison.contains(&id),
    )
    .into_iter()
    .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reason_is_the_events_own_words_without_ids_or_json() {
        // The soak's own case: a batch member's error, and the consumer's whole response in response_body.
        let body = r#"{"error":"event 10400: soak poison event","events":[{"id":10398,"outcome":"processed"},{"id":10400,"outcome":"failed","error":"soak poison event"}],"status":"partial"}"#;
        let batch_error = "QStash gave up after 1 attempt(s); last status 489; the consumer said about this event: \
                           soak poison event";
        assert_eq!(
            reason_of(batch_error, Some(body), 10400),
            "last status N: soak poison event"
        );
        // One event per message: the error has no consumer words; its own verdict is added.
        let single = r#"{"error":"database error: pool timed out","events":[{"id":7,"outcome":"retry","error":"database error: pool timed out"}]}"#;
        assert_eq!(
            reason_of(
                "QStash gave up after 4 attempt(s); last status 503",
                Some(single),
                7
            ),
            "last status N: database error: pool timed out"
        );
        assert_eq!(
            reason_of(
                "QStash gave up after 4 attempt(s); no response (network errors or timeouts)",
                Some(""),
                7
            ),
            "no response (network errors or timeouts)"
        );
        // Another event's verdict is never taken; JSON in an error is cut.
        assert_eq!(
            reason_of("last status 503", Some(single), 8),
            "last status N"
        );
        assert_eq!(reason_of("boom: {\"a\":[1,2,3]}", None, 1), "boom");
    }

    #[test]
    fn the_summary_line_stays_short_whatever_the_reasons_say() {
        let long = "x".repeat(10_000);
        // A full run's magnitudes (20,000 events, a thousand kills, an hour), fifty different long reasons.
        let mut report = SoakReport {
            enqueued: 20_000,
            applied_once: 19_000,
            dead_lettered_poison: 400,
            dead_lettered_other: 600,
            explained_dead_letters: vec![1; 600],
            relay_kills: 1_000,
            consumer_kills: 1_000,
            callback_kills: 1_000,
            backend_kills: 10_000,
            restarts: 3_000,
            seconds: 3_600.0,
            seed: 12_345,
            ..SoakReport::default()
        };
        report.dead_letter_reasons = (0..50i64)
            .map(|i| Reason {
                poison: i % 2 == 0,
                reason: reason_of(&format!("{long} {i} {{\"events\":[]}}"), Some(&long), i),
                count: 100 - i,
            })
            .collect();
        let line = report.line();
        assert!(
            line.chars().count() < 500,
            "{} chars: {line}",
            line.chars().count()
        );
        assert!(line.contains("+23 more"), "{line}");
        assert!(!line.contains('\n'));
    }
}
