//! The arguments of `outbox-dev soak` (steady and random schedules alike).

use std::path::PathBuf;

use clap::{Args, Parser};
use outbox_cli::util::DbArgs;

/// Arguments of `outbox-dev soak`.
#[derive(Args, Debug, Clone)]
pub struct SoakArgs {
    /// The Postgres server; the soak runs in a fresh database (--database) on it.
    #[command(flatten)]
    pub db: DbArgs,
    /// Name of the soak's database on DATABASE_URL's server (dropped first if it exists, then created).
    #[arg(long, default_value = "outbox_soak")]
    pub database: String,
    /// Events to write (half to the ordered topic, half to the unordered one).
    #[arg(long, default_value_t = 20_000)]
    pub events: u64,
    /// Partition keys.
    #[arg(long, default_value_t = 500)]
    pub keys: u64,
    /// One event in N is poison (dead-lettered by the consumer); 0 disables.
    #[arg(long, default_value_t = 50)]
    pub poison_every: u64,
    /// Events per second, all producers together.
    #[arg(long, default_value_t = 150.0)]
    pub rate: f64,
    /// Concurrent producer tasks.
    #[arg(long, default_value_t = 4)]
    pub producers: usize,
    /// Relay processes.
    #[arg(long, default_value_t = 2)]
    pub relays: usize,
    /// Mean time between two chaos actions (a SIGKILL of a relay, the consumer or the callback receiver, or a
    /// pg_terminate_backend); each waits a random 0.5x to 1.5x of it. 0 disables the chaos.
    #[arg(long, default_value_t = 2000)]
    pub kill_every_ms: u64,
    /// A QStash outage: the dev server fails every publish (500) for this many seconds, from --outage-at-secs.
    #[arg(long, default_value_t = 0)]
    pub outage_secs: u64,
    /// When the outage starts, seconds after the producers start.
    #[arg(long, default_value_t = 10)]
    pub outage_at_secs: u64,
    /// A shell command that restarts Postgres, run once when half the events are written (e.g.
    /// "pg_ctlcluster --skip-systemctl-redirect 15 main restart"). Never in a shared test run.
    #[arg(long)]
    pub pg_restart_cmd: Option<String>,
    /// Seed of the chaos, the producers' choices and the dev server's faults.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Give up (and fail) when the pipeline has not drained this long after the producers and the outage end.
    #[arg(long, default_value_t = 300)]
    pub drain_timeout_secs: u64,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Directory for the workers' logs [default: target/outbox-dev/soak-{UTC time}-{pid}].
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// Seconds between two progress lines on stderr.
    #[arg(long, default_value_t = 10)]
    pub progress_secs: u64,
    /// The executable to run the workers with [default: this one]; tests pass the `outbox-dev` binary.
    #[arg(long, hide = true)]
    pub worker_exe: Option<PathBuf>,
    /// `steady`: the scenario the flags above describe. `random`: the schedule explorer — a timeline of traffic,
    /// faults (a Postgres crash among them) and operator actions drawn from --seed over --minutes, run on a
    /// Postgres cluster of its own (DATABASE_URL and --database are not used), then checked per event and
    /// subscriber; a violation prints the seed, the schedule and the events' histories.
    #[arg(long, value_enum, default_value_t = ScheduleKind::Steady)]
    pub schedule: ScheduleKind,
    /// Length of a random schedule in minutes (the drain comes after).
    #[arg(long, default_value_t = 2.0)]
    pub minutes: f64,
    /// Print the random schedule of --seed and --minutes, and exit.
    #[arg(long)]
    pub print_schedule: bool,
}

/// Which schedule a soak runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ScheduleKind {
    /// Steady producers, kills, the dev server's faults, one subscriber (`--events`, `--kill-every-ms`, …).
    Steady,
    /// A seeded random timeline of traffic, faults and operator actions (`--seed`, `--minutes`).
    Random,
}

#[derive(Parser)]
struct Wrapper {
    #[command(flatten)]
    args: SoakArgs,
}

impl SoakArgs {
    /// The arguments as the command line `outbox-dev soak ARGS…` would give them (defaults for the rest).
    pub fn parse(args: &[&str]) -> anyhow::Result<SoakArgs> {
        let argv = std::iter::once("soak").chain(args.iter().copied());
        Ok(Wrapper::try_parse_from(argv)?.args)
    }
}
