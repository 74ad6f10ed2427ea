//! Benchmarks. Each prints a human-readable table and one JSON line (prefixed `BENCH_JSON `) with medians and
//! ratios against a baseline measured in the same run: these 2-core machines are noisy.

pub mod accounting;
pub mod batched;
pub mod console;
pub mod consumer;
pub mod cost;
pub mod dev_server;
pub mod endpoints;
pub mod fairness;
pub mod fanout;
pub mod plot;
pub mod relay;
pub mod report;
pub mod steady;
pub mod support;
pub mod sustained;
pub mod tracing;
pub mod xmin;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Relay events/s against the dev server next to a SQL-only claim+settle cycle; ordered keys; claim latency
    /// at scale; the relay's peak RSS.
    Relay(relay::RelayBenchArgs),
    /// Every scenario beside its same-run baseline — relay unordered by batch size and by concurrency, ordered
    /// by number of keys, consumer latency, commit → applied at a steady rate, a long transaction pinning the
    /// xmin horizon — written as docs/benchmarks.md with SVG plots and figures.json.
    Report(report::ReportArgs),
    /// Rewrite README.md's figures block from a report's figures.json (no benchmark run).
    Readme(report::readme::ReadmeArgs),
    /// Batched deliveries only: ordered over many keys, one hot key, unordered end to end and commit → applied
    /// at a low rate, for each N events per QStash message (`RELAY_DELIVERY_BATCH`), side by side.
    Batched(batched::BatchedArgs),
    /// The consumer alone: verified-and-applied deliveries through its handler beside the same transaction
    /// without HTTP, signature or routing; `--ping-always` measures the pool's liveness ping on every acquire.
    Consumer(consumer::ConsumerBenchArgs),
    /// The QStash-compatible dev server alone: `/v2/batch` accept-only and delivering to a trivial sink, on
    /// loopback, server and clients in this process.
    DevServer(dev_server::DevServerBenchArgs),
    /// What knowing every unordered event's outcome costs the relay: the dedupe-row sweep per event beside the
    /// dispatch settle it already pays (decision record 0015).
    Accounting(accounting::AccountingArgs),
    /// Each page of the operator console (`outbox console`) on a big database (1,000,000 outbox rows, 100,000
    /// dead letters, 10,000 ordered keys by default): the console's own time per page, median of several requests.
    Console(console::ConsoleBenchArgs),
    /// A steady rate for an hour while retention deletes what is done: every minute the events, claim and
    /// commit → applied latency, table sizes, dead tuples, autovacuum runs and CPU; then every event accounted
    /// for. `--quick` checks the command in under a minute.
    Sustained(sustained::SustainedArgs),
    /// Fan-out: ordered and unordered drains with 1 and 3 subscribers side by side (events/s per subscriber,
    /// QStash messages per event per subscriber, relay CPU per event), then a replay of retained history to a new
    /// subscriber beside a live one at a steady rate.
    Fanout(fanout::FanoutArgs),
    /// Fairness between tenants: one tenant's import of 100,000 events beside ten tenants writing 10 events/s
    /// each — the others' commit → applied and the import's rate, with fair claims, without, and with every
    /// tenant limited at QStash, beside each side alone.
    Fairness(fairness::FairnessArgs),
    /// The cost model, measured: the seed's configuration, the template's defaults, fan-out to 3 subscribers and
    /// the defaults with delivery callbacks, ordered and unordered, at a steady rate through the real handlers;
    /// QStash messages, Lambda invocations and GB-seconds, bytes, Postgres CPU and WAL per million events, then
    /// the dated price table applied apart from the counts.
    Cost(cost::CostArgs),
    /// Trace export (docs/operations.md, "Tracing"): the flush time and what is dropped with a collector that is
    /// accepting, down, slow or refusing; the spans held with no flush; relay and consumer throughput with export
    /// off and on.
    Tracing(tracing::TracingArgs),
}

pub async fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Relay(args) => relay::run(args).await,
        BenchCommand::Report(args) => report::run(args).await,
        BenchCommand::Readme(args) => report::readme::run(args),
        BenchCommand::Batched(args) => batched::run_cli(args).await,
        BenchCommand::Accounting(args) => accounting::run(args).await,
        BenchCommand::Fanout(args) => fanout::run(args).await,
        BenchCommand::Fairness(args) => fairness::run(args).await,
        BenchCommand::Cost(args) => cost::run(args).await,
        BenchCommand::Consumer(args) => consumer::run_cli(args).await,
        BenchCommand::DevServer(args) => dev_server::run(args).await,
        BenchCommand::Console(args) => console::run(args).await,
        BenchCommand::Sustained(args) => sustained::run(args).await,
        BenchCommand::Tracing(args) => tracing::run(args).await,
    }
}
