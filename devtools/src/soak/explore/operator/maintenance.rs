//! The maintenance actions: `outbox prune` (the command's own function) at a short outbox retention, or the
//! relay's partition maintenance alone; then a check that no pending or dead row went.

use std::time::Duration;

use super::state::Operator;
use crate::soak::explore::history::Outcome;
use crate::soak::explore::retry::{Failure, attempt, retry};

impl Operator {
    /// `outbox prune` (the command's own function) at a short outbox retention, or the partition maintenance
    /// alone with narrow partitions; then checks that no pending or dead row went.
    pub(super) async fn prune(&mut self, retention_secs: u32, partitions_only: bool) -> Outcome {
        let keep: Vec<i64> = match retry(|| {
            sqlx::query_scalar(
                "SELECT id FROM outbox WHERE dispatched_at IS NULL OR dead_lettered_at IS NOT NULL",
            )
            .fetch_all(&self.db)
        })
        .await
        {
            Ok(k) => k,
            Err(e) => return Outcome::Failed(e.to_string()),
        };
        let retention = Duration::from_secs(retention_secs.into());
        let outcome = attempt(|| async {
            let r: anyhow::Result<String> = if partitions_only {
                let settings = outbox::internals::partitions::PartitionSettings {
                    min_rows: 200,
                    ..outbox::internals::partitions::PartitionSettings::new(
                        retention,
                        Duration::from_secs(10),
                    )
                };
                let rep = outbox::internals::partitions::maintain(&self.odb, settings).await;
                match rep.error {
                    Some(e) => Err(anyhow::anyhow!(e)),
                    None => Ok(format!(
                        "{} dropped, {} survivors moved, {} made, {} busy, {} held by a replay",
                        rep.dropped, rep.survivors_moved, rep.created, rep.busy, rep.held
                    )),
                }
            } else {
                let args = outbox_cli::prune::PruneArgs {
                    db: outbox_cli::util::DbArgs {
                        database_url: self.url.clone(),
                    },
                    outbox_hours: Some(f64::from(retention_secs) / 3600.0),
                    processed_hours: None,
                    dead_letters_days: 30.0,
                    batch: 1000,
                    json: false,
                };
                prune_command(args).await.map(|r| {
                    format!(
                        "{} partitions, {} rows pruned",
                        r.outbox_partitions, r.outbox
                    )
                })
            };
            r.map_err(|e| Failure::Transient(format!("{e:#}")))
        })
        .await;
        if let Some(gone) = self.gone(&keep).await
            && gone > 0
        {
            self.history().outside_selection.push(format!(
                "{}: {gone} pending or dead outbox rows were deleted",
                if partitions_only {
                    "partition maintenance"
                } else {
                    "prune"
                },
            ));
        }
        outcome
    }
}

/// `outbox prune` itself, its output discarded. Its writer is not `Send`, so it runs on a runtime of its own.
async fn prune_command(
    args: outbox_cli::prune::PruneArgs,
) -> anyhow::Result<outbox_cli::prune::PruneReport> {
    tokio::task::spawn_blocking(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(outbox_cli::prune::run(args, &mut std::io::sink()))
    })
    .await?
}
