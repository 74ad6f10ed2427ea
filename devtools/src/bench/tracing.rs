//! `outbox-dev bench tracing`: what trace export costs and what a bad collector can do (issue 38, decision record
//! 0074).
//!
//! 1. Collector faults, on an export of its own (`outbox::internals::trace::TraceRig`): per collector — accepting,
//!    down (nothing listens), slow (answers after 2 s), refusing (503) — rounds of one invocation's worth of spans
//!    then one flush, timed: no flush may take longer than the bound. Then the memory bound: ten buffers' worth of
//!    spans with no flush, against a collector that is down: what is held stays at the buffer's size, the rest
//!    is dropped and counted.
//! 2. Throughput with export off and on, side by side: the relay (`outbox relay --until-empty`, a child process,
//!    exporting to a receiver here when on) and the consumer (its handler in this process, after which export is
//!    on for the rest of the process).

use std::time::{Duration, Instant};

use outbox::internals::trace::TraceRig;
use outbox_cli::util::DbArgs;
use outbox_testkit::otlp::{Behaviour, OtlpReceiver, dead_endpoint};
use serde_json::{Value, json};

use super::consumer::{self, ConsumerPlan};
use super::relay;
use outbox_testkit::median;

use super::support::{DevServerProcess, Knobs, ScratchDb};

#[derive(clap::Args)]
pub struct TracingArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Rounds of each measurement (off and on alternate for the relay).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Events per relay drain.
    #[arg(long, default_value_t = 20_000)]
    pub events: u64,
    /// Seconds per consumer round.
    #[arg(long, default_value_t = 5.0)]
    pub consumer_secs: f64,
    /// Spans per simulated invocation in the fault rounds.
    #[arg(long, default_value_t = 500)]
    pub spans: usize,
    /// Also write the figures into `DIR/benchmarks.md` (the section between `<!-- tracing:begin -->` and
    /// `<!-- tracing:end -->`) and `DIR/benchmarks/figures.json` (key `tracing`), e.g. `--out docs`.
    #[arg(long, value_name = "DIR")]
    pub out: Option<std::path::PathBuf>,
}

/// The flush bound the fault rounds use (the default `OUTBOX_TRACE_FLUSH_TIMEOUT_MS`).
const BOUND: Duration = Duration::from_millis(500);
/// The buffer the fault rounds use (the default `OTEL_BSP_MAX_QUEUE_SIZE`).
const QUEUE: usize = 2048;

pub async fn run(args: TracingArgs) -> anyhow::Result<()> {
    let faults = collector_faults(args.rounds.max(3), args.spans).await?;
    let memory = memory_bound().await?;
    let relay = relay_on_off(&args).await?;
    let consumer = consumer_on_off(&args).await?;
    let line = json!({
        "bench": "tracing", "flush_bound_ms": BOUND.as_millis() as u64, "max_queue": QUEUE,
        "faults": faults, "memory": memory, "relay": relay, "consumer": consumer,
    });
    println!("BENCH_JSON {line}");
    if let Some(dir) = &args.out {
        let written = super::support::write_section(
            dir,
            "tracing",
            &line,
            |figures| section(&figures["tracing"]),
            [BEGIN, END],
        )?;
        for path in written {
            println!("wrote {}", path.display());
        }
    }
    Ok(())
}

const BEGIN: &str = "<!-- tracing:begin -->";
const END: &str = "<!-- tracing:end -->";

