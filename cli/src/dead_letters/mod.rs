//! `outbox dead-letters` (alias `dlq`): list, show, redrive, purge. Only argument parsing and printing live here;
//! the semantics are `outbox::dead_letters` (decision record 0060).

use std::io::Write;

mod args;
mod change;
mod view;

pub use args::{
    Confirm, DeadLettersCommand, FilterArgs, ListArgs, PurgeArgs, RedriveArgs, ShowArgs,
    parse_time, parse_time_at,
};
use change::{purge, redrive};
use view::{list, show};

/// Runs a `dead-letters` command, printing to `out`.
pub async fn run(
    cmd: DeadLettersCommand,
    out: &mut dyn Write,
    confirm: Confirm,
) -> anyhow::Result<()> {
    match cmd {
        DeadLettersCommand::List(a) => list(a, out).await,
        DeadLettersCommand::Show(a) => show(a, out).await,
        DeadLettersCommand::Redrive(a) => redrive(a, out, confirm).await,
        DeadLettersCommand::Purge(a) => purge(a, out, confirm).await,
    }
}
