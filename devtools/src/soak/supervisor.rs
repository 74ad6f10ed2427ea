//! The worker processes from the supervising side: how each is started ([`Spawner`]: this executable's hidden
//! `soak-worker` command with the functions' environment, its output in a log file), restarted when it exits by
//! itself ([`supervise`]) and killed ([`kill`], SIGKILL).

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use outbox_testkit::ports::ReservedPort;
use tokio::process::{Child, Command};

use super::counts::Counts;

/// What a worker process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
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
pub(crate) struct Worker {
    pub(crate) kind: Kind,
    pub(crate) index: usize,
    pub(crate) port: Option<u16>,
    pub(crate) child: Option<Child>,
    /// Variables of its own, over the spawner's (the explorer's consumers: their subscriber's `CONSUMER_NAME`).
    pub(crate) env: Vec<(String, String)>,
    /// Kept down until then ([`supervise`] does not restart it before).
    pub(crate) down_until: Option<Instant>,
}

impl Worker {
    /// A worker not started yet.
    pub(crate) fn new(kind: Kind, index: usize, port: Option<u16>) -> Worker {
        Worker {
            kind,
            index,
            port,
            child: None,
            env: Vec::new(),
            down_until: None,
        }
    }
}

/// Everything a worker needs to start.
pub(crate) struct Spawner {
    pub(crate) exe: PathBuf,
    pub(crate) env: Vec<(String, String)>,
    pub(crate) log_dir: PathBuf,
    /// Length of each simulated relay invocation (`outbox relay --invocation-secs`).
    pub(crate) relay_invocation_secs: u64,
}

impl Spawner {
    /// Workers run `exe`, or this executable when `None` (tests pass the `outbox-dev` binary), each with `env`,
    /// logging into `log_dir`.
    pub(crate) fn new(
        exe: Option<&PathBuf>,
        env: Vec<(String, String)>,
        log_dir: PathBuf,
        relay_invocation_secs: u64,
    ) -> anyhow::Result<Spawner> {
        Ok(Spawner {
            exe: match exe {
                Some(p) => p.clone(),
                None => std::env::current_exe().context("finding this executable")?,
            },
            env,
            log_dir,
            relay_invocation_secs,
        })
    }

    pub(crate) fn spawn(&self, w: &mut Worker) -> anyhow::Result<()> {
        let mut cmd = Command::new(&self.exe);
        cmd.arg("soak-worker");
        match (w.kind, w.port) {
            (Kind::Relay, _) => cmd.args([
                "relay",
                "--invocation-secs",
                &self.relay_invocation_secs.to_string(),
            ]),
            (Kind::Consumer, Some(p)) => cmd
                .args(["consumer", "--port", &p.to_string()])
                .env("PUBLIC_BASE_URL", format!("http://127.0.0.1:{p}")),
            (Kind::Callback, Some(p)) => cmd
                .args(["callback", "--port", &p.to_string()])
                .env("PUBLIC_BASE_URL", format!("http://127.0.0.1:{p}")),
            _ => anyhow::bail!("a receiver needs a port"),
        };
        cmd.envs(self.env.iter().chain(&w.env).map(|(k, v)| (k, v)));
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

pub(crate) async fn kill(w: &mut Worker) {
    if let Some(mut c) = w.child.take() {
        let _ = c.start_kill(); // SIGKILL
        let _ = c.wait().await;
    }
}

/// Restarts workers that exited by themselves, and those kept down whose time is over.
pub(crate) async fn supervise(spawner: &Spawner, workers: &mut [Worker], counts: &Counts) {
    for w in workers.iter_mut() {
        if w.down_until.is_some_and(|t| Instant::now() < t) {
            continue;
        }
        if w.down_until.take().is_some() && w.child.is_none() {
            if let Err(e) = spawner.spawn(w) {
                eprintln!("soak: restarting a worker failed: {e:#}");
            } else {
                counts.restarts.fetch_add(1, Ordering::Relaxed);
            }
            continue;
        }
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

/// A receiver's port for the whole run, held by this process ([`ReservedPort`]): the receiver binds it beside the
/// held socket (`SO_REUSEPORT`, [`ReservedPort::listen`]), and while a killed one is down nobody else can take it —
/// connections are refused, as by a receiver that is down, and the next one gets the same port.
pub(crate) fn reserve_port() -> anyhow::Result<ReservedPort> {
    ReservedPort::new().context("reserving a receiver's port")
}

pub(crate) async fn wait_listening(port: u16, timeout: Duration) -> anyhow::Result<()> {
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

pub(crate) fn default_log_dir() -> PathBuf {
    let file = crate::dev::logs::default_path();
    let parent = file.parent().map(PathBuf::from).unwrap_or_default();
    parent.join(format!(
        "soak-{}-{}",
        chrono::Utc::now().format("%Y%m%dT%H%M%SZ"),
        std::process::id()
    ))
}

/// Sets `name` in `env` unless the process environment has it (the caller's relay settings pass through).
pub(crate) fn default_env(env: &mut Vec<(String, String)>, name: &str, value: &str) {
    if std::env::var_os(name).is_none() {
        env.push((name.to_owned(), value.to_owned()));
    }
}
