//! Benchmark plumbing: scratch databases, the dev server and the relay as child processes.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use outbox_cli::util::connect;
use outbox_testkit::db::with_database;
use outbox_testkit::ports::wait_listening;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::process::{Child, Command};

/// The relay settings a benchmark point varies.
#[derive(Clone, Copy, Debug)]
pub struct Knobs {
    /// Rows per claim (`RELAY_BATCH_SIZE`).
    pub batch: u32,
    /// Cycles in flight (`RELAY_CONCURRENCY`).
    pub concurrency: u32,
    /// Messages per `/v2/batch` request (`QSTASH_BATCH_SIZE`).
    pub qstash_batch: u32,
}

/// A scratch database, dropped on `drop_now`. Its name carries the process id, so two benchmark runs (or a run
/// and the report test) never drop each other's database.
pub struct ScratchDb {
    admin: PgPool,
    pub name: String,
    pub url: String,
    pub pool: PgPool,
}

impl ScratchDb {
    /// Empties every table a pipeline run writes (events, keys, sequences, dead letters, dedupe rows,
    /// subscribers): the next run starts from nothing.
    pub async fn empty_pipeline_tables(&self) -> anyhow::Result<()> {
        sqlx::query(
            "TRUNCATE outbox, outbox_keys, outbox_sequences, dead_letters, processed_messages, \
             consumer_sequences, outbox_subscribers",
        )
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn create(base_url: &str, name: &str) -> anyhow::Result<ScratchDb> {
        let name = &format!("{name}_{}", std::process::id());
        let admin = connect(base_url).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )))
        .execute(&admin)
        .await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&admin)
            .await
            .context("creating the benchmark database (the DATABASE_URL user needs CREATEDB)")?;
        let opts: PgConnectOptions = base_url.parse().context("DATABASE_URL")?;
        let opts = opts.database(name);
        let url = with_database(base_url, name);
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect_with(opts)
            .await?;
        outbox::MIGRATOR.run(&pool).await?;
        Ok(ScratchDb {
            admin,
            name: name.to_owned(),
            url,
            pool,
        })
    }

    pub async fn drop_now(self) -> anyhow::Result<()> {
        self.pool.close().await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .execute(&self.admin)
        .await?;
        Ok(())
    }
}

/// A sibling binary of this executable: `qstash-dev` (package qstash-dev) or `outbox` (package outbox-cli).
/// `cargo build --release -p qstash-dev -p outbox-cli -p outbox-devtools` puts them together. A test binary
/// lives one level down (`target/debug/deps/`), so the parent directory is tried too.
pub fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("executable has no directory")?;
    let mut p = dir.join(name);
    if !p.exists()
        && let Some(up) = dir.parent()
        && up.join(name).exists()
    {
        p = up.join(name);
    }
    if !p.exists() {
        let package = if name == "outbox" { "outbox-cli" } else { name };
        bail!(
            "{} not found: build it first (cargo build --release -p {package})",
            p.display()
        );
    }
    Ok(p)
}

/// The dev server running as its own process, so the relay's memory and CPU are measured alone.
pub struct DevServerProcess {
    child: Child,
    pub url: String,
}

impl DevServerProcess {
    /// Starts it on a port it binds itself (0: the kernel picks one, read back from `/proc`,
    /// `outbox_testkit::ports`).
    pub async fn start(extra: &[&str]) -> anyhow::Result<DevServerProcess> {
        let mut child = Command::new(sibling("qstash-dev")?)
            .args(["--port", "0"])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("starting qstash-dev")?;
        let pid = child.id().context("qstash-dev exited at once")?;
        let port = wait_listening("qstash-dev", pid, Duration::from_secs(20), || {
            child.try_wait().ok().flatten().map(|s| s.to_string())
        })
        .await?;
        Ok(DevServerProcess {
            child,
            url: format!("http://127.0.0.1:{port}"),
        })
    }

    /// CPU seconds the dev server has used so far.
    pub fn cpu_secs(&self) -> Option<f64> {
        self.child.id().and_then(cpu_secs)
    }

