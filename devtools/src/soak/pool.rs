//! The soak's connection pools.

use std::time::Duration;

use anyhow::Context;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// A pool that survives Postgres restarts and terminated backends (connections are checked before use).
pub(crate) fn pool(url: &str, name: &str, max: u32) -> anyhow::Result<PgPool> {
    let opts: PgConnectOptions = url.parse().context("DATABASE_URL")?;
    Ok(PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .test_before_acquire(true)
        .connect_lazy_with(opts.application_name(name)))
}
