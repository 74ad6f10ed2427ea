//! `outbox relay`: the relay Lambda's handler, run locally. Each loop iteration is one simulated invocation
//! with a deadline, exactly as the schedule would run it; `--until-empty` drains once and exits (benchmarks): it
//! stops when nothing is pending or awaiting evidence, or at `--timeout-secs`, and rides out a QStash outage in
//! between (it waits for the shared probe like an invocation whose deadline is the timeout). Its JSON summary
//! includes the process's peak RSS (Linux `/proc`; null elsewhere).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::Args;
use lambda_runtime::{Context as LambdaContext, LambdaEvent};
use outbox::relay::{RelayState, handle};
use serde_json::json;

#[derive(Args, Debug)]
pub struct RelayArgs {
    /// Length of each simulated invocation, seconds (the Lambda timeout).
    #[arg(long, default_value_t = 60)]
    invocation_secs: u64,
    /// Drain until nothing is pending or awaiting delivery evidence, print a JSON summary, exit.
    #[arg(long)]
    until_empty: bool,
    /// Give up after this many seconds (with --until-empty).
    #[arg(long, default_value_t = 600)]
    timeout_secs: u64,
}

pub async fn run(args: RelayArgs) -> anyhow::Result<()> {
    outbox::telemetry::init_from_env();
    let state = RelayState::from_process_env()
        .await
        .context("relay configuration")?;
    if args.until_empty {
        let started = Instant::now();
        let summary = state
            .relay
            .drain_with(
                started + Duration::from_secs(args.timeout_secs),
                outbox::relay::Until::Empty,
            )
            .await
            .context("relay drain")?;
        // As the Lambda handler does before it returns (nothing when trace export is off).
        outbox::telemetry::flush().await;
        let elapsed = started.elapsed();
        let traces = outbox::telemetry::stats();
        println!(
            "{}",
            json!({
                "elapsed_secs": elapsed.as_secs_f64(),
                "summary": summary,
                "peak_rss_kib": peak_rss_kib(),
                "spans_exported": traces.exported,
                "spans_dropped": traces.dropped_full + traces.dropped_failed,
            })
        );
        return Ok(());
    }
    // Shared with the Lambda (outbox::config): an invocation shorter than a lease plus the margin would claim
    // nothing and start again at once, reporting success each time.
    state
        .relay
        .config()
        .check_invocation_budget(
            Duration::from_secs(args.invocation_secs),
            "--invocation-secs",
        )
        .context("relay configuration")?;
    let mut n = 0u64;
    loop {
        n += 1;
        let mut ctx = LambdaContext::default();
        ctx.request_id = format!("local-{n}");
        let deadline = SystemTime::now() + Duration::from_secs(args.invocation_secs);
        ctx.deadline = deadline
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let event = LambdaEvent::new(
            json!({"source": "outbox.cli", "detail-type": "Scheduled Event"}),
            ctx,
        );
        match handle(&state, event).await {
            Err(e) => {
                tracing::error!(error = %e, "relay invocation failed; the next one starts in 5 s");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            // A QStash outage whose next probe comes after the invocation's deadline ends it at once (decision
            // record 0012; an earlier probe is waited for inside it): pause as the schedule would rather than spin.
            Ok(s) if s.drain.stopped == "outage" => {
                tokio::time::sleep(state.relay.config().outage_probe_base).await;
            }
            Ok(_) => {}
        }
    }
}

/// Peak resident set size of this process (`VmHWM` of `/proc/self/status`), in KiB: what a drain needed, for
/// sizing the function's memory.
pub fn peak_rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}