    /// The dev server's counters (`GET /__dev/stats`: messages accepted, deliveries attempted, ...).
    pub async fn stats(&self) -> anyhow::Result<serde_json::Value> {
        outbox::install_crypto_provider();
        let v = reqwest::Client::new()
            .get(format!("{}/__dev/stats", self.url))
            .bearer_auth(qstash_dev::DEV_TOKEN)
            .send()
            .await
            .context("reading the dev server's stats")?
            .error_for_status()?
            .json()
            .await?;
        Ok(v)
    }

    /// Messages the dev server has accepted so far (QStash messages published; duplicates and callbacks not
    /// counted).
    pub async fn accepted(&self) -> anyhow::Result<u64> {
        self.stats().await?["accepted"]
            .as_u64()
            .context("the dev server's stats have no `accepted` counter")
    }

    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// The machine a report ran on, read at run time: the figures mean little without it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub memory_gib: f64,
    pub kernel: String,
    pub postgres_version: String,
    /// Postgres settings that move these figures, as `SHOW` prints them.
    pub postgres_settings: Vec<(String, String)>,
    /// `/proc/loadavg`'s 1, 5 and 15 minute load averages.
    pub load_before: [f64; 3],
}

/// The settings that decide commit cost and cache size.
const SETTINGS: &[&str] = &[
    "synchronous_commit",
    "fsync",
    "full_page_writes",
    "shared_buffers",
    "wal_level",
    "max_wal_size",
    "checkpoint_timeout",
    "max_connections",
    "autovacuum",
];

/// The sum of two clock-tick fields of `/proc/<process>/stat`, in seconds (USER_HZ is 100 on Linux); `fields`
/// count from the first field after the command name (in parentheses, and it may hold spaces).
fn stat_secs(process: &str, fields: [usize; 2]) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{process}/stat")).ok()?;
    let f: Vec<&str> = s.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok());
    Some((ticks(fields[0])? + ticks(fields[1])?) / 100.0)
}

/// CPU seconds (user + system: `utime`, `stime`) process `pid` has used so far: the dev server's, or this
/// process's (the receivers and clients of a scenario run here).
pub fn cpu_secs(pid: u32) -> Option<f64> {
    stat_secs(&pid.to_string(), [11, 12])
}

/// CPU seconds (user + system: `cutime`, `cstime`) used by this process's children that have ended and been
/// waited for: the difference across one child's run is that child's CPU (the relay child's, which ends
/// before it is read).
pub fn reaped_children_cpu_secs() -> Option<f64> {
    stat_secs("self", [13, 14])
}

/// A load average triple from a report's JSON as `1.20 / 0.90 / 0.70`.
pub fn load_text(v: &serde_json::Value) -> String {
    let parts: Vec<String> = v
        .as_array()
        .map(|a| {
            a.iter()
                .map(|x| format!("{:.2}", x.as_f64().unwrap_or(f64::NAN)))
                .collect()
        })
        .unwrap_or_default();
    parts.join(" / ")
}

/// The three load averages of `/proc/loadavg` (zeros where unreadable).
pub fn load_average() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut out = [0.0; 3];
    for (slot, v) in out.iter_mut().zip(text.split_whitespace()) {
        *slot = v.parse().unwrap_or(0.0);
    }
    out
}

impl Machine {
    pub async fn read(pool: &PgPool) -> anyhow::Result<Machine> {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .map(|v| v.trim_start_matches([' ', '\t', ':']).trim().to_owned())
            .unwrap_or_else(|| "unknown".into());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let mem_kib: f64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0.0);
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|_| std::env::consts::OS.to_owned());
        let postgres_version: String = sqlx::query_scalar("SELECT version()")
            .fetch_one(pool)
            .await?;
        let mut postgres_settings = Vec::new();
        for name in SETTINGS {
            let v: String = sqlx::query_scalar("SELECT current_setting($1)")
                .bind(name)
                .fetch_one(pool)
                .await?;
            postgres_settings.push(((*name).to_owned(), v));
        }
        Ok(Machine {
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            cpu_model,
            memory_gib: mem_kib / 1024.0 / 1024.0,
            kernel,
            postgres_version,
            postgres_settings,
            load_before: load_average(),
        })
    }
}