/// The `benchmarks.md` section of one run.
fn section(run: &Value) -> String {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let mut s = format!(
        "{BEGIN}\n## Trace export: collector faults and cost\n\n\
         `outbox-dev bench tracing` (docs/operations.md, \"Tracing\"; decision record 0074). Flush bound {} ms, \
         buffer {} spans. Each round: one invocation's worth of spans, then the flush a handler does before it \
         returns.\n\n| collector | flush median | flush max | exported | dropped and counted |\n|---|---:|---:|---:|---:|\n",
        run["flush_bound_ms"], run["max_queue"]
    );
    for (name, label) in [
        ("accepting", "accepting"),
        ("down", "down (nothing listens)"),
        ("slow_2s", "slow (answers after 2 s)"),
        ("refusing_503", "refusing (503)"),
    ] {
        let c = &run["faults"][name];
        s.push_str(&format!(
            "| {label} | {:.1} ms | {:.1} ms | {} | {} |\n",
            f(&c["flush_ms_median"]),
            f(&c["flush_ms_max"]),
            c["exported"],
            c["dropped"]
        ));
    }
    let m = &run["memory"];
    let (r, c) = (&run["relay"], &run["consumer"]);
    s.push_str(&format!(
        "\nMemory: {} spans made with no flush and the collector down: {} held (the buffer), {} dropped and \
         counted.\n\n| throughput | export off | export on | on / off |\n|---|---:|---:|---:|\n\
         | relay (unordered, {} events, claim {}, concurrency {}), events/s | {:.0} | {:.0} | {:.0} % |\n\
         | consumer (16 concurrent callers in one process, a flush per request), applied/s | {:.0} | {:.0} | {:.0} % |\n\
         {END}\n",
        m["spans_made"], m["held"], m["dropped_full"],
        r["events"], r["batch"], r["concurrency"], f(&r["off_median"]), f(&r["on_median"]), 100.0 * f(&r["on_vs_off"]),
        f(&c["off_median"]), f(&c["on_median"]), 100.0 * f(&c["on_vs_off"]),
    ));
    s
}

