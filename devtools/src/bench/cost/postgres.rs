//! What a run costs Postgres: CPU seconds of the benchmark database's backends and the WAL its transactions wrote.
//!
//! CPU: every 200 ms the backends connected to the database (`pg_stat_activity`) and their user + system CPU from
//! `/proc/<pid>/stat` (Postgres on this machine); a backend's CPU since the first sample, or since it started when
//! it started during the run. Background processes (WAL writer, checkpointer, autovacuum launcher) serve every
//! database and are not counted; a backend that ends between two samples loses at most 200 ms of its CPU.
//!
//! WAL: the records between the run's first and last LSN (`pg_walinspect`, a temporary physical replication slot
//! keeps them) that touch a block of this database or belong to a transaction that does, so other databases'
//! traffic on a shared server is left out; beside it the whole server's `pg_current_wal_lsn()` difference.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{Value, json};
use sqlx::{Connection, PgConnection, PgPool};

use crate::bench::support::cpu_secs;

/// A run's Postgres measurement, started before the traffic and finished after it.
pub struct PgMeter {
    pool: PgPool,
    /// Holds the temporary replication slot (none: the WAL may be recycled before it is read).
    slot: Option<PgConnection>,
    start_lsn: String,
    walinspect: bool,
    stop: tokio::sync::watch::Sender<bool>,
    sampler: tokio::task::JoinHandle<HashMap<i32, (f64, f64)>>,
}

/// The backends of the pool's database and their CPU seconds so far (`None`: not readable here).
async fn backends(pool: &PgPool) -> Vec<(i32, Option<f64>)> {
    let pids: Vec<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND backend_type = 'client backend'",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    pids.into_iter().map(|p| (p, cpu_secs(p as u32))).collect()
}

impl PgMeter {
    pub async fn start(pool: &PgPool, url: &str) -> anyhow::Result<PgMeter> {
        let walinspect = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            .execute(pool)
            .await
            .is_ok();
        let mut slot = PgConnection::connect(url).await?;
        let reserved = sqlx::query(
            "SELECT pg_create_physical_replication_slot('outbox_bench_cost_' || pg_backend_pid(), true, true)",
        )
        .execute(&mut slot)
        .await
        .is_ok();
        let start_lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(pool)
            .await?;
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let first = backends(pool).await;
        let sampling = pool.clone();
        let sampler = tokio::spawn(async move {
            // pid → (CPU at the first sample or 0 for a backend that started later, CPU at the last sample).
            let mut seen: HashMap<i32, (f64, f64)> = first
                .into_iter()
                .filter_map(|(p, c)| c.map(|c| (p, (c, c))))
                .collect();
            loop {
                let done = tokio::time::timeout(Duration::from_millis(200), stopped.changed())
                    .await
                    .is_ok();
                for (pid, cpu) in backends(&sampling).await {
                    if let Some(c) = cpu {
                        seen.entry(pid).or_insert((0.0, c)).1 = c;
                    }
                }
                if done {
                    return seen;
                }
            }
        });
        Ok(PgMeter {
            pool: pool.clone(),
            slot: reserved.then_some(slot),
            start_lsn,
            walinspect,
            stop,
            sampler,
        })
    }

    /// Ends the measurement: CPU seconds, WAL bytes of this database and of the whole server, and the methods.
    pub async fn finish(self) -> anyhow::Result<Value> {
        let _ = self.stop.send(true);
        let seen = self.sampler.await?;
        let cpu = (!seen.is_empty()).then(|| seen.values().map(|(a, b)| b - a).sum::<f64>());
        let end_lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(&self.pool)
            .await?;
        let server_wal: i64 =
            sqlx::query_scalar("SELECT pg_wal_lsn_diff($2::pg_lsn, $1::pg_lsn)::int8")
                .bind(&self.start_lsn)
                .bind(&end_lsn)
                .fetch_one(&self.pool)
                .await?;
        let db_wal: Option<i64> = if self.walinspect && self.slot.is_some() {
            sqlx::query_scalar(
                "WITH r AS (SELECT xid::text AS x, record_length, block_ref \
                            FROM pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn)), \
                      db AS (SELECT '%/' || oid || '/%' AS pattern FROM pg_database \
                             WHERE datname = current_database()), \
                      ours AS (SELECT DISTINCT x FROM r, db WHERE x <> '0' AND r.block_ref LIKE db.pattern) \
                 SELECT coalesce(sum(record_length), 0)::int8 FROM r, db \
                 WHERE r.block_ref LIKE db.pattern OR r.x IN (SELECT x FROM ours)",
            )
            .bind(&self.start_lsn)
            .bind(&end_lsn)
            .fetch_one(&self.pool)
            .await
            .ok()
        } else {
            None
        };
        if let Some(slot) = self.slot {
            let _ = slot.close().await;
        }
        Ok(json!({
            "cpu_secs": cpu,
            "backends": seen.len(),
            // pg_walinspect may be missing or refused (a concurrent `CREATE EXTENSION`, no replication slot left):
            // then the whole server's difference, and `wal_method` says so.
            "wal_bytes": db_wal.unwrap_or(server_wal),
            "server_wal_bytes": server_wal,
            "wal_method": if db_wal.is_some() { "pg_walinspect, this database's records" }
                          else { "the whole server's LSN difference" },
        }))
    }
}