/// The relay built in this process from the Lambda's configuration variables (the same `RelayState::from_env`
/// the function runs), publishing to `qstash_url`: for scenarios that time its steps one by one or stop it on
/// cue. `extra` adds or overrides variables.
pub async fn in_process_relay(
    db_url: &str,
    qstash_url: &str,
    knobs: Knobs,
    extra: &[(&str, String)],
) -> anyhow::Result<outbox::relay::Relay> {
    let mut env: std::collections::HashMap<String, String> = [
        ("DATABASE_URL", db_url.to_owned()),
        ("QSTASH_URL", qstash_url.to_owned()),
        ("QSTASH_TOKEN", qstash_dev::DEV_TOKEN.to_owned()),
        // The dev server's public token: the relay refuses it without this opt-in.
        ("OUTBOX_ALLOW_DEV_KEYS", "true".to_owned()),
        ("CONSUMER_URL", "http://127.0.0.1:9".to_owned()),
        ("CALLBACK_URL", "http://127.0.0.1:9".to_owned()),
        ("RELAY_BATCH_SIZE", knobs.batch.to_string()),
        ("RELAY_CONCURRENCY", knobs.concurrency.to_string()),
        ("QSTASH_BATCH_SIZE", knobs.qstash_batch.to_string()),
        ("RELAY_POLL_INTERVAL_MS", "20".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    for (k, v) in extra {
        env.insert((*k).to_owned(), v.clone());
    }
    let state = outbox::internals::handler::RelayState::from_env(std::sync::Arc::new(env))
        .await
        .context("relay configuration")?;
    Ok(state.relay)
}

/// `md` with the block from `begin` to `end` replaced by `section` (appended when `md` has none; `md` unchanged
/// when `section` is empty): how `benchmarks.md` keeps the sections other commands write.
pub fn splice_section(md: &str, begin: &str, end: &str, section: &str) -> String {
    if section.is_empty() {
        return md.to_owned();
    }
    let found = md
        .find(begin)
        .and_then(|b| md[b..].find(end).map(|e| (b, b + e)));
    match found {
        Some((b, e)) => format!("{}{}{}", &md[..b], section.trim_end(), &md[e + end.len()..]),
        None => format!("{}\n\n{}\n", md.trim_end(), section.trim_end()),
    }
}

/// Stores `run` under `key` in `dir/benchmarks/figures.json` and rewrites the section of `dir/benchmarks.md` from
/// `begin` to `end` with what `section` makes of the figures: how the scenarios that run on their own (fan-out,
/// sustained load, cost) keep their part of the report while `bench report` keeps the rest.
pub fn write_section(
    dir: &std::path::Path,
    key: &str,
    run: &serde_json::Value,
    section: impl Fn(&serde_json::Value) -> String,
    [begin, end]: [&str; 2],
) -> anyhow::Result<Vec<PathBuf>> {
    let json_path = dir.join("benchmarks").join("figures.json");
    let mut figures: serde_json::Value = match std::fs::read_to_string(&json_path) {
        Ok(text) => serde_json::from_str(&text)
            .with_context(|| format!("reading {}", json_path.display()))?,
        Err(_) => serde_json::Value::Object(Default::default()),
    };
    let Some(object) = figures.as_object_mut() else {
        bail!("{} is not a JSON object", json_path.display());
    };
    object.insert(key.to_owned(), run.clone());
    std::fs::create_dir_all(dir.join("benchmarks"))?;
    std::fs::write(&json_path, serde_json::to_string_pretty(&figures)? + "\n")?;
    let md_path = dir.join("benchmarks.md");
    let md = std::fs::read_to_string(&md_path).unwrap_or_else(|_| "# Benchmarks\n".to_owned());
    std::fs::write(
        &md_path,
        splice_section(&md, begin, end, &section(&figures)),
    )?;
    Ok(vec![json_path, md_path])
}

/// `text` with what lies between `begin` and `end` replaced by `block`; `None` when it has no such block, an error
/// when it is unterminated or there are two: how a page quotes generated figures (the README's blocks).
pub fn with_block_between(
    text: &str,
    [begin, end]: [&str; 2],
    block: &str,
) -> anyhow::Result<Option<String>> {
    let Some(start) = text.find(begin) else {
        return Ok(None);
    };
    let inner = start + begin.len();
    let stop = text[inner..]
        .find(end)
        .map(|i| inner + i)
        .with_context(|| format!("{begin} without {end}"))?;
    if text[stop + end.len()..].contains(begin) {
        bail!("more than one {begin} block");
    }
    Ok(Some(format!("{}{block}{}", &text[..inner], &text[stop..])))
}
