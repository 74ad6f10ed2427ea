//! The outage part of `bench fanout` (module docs of `super`): subscriber B down for a minute beside A, against
//! B healthy.

use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::{Value, json};

use super::figures::{clock, latency, median_at};
use super::plan::Plan;
use super::rig::{NAMED, ORDERED, Rig, reset, running_relay};
use super::traffic::steady_producer;
use crate::bench::support::{DevServerProcess, Knobs, ScratchDb};

/// Two B-healthy and two B-down runs, alternating, on a dev server of its own; medians and ratios.
pub(super) async fn part(
    db: &ScratchDb,
    rig: &Rig,
    knobs: Knobs,
    plan: &Plan,
) -> anyhow::Result<Value> {
    // B's failed deliveries come back on QStash's retry delays; this dev server runs them 20× faster
    // (0.6 s, 7.4 s, 90 s), so B's catch-up is measured in seconds, not minutes.
    let scaled = DevServerProcess::start(&["--deliver", "true", "--time-scale", "0.05"]).await?;
    // Alternating, two of each: the median of each figure.
    let mut runs: [Vec<Value>; 2] = [Vec::new(), Vec::new()];
    for down in (0..2).flat_map(|_| [false, true]) {
        let r = b_down_run(db, &scaled, rig, knobs, plan, down).await;
        let r = match r {
            Ok(r) => r,
            Err(e) => {
                scaled.stop().await;
                return Err(e);
            }
        };
        let ms = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
        println!(
            "fanout outage, B {}: A applied {:.0} events/s, commit → applied p50 {:.0} ms, p99 {:.0} ms over \
             {:.0} s; B caught up {:.1} s after its return, {} of {} applied, complete in order: {}, {} dead \
             letters",
            if down { "down" } else { "healthy" },
            ms(&r["a_events_per_sec"]),
            ms(&r["a_latency"]["p50_ms"]),
            ms(&r["a_latency"]["p99_ms"]),
            ms(&r["window_secs"]),
            ms(&r["b_caught_up_secs_after_return"]),
            r["b_applied"],
            r["events_written"],
            r["b_complete_in_order"],
            r["b_dead_letters"],
        );
        runs[usize::from(down)].push(r);
    }
    scaled.stop().await;
    let (healthy, down) = (outage_point(&runs[0]), outage_point(&runs[1]));
    let ratio =
        |k: &str| down[k].as_f64().unwrap_or(f64::NAN) / healthy[k].as_f64().unwrap_or(f64::NAN);
    Ok(json!({
        "down_secs": plan.outage_down_secs,
        "a_events_per_sec_ratio": ratio("a_events_per_sec"),
        "a_p50_ratio": ratio("a_p50_ms"),
        "a_p99_ratio": ratio("a_p99_ms"),
        "healthy": healthy,
        "down": down,
    }))
}

