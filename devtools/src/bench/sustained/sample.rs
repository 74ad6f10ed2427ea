//! One minute of a sustained run ([`Minute`]) and how it is read ([`Sampler`]): from the database (counts,
//! latencies, sizes), from `/proc` (CPU of each process) and from the relays' EMF lines (claim latency).

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use anyhow::Context;
use outbox::internals::health::{DatabaseHealth, TableHealth};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::bench::support::{cpu_secs, load_average};
use crate::soak::supervisor::{Kind, Worker};

/// One table's figures at the end of a minute.
#[derive(Debug, Clone, Serialize)]
pub struct TableMinute {
    pub table: String,
    /// Table, indexes and TOAST.
    pub total_bytes: i64,
    pub index_bytes: i64,
    pub live_tuples: i64,
    pub dead_tuples: i64,
    /// Autovacuum runs on it so far.
    pub autovacuum_count: i64,
}

/// What one minute of the run did, and the database at its end.
#[derive(Debug, Clone, Serialize)]
pub struct Minute {
    pub minute: u32,
    /// Seconds since the producers started.
    pub at_secs: f64,
    /// Events committed by the producers in this minute.
    pub produced: u64,
    /// Events the relays marked dispatched in this minute (counted among the rows still in the table: with a
    /// retention window of a minute or less, some are gone before they are counted).
    pub dispatched: i64,
    /// Events the consumer applied in this minute.
    pub applied: i64,
    /// Median of the claim p50s of the relay invocations that ended in this minute (`ClaimLatencyP50`); `None`
    /// when none ended.
    pub claim_p50_ms: Option<f64>,
    /// Largest claim p99 of those invocations (`ClaimLatencyP99`, the dashboard's "worst run of the minute").
    pub claim_p99_ms: Option<f64>,
    /// Relay invocations that ended in this minute.
    pub invocations: usize,
    /// Rows their housekeeping deleted from `outbox` and from `processed_messages`.
    pub outbox_deleted: u64,
    pub processed_deleted: u64,
    /// Commit → applied of the events applied in this minute: the consumer transaction's start minus the
    /// producer transaction's (Postgres clocks).
    pub commit_to_applied_p50_ms: Option<f64>,
    pub commit_to_applied_p99_ms: Option<f64>,
    /// `outbox` table plus indexes (and TOAST), bytes.
    pub outbox_bytes: i64,
    pub tables: Vec<TableMinute>,
    /// The oldest open transaction in the database, seconds (what `OldestTransactionAge` reports).
    pub oldest_transaction_secs: f64,
    /// The long transaction was open during this minute.
    pub pinned: bool,
    /// CPU of each kind of process over this minute, in % of one core.
    pub relay_cpu_pct: f64,
    pub consumer_cpu_pct: f64,
    pub callback_cpu_pct: f64,
    pub postgres_cpu_pct: f64,
    /// This process: the producers and the dev server.
    pub bench_cpu_pct: f64,
    /// The machine's 1-minute load average at the end of the minute.
    pub load1: f64,
}

impl Minute {
    /// A one-line progress summary.
    pub fn line(&self) -> String {
        let o = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
        format!(
            "minute {:>3}: produced {}, dispatched {}, applied {}; claim p50/p99 {}/{} ms; commit→applied p50/p99 \
             {}/{} ms; outbox {:.1} MB ({} dead tuples); oldest transaction {:.0} s{}; CPU relay {:.0} %, consumer \
             {:.0} %, callbacks {:.0} %, postgres {:.0} %, bench {:.0} %; load {:.1}",
            self.minute,
            self.produced,
            self.dispatched,
            self.applied,
            o(self.claim_p50_ms),
            o(self.claim_p99_ms),
            o(self.commit_to_applied_p50_ms),
            o(self.commit_to_applied_p99_ms),
            self.outbox_bytes as f64 / 1e6,
            self.tables
                .iter()
                .find(|t| t.table == "outbox")
                .map_or(0, |t| t.dead_tuples),
            self.oldest_transaction_secs,
            if self.pinned { " (pinned)" } else { "" },
            self.relay_cpu_pct,
            self.consumer_cpu_pct,
            self.callback_cpu_pct,
            self.postgres_cpu_pct,
            self.bench_cpu_pct,
            self.load1,
        )
    }
}

/// One relay invocation's EMF line, as read from its log.
#[derive(Debug, Clone, Serialize)]
pub struct Invocation {
    /// Seconds since the sampler started when it was read.
    pub read_at_secs: f64,
    pub metrics: HashMap<String, f64>,
}

/// Reads the minutes. CPU is the difference of `/proc` readings across the minute; a relay restarted within it
/// loses its earlier share (restarts are logged, and none is expected).
pub struct Sampler {
    pool: PgPool,
    db: outbox::db::Db,
    started: std::time::Instant,
    last_ord: i64,
    last_db_time: chrono::DateTime<chrono::Utc>,
    last_produced: u64,
    last_applied: i64,
    last_cpu: HashMap<&'static str, f64>,
    logs: Vec<(PathBuf, u64, String)>,
    invocations: Vec<Invocation>,
    pending: Vec<Invocation>,
    /// Rows deleted by the housekeeping of the invocations read since the last minute: outbox, dedupe rows.
    pending_deleted: (u64, u64),
    pids: HashMap<&'static str, Vec<u32>>,
    last_secs: f64,
}