async fn collector_faults(rounds: usize, spans: usize) -> anyhow::Result<Value> {
    println!(
        "collector faults: {rounds} rounds of {spans} spans + one flush (bound {} ms)",
        BOUND.as_millis()
    );
    let accepting = OtlpReceiver::start(Behaviour::Accept).await?;
    let slow = OtlpReceiver::start(Behaviour::Slow(Duration::from_secs(2))).await?;
    let refusing = OtlpReceiver::start(Behaviour::Refuse(503)).await?;
    let dead = dead_endpoint();
    let mut out = serde_json::Map::new();
    for (name, url) in [
        ("accepting", accepting.url.as_str()),
        ("down", dead.as_str()),
        ("slow_2s", slow.url.as_str()),
        ("refusing_503", refusing.url.as_str()),
    ] {
        let rig = TraceRig::new(url, BOUND, QUEUE).map_err(anyhow::Error::msg)?;
        let mut ms = Vec::new();
        for _ in 0..rounds {
            rig.record(spans);
            let t = Instant::now();
            rig.flush().await;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let s = rig.stats();
        let max = ms.iter().cloned().fold(0.0, f64::max);
        println!(
            "  {name:<13} flush median {:>7.1} ms, max {max:>7.1} ms; exported {}, dropped {} (failed flushes {})",
            median(&ms),
            s.exported,
            s.dropped_failed + s.dropped_full,
            s.failed_flushes
        );
        out.insert(
            name.into(),
            json!({ "flush_ms": ms, "flush_ms_median": median(&ms), "flush_ms_max": max,
                    "exported": s.exported, "dropped": s.dropped_failed + s.dropped_full,
                    "failed_flushes": s.failed_flushes }),
        );
    }
    Ok(Value::Object(out))
}

async fn memory_bound() -> anyhow::Result<Value> {
    let rig = TraceRig::new(&dead_endpoint(), BOUND, QUEUE).map_err(anyhow::Error::msg)?;
    let made = 10 * QUEUE;
    rig.record(made);
    let s = rig.stats();
    println!(
        "memory bound: {made} spans with no flush, collector down: {} held, {} dropped and counted",
        s.buffered, s.dropped_full
    );
    Ok(json!({ "spans_made": made, "held": s.buffered, "dropped_full": s.dropped_full }))
}

async fn relay_on_off(args: &TracingArgs) -> anyhow::Result<Value> {
    let db = ScratchDb::create(&args.db.database_url, "outbox_bench_tracing").await?;
    let dev = DevServerProcess::start(&["--deliver", "false"]).await?;
    let receiver = OtlpReceiver::start(Behaviour::Accept).await?;
    let knobs = Knobs {
        batch: 500,
        concurrency: 8,
        qstash_batch: 100,
    };
    let result = async {
        let (mut off, mut on) = (Vec::new(), Vec::new());
        for round in 1..=args.rounds {
            let a = relay_rate(&db, &dev, args.events, knobs, None).await?;
            let b = relay_rate(&db, &dev, args.events, knobs, Some(&receiver.url)).await?;
            println!(
                "  relay round {round}: off {a:>7.0}/s, on {b:>7.0}/s ({:.0} %)",
                100.0 * b / a
            );
            off.push(a);
            on.push(b);
        }
        let (a, b) = (median(&off), median(&on));
        println!(
            "relay: export off {a:.0}/s, on {b:.0}/s: {:.0} %",
            100.0 * b / a
        );
        Ok::<_, anyhow::Error>(json!({
            "events": args.events, "batch": knobs.batch, "concurrency": knobs.concurrency,
            "off_events_per_sec": off, "on_events_per_sec": on, "off_median": a, "on_median": b,
            "on_vs_off": b / a, "spans_received": receiver.spans().len(),
        }))
    }
    .await;
    dev.stop().await;
    db.drop_now().await?;
    result
}

/// One drain of `events` by the relay child: events/s (export to `otlp` when given).
async fn relay_rate(
    db: &ScratchDb,
    dev: &DevServerProcess,
    events: u64,
    knobs: Knobs,
    otlp: Option<&str>,
) -> anyhow::Result<f64> {
    relay::seed_unordered(&db.pool, events).await?;
    let env: Vec<(&str, String)> = otlp
        .map(|u| vec![("OTEL_EXPORTER_OTLP_ENDPOINT", u.to_owned())])
        .unwrap_or_default();
    let out = relay::relay_child(&db.url, &dev.url, knobs, &env).await?;
    let dispatched = out["summary"]["dispatched"].as_u64().unwrap_or(0);
    anyhow::ensure!(
        dispatched == events,
        "relay dispatched {dispatched} of {events}: {out}"
    );
    Ok(events as f64 / out["elapsed_secs"].as_f64().unwrap_or(f64::NAN))
}

async fn consumer_on_off(args: &TracingArgs) -> anyhow::Result<Value> {
    let plan = || ConsumerPlan {
        rounds: args.rounds,
        secs: args.consumer_secs,
        concurrency: 16,
        pool: 8,
        ping_always: false,
    };
    let off = consumer::run(&args.db.database_url, plan()).await?;
    let receiver = OtlpReceiver::start(Behaviour::Accept).await?;
    // From here on the process exports (there is no turning it off again).
    anyhow::ensure!(
        outbox::telemetry::trace_layer::<tracing_subscriber::Registry>(Some(&receiver.url))
            .is_some(),
        "trace export could not be set up"
    );
    let on = consumer::run(&args.db.database_url, plan()).await?;
    let (a, b) = (median(&off.rates), median(&on.rates));
    println!(
        "consumer: export off {a:.0} applied/s, on {b:.0}/s: {:.0} % (spans received {})",
        100.0 * b / a,
        receiver.spans().len()
    );
    Ok(json!({
        "off_applied_per_sec": off.rates, "on_applied_per_sec": on.rates, "off_median": a, "on_median": b,
        "on_vs_off": b / a, "spans_received": receiver.spans().len(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_section_shows_each_collector_the_memory_bound_and_both_throughputs() {
        let fault = |ms: f64, exported: u64, dropped: u64| json!({"flush_ms_median": ms, "flush_ms_max": ms + 1.0, "exported": exported, "dropped": dropped});
        let run = json!({
            "flush_bound_ms": 500, "max_queue": 2048,
            "faults": {"accepting": fault(4.0, 10, 0), "down": fault(1.0, 0, 10), "slow_2s": fault(501.5, 0, 10),
                       "refusing_503": fault(1.0, 0, 10)},
            "memory": {"spans_made": 20480, "held": 2048, "dropped_full": 18432},
            "relay": {"events": 100, "batch": 500, "concurrency": 8, "off_median": 1000.0, "on_median": 950.0,
                      "on_vs_off": 0.95},
            "consumer": {"off_median": 800.0, "on_median": 752.0, "on_vs_off": 0.94},
        });
        let s = section(&run);
        assert!(s.starts_with(BEGIN) && s.trim_end().ends_with(END), "{s}");
        for row in [
            "| slow (answers after 2 s) | 501.5 ms | 502.5 ms | 0 | 10 |",
            "2048 held (the buffer), 18432 dropped and counted",
            "| 1000 | 950 | 95 % |",
            "| 800 | 752 | 94 % |",
        ] {
            assert!(s.contains(row), "{row} in\n{s}");
        }
    }
}
