//! Scenario: a long transaction pins the xmin horizon while the relay drains. A second connection opens a
//! `REPEATABLE READ` transaction and reads the outbox, so its snapshot stays open: no row version the relay's
//! settles replace can be removed (not by page pruning, not by index entry killing, not by vacuum) until it ends.
//! The relay must keep going; what changes is how much dead data each claim walks past.
//!
//! Three phases on one database, each adding `events` pending rows (no TRUNCATE, no VACUUM between them) and
//! draining them: without a pin, under the pin, after the pin's transaction ends. The relay's own claim, publish
//! and settle steps run here, with each claim timed, publishing to the dev server in accept-only mode.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox::internals::RelaySteps;
use outbox::relay::Relay;
use outbox_testkit::{median, percentile};
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection};

use super::support::{DevServerProcess, Knobs, ScratchDb, in_process_relay};

const SEED_SQL: &str = "INSERT INTO outbox (topic, partition_key, payload) \
    SELECT 'bench', 'k' || (g % 1000), jsonb_build_object('i', g, 'pad', repeat('x', 176)) \
    FROM generate_series(1, $1::bigint) g";

/// One phase's drain.
#[derive(Debug, Clone)]
pub struct PhaseRun {
    pub events_per_sec: f64,
    /// Every claim's duration, ms (empty claims at the end included: they are the relay's polls).
    pub claims_ms: Vec<f64>,
    /// `pg_stat_user_tables.n_dead_tup` for the outbox after the drain (an estimate; -1 if unreadable).
    pub dead_tuples: i64,
}

/// The phases in the order they run.
pub const PHASES: [&str; 3] = ["baseline", "pinned", "released"];

/// Drains everything pending with `concurrency` workers each running claim → publish → settle, timing each
/// claim. Fails unless exactly `expected` events were dispatched.
async fn drain(
    relay: &Arc<Relay>,
    concurrency: u32,
    expected: u64,
) -> anyhow::Result<(f64, Vec<f64>)> {
    let started = Instant::now();
    let workers = (0..concurrency.max(1)).map(|_| {
        let relay = relay.clone();
        tokio::spawn(async move {
            let mut claims = Vec::new();
            let mut dispatched = 0u64;
            loop {
                let t = Instant::now();
                let events = relay.claim().await?;
                claims.push(t.elapsed().as_secs_f64() * 1000.0);
                if events.is_empty() {
                    if relay.is_empty().await? {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                let (outcomes, _) = relay.publish(&events).await;
                let items = relay.decide(&events, &outcomes);
                dispatched += relay.settle(&items).await?.dispatched;
            }
            Ok::<_, outbox::relay::RelayError>((dispatched, claims))
        })
    });
    let mut total = 0;
    let mut claims = Vec::new();
    for r in futures::future::join_all(workers).await {
        let (d, c) = r??;
        total += d;
        claims.extend(c);
    }
    let secs = started.elapsed().as_secs_f64();
    if total != expected {
        bail!("the relay dispatched {total} of {expected} events");
    }
    Ok((expected as f64 / secs, claims))
}

async fn dead_tuples(conn: &mut PgConnection) -> i64 {
    let _ = sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut *conn)
        .await;
    sqlx::query_scalar::<_, i64>(
        "SELECT sum(n_dead_tup)::int8 FROM pg_stat_user_tables \
         WHERE relid IN (SELECT relid FROM pg_partition_tree('outbox') WHERE isleaf)",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap_or(-1)
}

/// One round on a fresh database: the three phases.
async fn round(base_url: &str, events: u64, knobs: Knobs) -> anyhow::Result<Vec<PhaseRun>> {
    let db = ScratchDb::create(base_url, "outbox_bench_xmin").await?;
    let dev = DevServerProcess::start(&["--deliver", "false"]).await?;
    let result = async {
        let relay = Arc::new(in_process_relay(&db.url, &dev.url, knobs, &[]).await?);
        let mut stats = PgConnection::connect(&db.url).await?;
        let mut pin = PgConnection::connect(&db.url)
            .await
            .context("the pinning connection")?;
        let mut out = Vec::new();
        for phase in PHASES {
            match phase {
                "pinned" => {
                    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
                        .execute(&mut pin)
                        .await?;
                    // The first statement takes the snapshot; holding the transaction open holds it.
                    let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
                        .fetch_one(&mut pin)
                        .await?;
                    tracing::debug!(seen, "xmin pinned");
                }
                "released" => {
                    sqlx::query("COMMIT").execute(&mut pin).await?;
                }
                _ => {}
            }
            sqlx::query(SEED_SQL)
                .bind(events as i64)
                .execute(&mut stats)
                .await?;
            sqlx::query("ANALYZE outbox").execute(&mut stats).await?;
            let (rate, claims_ms) = drain(&relay, knobs.concurrency, events).await?;
            let dead = dead_tuples(&mut stats).await;
            println!(
                "xmin {phase:>8}: {rate:>7.0} events/s, claim p50 {:.2} ms, p99 {:.2} ms, dead tuples ~{dead}",
                percentile(&claims_ms, 0.5),
                percentile(&claims_ms, 0.99)
            );
            out.push(PhaseRun {
                events_per_sec: rate,
                claims_ms,
                dead_tuples: dead,
            });
        }
        relay.pool().close().await;
        Ok::<_, anyhow::Error>(out)
    }
    .await;
    dev.stop().await;
    db.drop_now().await?;
    result
}

/// Runs `rounds` rounds (a fresh database each) and returns, per phase, the median events/s and the claim
/// latency percentiles over all its claims.
pub async fn run(
    base_url: &str,
    events: u64,
    rounds: usize,
    knobs: Knobs,
) -> anyhow::Result<Value> {
    let mut per_phase: Vec<Vec<PhaseRun>> = vec![Vec::new(); PHASES.len()];
    for r in 1..=rounds {
        println!("xmin round {r}: {events} events per phase");
        for (slot, run) in per_phase
            .iter_mut()
            .zip(round(base_url, events, knobs).await?)
        {
            slot.push(run);
        }
    }
    let baseline_rate = median(
        &per_phase[0]
            .iter()
            .map(|r| r.events_per_sec)
            .collect::<Vec<_>>(),
    );
    let baseline_p50 = {
        let all: Vec<f64> = per_phase[0]
            .iter()
            .flat_map(|r| r.claims_ms.clone())
            .collect();
        percentile(&all, 0.5)
    };
    let phases: Vec<Value> = PHASES
        .iter()
        .zip(&per_phase)
        .map(|(name, runs)| {
            let rates: Vec<f64> = runs.iter().map(|r| r.events_per_sec).collect();
            let claims: Vec<f64> = runs.iter().flat_map(|r| r.claims_ms.clone()).collect();
            let rate = median(&rates);
            let p50 = percentile(&claims, 0.5);
            json!({
                "phase": name,
                "events_per_sec": rates, "events_per_sec_median": rate,
                "vs_baseline": rate / baseline_rate,
                "claims": claims.len(),
                "claim_p50_ms": p50, "claim_p99_ms": percentile(&claims, 0.99),
                "claim_p50_vs_baseline": p50 / baseline_p50,
                "dead_tuples_after": runs.iter().map(|r| r.dead_tuples).collect::<Vec<_>>(),
                // Raw claim durations for the report's plot; it removes them before writing figures.json.
                "samples_claim_ms": claims,
            })
        })
        .collect();
    Ok(json!({
        "events_per_phase": events, "rounds": rounds,
        "batch": knobs.batch, "concurrency": knobs.concurrency,
        "phases": phases,
    }))
}