impl Sampler {
    pub(crate) async fn new(
        url: &str,
        relays: &[Worker],
        receivers: &[Worker],
        log_dir: &Path,
    ) -> anyhow::Result<Sampler> {
        let opts: PgConnectOptions = url.parse().context("DATABASE_URL")?;
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(opts.application_name("sustained-sampler"))
            .await?;
        let mut cfg = outbox::db::DbConfig::defaults("sustained-health");
        cfg.max_connections = 1;
        let db = cfg.handle(&secrecy::SecretString::from(url.to_owned()))?;
        let last_db_time = sqlx::query_scalar("SELECT now()").fetch_one(&pool).await?;
        let logs = relays
            .iter()
            .map(|w| {
                (
                    log_dir.join(format!("soak-relay-{}.log", w.index)),
                    0,
                    String::new(),
                )
            })
            .collect();
        let mut s = Sampler {
            pool,
            db,
            started: std::time::Instant::now(),
            last_ord: 0,
            last_db_time,
            last_produced: 0,
            last_applied: 0,
            last_cpu: HashMap::new(),
            logs,
            invocations: Vec::new(),
            pending: Vec::new(),
            pending_deleted: (0, 0),
            pids: HashMap::new(),
            last_secs: 0.0,
        };
        s.track(relays, receivers);
        s.last_cpu = s.cpu();
        Ok(s)
    }

    /// Notes the workers' current process ids (call after a start or restart).
    pub(crate) fn track(&mut self, relays: &[Worker], receivers: &[Worker]) {
        let mut pids: HashMap<&'static str, Vec<u32>> = HashMap::new();
        for w in relays.iter().chain(receivers) {
            let kind = match w.kind {
                Kind::Relay => "relay",
                Kind::Consumer => "consumer",
                Kind::Callback => "callback",
            };
            if let Some(pid) = w.child.as_ref().and_then(|c| c.id()) {
                pids.entry(kind).or_default().push(pid);
            }
        }
        self.pids = pids;
    }

