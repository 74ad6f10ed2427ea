//! Small shared helpers: database arguments, migrations, peak memory.

use anyhow::Context;
use clap::Args;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// Where the database is.
#[derive(Args, Debug, Clone)]
pub struct DbArgs {
    /// Postgres URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub database_url: String,
}

/// A small pool for CLI work.
pub async fn connect(url: &str) -> anyhow::Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(std::time::Duration::from_secs(10))
        .connect(url)
        .await
        .with_context(|| {
            "cannot connect to Postgres (is it running, and is DATABASE_URL right?)".to_string()
        })
}

/// `outbox migrate`.
pub async fn migrate(args: &DbArgs) -> anyhow::Result<()> {
    let pool = connect(&args.database_url).await?;
    outbox::MIGRATOR
        .run(&pool)
        .await
        .context("applying migrations")?;
    let rows: Vec<(i64, String)> = sqlx::query_as(
        "SELECT version, description FROM _sqlx_migrations WHERE success ORDER BY version",
    )
    .fetch_all(&pool)
    .await?;
    for (v, d) in &rows {
        println!("applied {v} {d}");
    }
    if let Some((v, _)) = rows.last() {
        println!("schema version {v} ({} migrations)", rows.len());
    }
    Ok(())
}

/// Peak resident set size of this process (VmHWM), in KiB.
pub fn peak_rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// Median of a slice (sorted copy).
pub fn median(v: &[f64]) -> f64 {
    percentile(v, 0.5)
}

/// Percentile by nearest rank on a sorted copy.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let i = ((s.len() - 1) as f64 * p).round() as usize;
    s[i]
}

/// CPU seconds (user + system) a process has used so far, from `/proc/<pid>/stat`.
pub fn cpu_secs(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which is in parentheses and may contain spaces).
    let rest = s.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0) // USER_HZ is 100 on Linux
}

/// `s` on one line (control characters become spaces), cut to `max` characters with an ellipsis.
pub fn one_line(s: &str, max: usize) -> String {
    let flat: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() <= max {
        flat
    } else {
        let mut t: String = flat.chars().take(max.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}
