//! The arguments of `outbox-dev bench report`.

use std::path::PathBuf;

use clap::Args;
use outbox_cli::util::DbArgs;

use crate::bench::batched;

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Small sizes and one round per point (about two minutes in a release build): CI, a quick look. The
    /// figures are for checking the command, not for quoting.
    #[arg(long)]
    pub(super) quick: bool,
    /// Directory for `benchmarks.md`; plots and `figures.json` go to its `benchmarks/` subdirectory.
    #[arg(long, default_value = "docs")]
    pub(super) out: PathBuf,
    /// Rounds per measured point (default 3; 1 with --quick).
    #[arg(long)]
    pub(super) rounds: Option<usize>,
    /// Events per phase of the xmin-pin scenario (default 100000; 10000 with --quick).
    #[arg(long)]
    pub(super) xmin_events: Option<u64>,
    /// Events per QStash message (`RELAY_DELIVERY_BATCH`) the batched-deliveries scenarios compare,
    /// comma-separated; the smallest is the baseline the others are compared with. Default: 1 and the relay's
    /// default.
    #[arg(long, value_delimiter = ',', default_values_t = batched::default_ns())]
    pub(super) delivery_batch: Vec<u32>,
    /// The page whose figures block (between `<!-- figures:begin -->` and `<!-- figures:end -->`) is rewritten
    /// from the new figures [default: README.md in the parent directory of --out]. A page that is missing or has
    /// no block is left alone.
    #[arg(long)]
    pub(super) readme: Option<PathBuf>,
    #[command(flatten)]
    pub(super) db: DbArgs,
}