/// The "B down" scenario (module docs), once with B healthy and once with B down: subscribers A (the default)
/// and B ([`NAMED`]`[0]`) of the ordered topic, a live producer at `plan.outage_rate` events/s over
/// `plan.outage_keys` keys for before + down + after seconds; with `b_down`, B answers 503 for the middle
/// `plan.outage_down_secs`. A's figures cover the middle window: events/s it applied, and commit → applied of the
/// events written then. Then B's catch-up: seconds from B's return until it has applied every event, whether it
/// applied each once (dedupe rows) and every key completely in order (its last sequences), its dead letters.
async fn b_down_run(
    db: &ScratchDb,
    dev: &DevServerProcess,
    rig: &Rig,
    knobs: Knobs,
    plan: &Plan,
    b_down: bool,
) -> anyhow::Result<Value> {
    use std::sync::atomic::Ordering::SeqCst;
    reset(db, rig, 2).await?;
    let b = NAMED[0];
    let (stop, draining) = running_relay(db, dev, rig, knobs, &[]).await?;
    let (rate, keys) = (plan.outage_rate, plan.outage_keys);
    let (live_stop, producer) = steady_producer(&db.pool, ORDERED, rate, keys);
    tokio::time::sleep(Duration::from_secs_f64(plan.outage_before_secs)).await;
    let t1 = clock(&db.pool).await?;
    rig.b_down.store(b_down, SeqCst);
    tokio::time::sleep(Duration::from_secs_f64(plan.outage_down_secs)).await;
    rig.b_down.store(false, SeqCst);
    let t2 = clock(&db.pool).await?;
    let up = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(plan.outage_after_secs)).await;
    let _ = live_stop.send(true);
    let written = producer.await?? as i64;
    let applied = |consumer: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM processed_messages p JOIN outbox o ON o.id = p.message_id::bigint \
                 WHERE p.consumer = $1 AND o.topic = $2",
            )
            .bind(consumer)
            .bind(ORDERED.name())
            .fetch_one(&pool)
            .await
        }
    };
    let give_up = Instant::now() + Duration::from_secs(600);
    let mut b_done_after = None;
    loop {
        let (a_n, b_n) = (applied("consumer").await?, applied(b).await?);
        if b_n >= written && b_done_after.is_none() {
            b_done_after = Some(up.elapsed().as_secs_f64());
        }
        if a_n >= written && b_done_after.is_some() {
            break;
        }
        if Instant::now() > give_up {
            bail!("after 600 s A applied {a_n} and B {b_n} of {written} events");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.stop();
    let _ = draining.await;
    let a = latency(&db.pool, ORDERED.name(), "consumer", t1, t2).await?;
    let a_applied_in_window: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM processed_messages WHERE consumer = 'consumer' AND processed_at >= $1 \
         AND processed_at < $2",
    )
    .bind(t1)
    .bind(t2)
    .fetch_one(&db.pool)
    .await?;
    let window = (t2 - t1).num_milliseconds() as f64 / 1000.0;
    // B's last sequence per key equals the key's event count only if it applied every event of the key in order
    // (the consumer refuses an older sequence); the sum over keys is then the number written.
    let (b_keys, b_seq_sum): (i64, Option<i64>) = sqlx::query_as(
        "SELECT count(*), sum(last_seq)::bigint FROM consumer_sequences WHERE consumer = $1 AND topic = $2",
    )
    .bind(b)
    .bind(ORDERED.name())
    .fetch_one(&db.pool)
    .await?;
    let b_dead: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letters WHERE subscriber = $1")
        .bind(b)
        .fetch_one(&db.pool)
        .await?;
    Ok(json!({
        "b_down": b_down,
        "window_secs": window,
        "events_written": written,
        "rate": rate,
        "keys": keys,
        "a_events_per_sec": a_applied_in_window as f64 / window,
        "a_latency": a.json(),
        "b_caught_up_secs_after_return": b_done_after,
        "b_applied": applied(b).await?,
        "b_keys_in_order": b_keys,
        "b_complete_in_order": b_seq_sum == Some(written) && b_keys as u64 == keys.min(written as u64),
        "b_dead_letters": b_dead,
    }))
}

/// The rounds of one side of the outage scenario: the median of each figure, B complete and in order in every
/// round, B's dead letters summed; the rounds themselves under `rounds`.
fn outage_point(runs: &[Value]) -> Value {
    json!({
        "rate": runs.first().map(|r| r["rate"].clone()),
        "keys": runs.first().map(|r| r["keys"].clone()),
        "a_events_per_sec": median_at(runs, &["a_events_per_sec"]),
        "a_p50_ms": median_at(runs, &["a_latency", "p50_ms"]),
        "a_p99_ms": median_at(runs, &["a_latency", "p99_ms"]),
        "b_caught_up_secs_after_return": median_at(runs, &["b_caught_up_secs_after_return"]),
        "events_written": runs.iter().filter_map(|r| r["events_written"].as_i64()).sum::<i64>(),
        "b_applied": runs.iter().filter_map(|r| r["b_applied"].as_i64()).sum::<i64>(),
        "b_complete_in_order": runs.iter().all(|r| r["b_complete_in_order"] == Value::Bool(true)),
        "b_dead_letters": runs.iter().filter_map(|r| r["b_dead_letters"].as_i64()).sum::<i64>(),
        "rounds": runs,
    })
}
