//! Benchmark plumbing: scratch databases, the dev server and the relay as child processes.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox_cli::util::{connect, cpu_secs};
use outbox_testkit::db::with_database;
use outbox_testkit::free_port;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::process::{Child, Command};

/// A scratch database, dropped on `drop_now`.
pub struct ScratchDb {
    admin: PgPool,
    pub name: String,
    pub url: String,
    pub pool: PgPool,
}

impl ScratchDb {
    pub async fn create(base_url: &str, name: &str) -> anyhow::Result<ScratchDb> {
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
/// `cargo build --release -p qstash-dev -p outbox-cli -p outbox-devtools` puts them together.
pub fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let p = exe
        .parent()
        .context("executable has no directory")?
        .join(name);
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
    pub async fn start(extra: &[&str]) -> anyhow::Result<DevServerProcess> {
        let port = free_port();
        let child = Command::new(sibling("qstash-dev")?)
            .args(["--port", &port.to_string()])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("starting qstash-dev")?;
        let started = Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            if started.elapsed() > Duration::from_secs(20) {
                bail!("qstash-dev did not listen on {port}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(DevServerProcess {
            child,
            url: format!("http://127.0.0.1:{port}"),
        })
    }

    /// CPU seconds the dev server has used so far.
    pub fn cpu_secs(&self) -> Option<f64> {
        self.child.id().and_then(cpu_secs)
    }

    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}
