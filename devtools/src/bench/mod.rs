//! Benchmarks. Each prints a human-readable table and one JSON line (prefixed `BENCH_JSON `) with medians and
//! ratios against a baseline measured in the same run: these 2-core machines are noisy.

pub mod relay;
pub mod support;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Relay events/s against the dev server next to a SQL-only claim+settle cycle; ordered keys; claim latency
    /// at scale; the relay's peak RSS.
    Relay(relay::RelayBenchArgs),
}

pub async fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Relay(args) => relay::run(args).await,
    }
}