    /// CPU seconds so far per kind of process.
    fn cpu(&self) -> HashMap<&'static str, f64> {
        let mut out = HashMap::new();
        for (kind, pids) in &self.pids {
            out.insert(*kind, pids.iter().filter_map(|p| cpu_secs(*p)).sum());
        }
        out.insert("bench", cpu_secs(std::process::id()).unwrap_or(0.0));
        out.insert("postgres", postgres_cpu_secs());
        out
    }

    /// Reads the relays' logs for new EMF lines.
    fn read_logs(&mut self) {
        let at = self.started.elapsed().as_secs_f64();
        for (path, offset, partial) in &mut self.logs {
            let Ok(mut f) = std::fs::File::open(&*path) else {
                continue;
            };
            if f.seek(SeekFrom::Start(*offset)).is_err() {
                continue;
            }
            // Bytes, decoded line by line: one invalid byte must not stop the reading for good.
            let mut buf = Vec::new();
            if let Ok(n) = f.read_to_end(&mut buf) {
                *offset += n as u64;
            }
            partial.push_str(&String::from_utf8_lossy(&buf));
            let complete = match partial.rfind('\n') {
                Some(i) => i + 1,
                None => continue,
            };
            let text: String = partial.drain(..complete).collect();
            for line in text.lines() {
                if let Some(inv) = emf_line(line, at) {
                    self.pending.push(inv);
                } else if let Some((outbox, processed)) = housekeeping_line(line) {
                    self.pending_deleted.0 += outbox;
                    self.pending_deleted.1 += processed;
                }
            }
        }
    }

    /// The minute that just ended.
    pub async fn minute(
        &mut self,
        minute: u32,
        produced: u64,
        pinned: bool,
    ) -> anyhow::Result<Minute> {
        let secs = self.started.elapsed().as_secs_f64();
        self.read_logs();
        let invocations = std::mem::take(&mut self.pending);
        let (outbox_deleted, processed_deleted) = std::mem::take(&mut self.pending_deleted);
        let now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
            .fetch_one(&self.pool)
            .await?;
        let dispatched: i64 = sqlx::query_scalar(outbox::schema::q(
            "SELECT count(*) FROM {schema}.outbox WHERE dispatched_at >= $1 AND dispatched_at < $2",
        ))
        .bind(self.last_db_time)
        .bind(now)
        .fetch_one(&self.pool)
        .await?;
        // Latencies from the rows applied since the last minute's highest `ord` (a consumer transaction that took
        // a lower `ord` and committed later is left out: a sample); the count from the table's total, which
        // misses nothing.
        let total_applied: i64 = sqlx::query_scalar("SELECT count(*) FROM soak_applied")
            .fetch_one(&self.pool)
            .await?;
        let (_, p50, p99, max_ord): (i64, Option<f64>, Option<f64>, Option<i64>) =
            sqlx::query_as(outbox::schema::q(
                "SELECT count(*), \
                        percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), \
                        percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), max(ord) \
                 FROM (SELECT a.ord, (extract(epoch FROM a.applied_at - o.created_at) * 1000)::float8 AS ms \
                       FROM soak_applied a JOIN {schema}.outbox o ON o.id = a.outbox_id \
                       WHERE a.ord > $1) s",
            ))
            .bind(self.last_ord)
            .fetch_one(&self.pool)
            .await?;
        let health: DatabaseHealth = outbox::internals::health::read(&self.db).await?;
        let cpu = self.cpu();
        let period = secs - self.last_secs;
        let pct = |kind: &str| -> f64 {
            let now = cpu.get(kind).copied().unwrap_or(0.0);
            let before = self.last_cpu.get(kind).copied().unwrap_or(0.0);
            if period > 0.0 {
                (100.0 * (now - before) / period).max(0.0)
            } else {
                0.0
            }
        };
        let metric = |name: &str| -> Vec<f64> {
            invocations
                .iter()
                .filter_map(|i| i.metrics.get(name).copied())
                .collect()
        };
        let claim_p50s = metric("ClaimLatencyP50");
        let tables: Vec<TableMinute> = health.tables.iter().map(table_minute).collect();
        let m = Minute {
            minute,
            at_secs: secs,
            produced: produced - self.last_produced,
            dispatched,
            applied: total_applied - self.last_applied,
            claim_p50_ms: (!claim_p50s.is_empty()).then(|| outbox_testkit::median(&claim_p50s)),
            claim_p99_ms: metric("ClaimLatencyP99").into_iter().reduce(f64::max),
            invocations: invocations.len(),
            outbox_deleted,
            processed_deleted,
            commit_to_applied_p50_ms: p50,
            commit_to_applied_p99_ms: p99,
            outbox_bytes: tables
                .iter()
                .find(|t| t.table == "outbox")
                .map_or(0, |t| t.total_bytes),
            tables,
            oldest_transaction_secs: health.horizon.oldest_transaction_age_secs,
            pinned,
            relay_cpu_pct: pct("relay"),
            consumer_cpu_pct: pct("consumer"),
            callback_cpu_pct: pct("callback"),
            postgres_cpu_pct: pct("postgres"),
            bench_cpu_pct: pct("bench"),
            load1: load_average()[0],
        };
        self.last_cpu = cpu;
        self.last_db_time = now;
        self.last_produced = produced;
        self.last_applied = total_applied;
        if let Some(o) = max_ord {
            self.last_ord = o;
        }
        self.invocations.extend(invocations);
        self.last_secs = secs;
        Ok(m)
    }

    /// Every invocation read so far (the final read included).
    pub fn all_invocations(&mut self) -> Vec<Invocation> {
        self.read_logs();
        let pending = std::mem::take(&mut self.pending);
        self.invocations.extend(pending);
        self.invocations.clone()
    }
}

fn table_minute(t: &TableHealth) -> TableMinute {
    TableMinute {
        table: t.table.clone(),
        total_bytes: t.total_bytes,
        index_bytes: t.index_bytes,
        live_tuples: t.live_tuples,
        dead_tuples: t.dead_tuples,
        autovacuum_count: t.autovacuum_count,
    }
}

/// An EMF line of the relay function (`{"_aws": …, "ClaimLatencyP99": …}`): its numeric members.
pub fn emf_line(line: &str, at: f64) -> Option<Invocation> {
    let v: Value = serde_json::from_str(line.trim()).ok()?;
    let obj = v.as_object()?;
    obj.get("_aws")?;
    let metrics = obj
        .iter()
        .filter_map(|(k, v)| v.as_f64().map(|n| (k.clone(), n)))
        .collect();
    Some(Invocation {
        read_at_secs: at,
        metrics,
    })
}

/// The housekeeping of a relay's "relay invocation done" log line (its `summary` field): rows deleted from
/// `outbox` and from `processed_messages`.
fn housekeeping_line(line: &str) -> Option<(u64, u64)> {
    let v: Value = serde_json::from_str(line.trim()).ok()?;
    let text = v["summary"]
        .as_str()
        .or_else(|| v["fields"]["summary"].as_str())?;
    let summary: Value = serde_json::from_str(text).ok()?;
    let h = &summary["housekeeping"];
    Some((
        h["outbox_deleted"].as_u64().unwrap_or(0),
        h["processed_deleted"].as_u64().unwrap_or(0),
    ))
}

/// CPU seconds of every `postgres` process (user + system), plus what the postmaster's reaped children used
/// (backends and autovacuum workers that ended).
fn postgres_cpu_secs() -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    let mut total = 0.0;
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        if !head.ends_with("(postgres") {
            continue;
        }
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        // utime, stime, cutime, cstime (fields 14–17 of stat, counted here from the state field).
        total += (ticks(11) + ticks(12) + ticks(13) + ticks(14)) / 100.0;
    }
    total
}
