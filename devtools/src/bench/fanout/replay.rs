//! The replay part of `bench fanout` (module docs of `super`): a new subscriber's history beside a live one,
//! unpaced and then paced.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use outbox::db::{Db, Statements};
use outbox::subscribers::{self, Start};
use serde_json::{Value, json};
use sqlx::PgPool;

use super::figures::{LiveLatency, clock, latency};
use super::plan::Plan;
use super::rig::{LIVE, ORDERED, Rig, reset, running_relay};
use super::traffic::{ordered_events, produce, steady_producer};
use crate::bench::support::{DevServerProcess, Knobs, ScratchDb};

/// Both runs (unpaced, then at the default parallelism, in this process), with their keys in the figures.
pub(super) async fn part(
    db: &ScratchDb,
    dev: &DevServerProcess,
    rig: &Rig,
    knobs: Knobs,
    plan: &Plan,
) -> anyhow::Result<Vec<(&'static str, Value)>> {
    let mut out = Vec::new();
    // Unpaced first (the baseline), then at the default parallelism, in this process.
    let default = outbox::config::QstashConfig::DEFAULT_REPLAY_PARALLELISM;
    for (key, parallelism) in [("replay_unpaced", UNPACED), ("replay", default)] {
        let r = replay(db, dev, rig, knobs, plan, parallelism).await?;
        let ms = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
        println!(
            "fanout replay, QSTASH_REPLAY_PARALLELISM={parallelism}: {} retained events to a new subscriber in \
             {:.1} s ({:.0} events/s; copying {:.1} s); live subscriber at {}/s: p50 {:.0} → {:.0} ms, \
             p99 {:.0} → {:.0} ms, in the relay p99 {:.0} → {:.0} ms (baseline → during the replay)",
            r["history_events"],
            ms(&r["replay_secs"]),
            ms(&r["replay_events_per_sec"]),
            ms(&r["copy_secs"]),
            r["live_rate"],
            ms(&r["live_baseline"]["p50_ms"]),
            ms(&r["live_during_replay"]["p50_ms"]),
            ms(&r["live_baseline"]["p99_ms"]),
            ms(&r["live_during_replay"]["p99_ms"]),
            ms(&r["live_baseline"]["relay_p99_ms"]),
            ms(&r["live_during_replay"]["relay_p99_ms"]),
        );
        out.push((key, r));
    }
    Ok(out)
}

/// `QSTASH_REPLAY_PARALLELISM` of the unpaced baseline run: QStash's flow control never holds a replay back.
const UNPACED: u32 = 1_000;

/// The replay scenario (module docs), with `QSTASH_REPLAY_PARALLELISM = parallelism`.
async fn replay(
    db: &ScratchDb,
    dev: &DevServerProcess,
    rig: &Rig,
    knobs: Knobs,
    plan: &Plan,
    parallelism: u32,
) -> anyhow::Result<Value> {
    reset(db, rig, 1).await?;
    let history = plan.replay_keys * plan.replay_per_key;
    produce(
        &db.pool,
        ordered_events(plan.replay_keys, plan.replay_per_key)?,
    )
    .await?;
    // Retained and done for the default subscriber: delivered, its lanes at the end.
    sqlx::raw_sql(
        "UPDATE outbox SET dispatched_at = now(), delivered_at = now(); \
         UPDATE outbox_keys k SET done_seq = s.last_seq FROM outbox_sequences s \
           WHERE s.topic = k.topic AND s.partition_key = k.partition_key;",
    )
    .execute(&db.pool)
    .await?;
    sqlx::query("VACUUM ANALYZE outbox")
        .execute(&db.pool)
        .await?;
    let replay_parallelism = [("QSTASH_REPLAY_PARALLELISM", parallelism.to_string())];
    let (stop, draining) = running_relay(db, dev, rig, knobs, &replay_parallelism).await?;
    let (live_stop, live) = steady_producer(&db.pool, LIVE, plan.live_rate, 100);
    let t0 = clock(&db.pool).await?;
    tokio::time::sleep(Duration::from_secs_f64(plan.baseline_secs)).await;
    let t1 = clock(&db.pool).await?;
    let h = Db::new(db.pool.clone(), Statements::Prepared);
    let (name, url) = rig.consumers.last().context("the replayed subscriber")?;
    let copy_started = Instant::now();
    subscribers::add(
        &h,
        ORDERED.name(),
        name,
        Some(url),
        Start::FromId(1),
        Duration::from_secs(60),
    )
    .await?;
    let last =
        subscribers::replay(&h, ORDERED.name(), name, Duration::from_secs(60), |_| {}).await?;
    let copy_secs = copy_started.elapsed().as_secs_f64();
    let give_up = Instant::now() + Duration::from_secs(600);
    loop {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM processed_messages WHERE consumer = $1")
                .bind(name)
                .fetch_one(&db.pool)
                .await?;
        if n as u64 >= history {
            break;
        }
        if Instant::now() > give_up {
            bail!("the new subscriber applied {n} of {history} replayed events within 600 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let replay_secs = copy_started.elapsed().as_secs_f64();
    let t2 = clock(&db.pool).await?;
    let _ = live_stop.send(true);
    let live_events = live.await??;
    // Let the last live events arrive, then stop the relay.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.stop();
    let _ = draining.await;
    let base = live_latency(&db.pool, t0 + chrono::Duration::seconds(1), t1).await?;
    let during = live_latency(&db.pool, t1, t2).await?;
    let ordered_ok: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM consumer_sequences WHERE consumer = $1 AND topic = $2 AND last_seq = $3",
    )
    .bind(name)
    .bind(ORDERED.name())
    .bind(plan.replay_per_key as i64)
    .fetch_one(&db.pool)
    .await?;
    Ok(json!({
        "replay_parallelism": parallelism,
        "history_events": history,
        "keys": plan.replay_keys,
        "copied": last.map(|p| p.total),
        "copy_secs": copy_secs,
        "replay_secs": replay_secs,
        "replay_events_per_sec": history as f64 / replay_secs,
        "keys_complete_in_order": ordered_ok,
        "live_rate": plan.live_rate,
        "live_events": live_events,
        "live_baseline": base.json(),
        "live_during_replay": during.json(),
        "live_p50_ratio": during.p50_ms / base.p50_ms,
        "live_p99_ratio": during.p99_ms / base.p99_ms,
    }))
}

async fn live_latency(
    pool: &PgPool,
    from: chrono::DateTime<chrono::Utc>,
    to: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<LiveLatency> {
    latency(pool, LIVE.name(), "consumer", from, to).await
}
