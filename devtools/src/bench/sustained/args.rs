//! The arguments of `outbox-dev bench sustained`, and the sizes `--quick` makes of them.

use std::path::PathBuf;

use clap::Args;
use outbox_cli::util::DbArgs;

/// Arguments of `outbox-dev bench sustained`.
#[derive(Args, Debug, Clone)]
pub struct SustainedArgs {
    /// The Postgres server; the run uses a fresh database (--database) on it. Run it on a server with autovacuum
    /// on, as every production Postgres runs: the report records the server's settings.
    #[command(flatten)]
    pub db: DbArgs,
    /// Name of the run's database (dropped first if it exists; kept afterwards for inspection).
    #[arg(long, default_value = "outbox_sustained")]
    pub database: String,
    /// Events per second, all producers together.
    #[arg(long, default_value_t = 1000.0)]
    pub rate: f64,
    /// Minutes to produce for.
    #[arg(long, default_value_t = 60)]
    pub minutes: u32,
    /// Seconds per minute of the run (the sampling period; the retention window and the long transaction are
    /// counted in these minutes). Shorter only for checking the command.
    #[arg(long, default_value_t = 60)]
    pub minute_secs: u64,
    /// How long dispatched events (`OUTBOX_RETENTION_HOURS`) and dedupe rows (`PROCESSED_TTL_HOURS`) are kept,
    /// in minutes of the run.
    #[arg(long, default_value_t = 10.0)]
    pub retention_minutes: f64,
    /// Share of the events written to the ordered topic.
    #[arg(long, default_value_t = 0.2)]
    pub ordered_share: f64,
    /// Keys of the ordered topic.
    #[arg(long, default_value_t = 200)]
    pub ordered_keys: u64,
    /// Keys of the unordered topic.
    #[arg(long, default_value_t = 10_000)]
    pub unordered_keys: u64,
    /// Producer tasks.
    #[arg(long, default_value_t = 4)]
    pub producers: usize,
    /// Relay processes (the template's reserved concurrency is 2: one scheduled run overlapping the next).
    #[arg(long, default_value_t = 2)]
    pub relays: usize,
    /// Length of each simulated relay invocation (the template's `RelayTimeoutSeconds`).
    #[arg(long, default_value_t = 75)]
    pub invocation_secs: u64,
    /// Open a long transaction (a `REPEATABLE READ` snapshot pinning the xmin horizon) at this minute.
    #[arg(long)]
    pub long_transaction_at: Option<u32>,
    /// How many minutes the long transaction stays open.
    #[arg(long, default_value_t = 10)]
    pub long_transaction_minutes: u32,
    /// Give up (and fail) when the pipeline has not drained this long after the producers stop.
    #[arg(long, default_value_t = 300)]
    pub drain_timeout_secs: u64,
    /// Seed of the producers' choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Check the command: 4 minutes of 10 s at 200 events/s, retention 1 minute, 30 s invocations.
    #[arg(long)]
    pub quick: bool,
    /// Directory for `minutes.jsonl`, `sustained.json` and the workers' logs.
    #[arg(long, default_value = "target/outbox-dev/sustained")]
    pub out: PathBuf,
    /// Add the run to `DIR/benchmarks.md`, `DIR/benchmarks/*.svg` and `DIR/benchmarks/figures.json` (e.g. docs).
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// The executable to run the workers with [default: this one]; tests pass the `outbox-dev` binary.
    #[arg(long, hide = true)]
    pub worker_exe: Option<PathBuf>,
}

#[derive(clap::Parser)]
struct Wrapper {
    #[command(flatten)]
    args: SustainedArgs,
}

impl SustainedArgs {
    /// The arguments as the command line `outbox-dev bench sustained ARGS…` would give them.
    pub fn parse(args: &[&str]) -> anyhow::Result<SustainedArgs> {
        use clap::Parser;
        let argv = std::iter::once("sustained").chain(args.iter().copied());
        Ok(Wrapper::try_parse_from(argv)?.args)
    }

    /// `--quick`'s sizes, where the command line left the defaults.
    pub(super) fn effective(mut self) -> SustainedArgs {
        if self.quick {
            self.minutes = self.minutes.min(4);
            self.minute_secs = self.minute_secs.min(10);
            self.rate = self.rate.min(200.0);
            self.retention_minutes = self.retention_minutes.min(1.0);
            self.invocation_secs = self.invocation_secs.min(30);
            self.ordered_keys = self.ordered_keys.min(50);
            self.unordered_keys = self.unordered_keys.min(500);
            self.drain_timeout_secs = self.drain_timeout_secs.min(120);
        }
        self
    }

    /// The retention window as `*_HOURS` settings read it.
    pub(super) fn retention_hours(&self) -> f64 {
        self.retention_minutes * self.minute_secs as f64 / 3600.0
    }
}
