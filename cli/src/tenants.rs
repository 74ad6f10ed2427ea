//! `outbox tenants list|pause|resume`: the backlog and lag per fairness key (a tenant), and holding one tenant's
//! events in the outbox while the others flow. The rules are `outbox::fairness`'s (decision record 0076); this
//! module parses and prints, and with `--qstash` also pauses (resumes) the tenant's flow-control keys at QStash
//! (`flow_control`), where its already published messages wait.

use std::io::Write;

use anyhow::Context;
use clap::{Args, Subcommand};
use outbox::fairness::{self, PauseError, PauseOutcome};

use crate::flow_control::{FlowAction, QstashArgs};
use crate::status::{thousands, write_tenants};
use crate::util::{self, DbArgs};

/// `outbox tenants …`.
#[derive(Subcommand, Debug)]
pub enum TenantsCommand {
    /// The fairness keys with the oldest waiting events (their backlog and lag), then every paused key.
    List(ListArgs),
    /// Holds a tenant's events in the outbox (waiting and new ones) until `outbox tenants resume`; with --qstash,
    /// also pauses its flow-control keys at QStash (messages already published wait there).
    Pause(PauseArgs),
    /// Makes a paused tenant's events due again, oldest first; with --qstash, resumes its flow-control keys too.
    Resume(ResumeArgs),
}

/// `outbox tenants list`.
#[derive(Args, Debug)]
pub struct ListArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Only this topic's waiting events (paused keys are listed whatever the topic).
    #[arg(long)]
    pub topic: Option<String>,
    /// At most this many keys with waiting events (1-1000).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(i64).range(1..=1000))]
    pub limit: i64,
    /// One JSON array.
    #[arg(long)]
    pub json: bool,
}

/// `outbox tenants pause`.
#[derive(Args, Debug)]
pub struct PauseArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// The fairness key (1-64 characters of A-Z a-z 0-9 . _ - :).
    pub key: String,
    /// Why (shown by `outbox status`, `tenants list` and the console).
    #[arg(long)]
    pub reason: Option<String>,
    /// Who pauses it (shown with the pause).
    #[arg(long, default_value = "cli")]
    pub by: String,
    #[command(flatten)]
    pub qstash: QstashArgs,
    /// One JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `outbox tenants resume`.
#[derive(Args, Debug)]
pub struct ResumeArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// The fairness key.
    pub key: String,
    #[command(flatten)]
    pub qstash: QstashArgs,
    /// One JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Runs a `tenants` subcommand.
pub async fn run(cmd: TenantsCommand, out: &mut dyn Write) -> anyhow::Result<()> {
    match cmd {
        TenantsCommand::List(a) => list(a, out).await,
        TenantsCommand::Pause(a) => {
            let change = Change {
                key: &a.key,
                action: FlowAction::Pause,
                qstash: &a.qstash,
                json: a.json,
            };
            change
                .run(
                    &a.db,
                    async |conn| fairness::pause(conn, &a.key, &a.by, a.reason.as_deref()).await,
                    out,
                )
                .await
        }
        TenantsCommand::Resume(a) => {
            let change = Change {
                key: &a.key,
                action: FlowAction::Resume,
                qstash: &a.qstash,
                json: a.json,
            };
            change
                .run(
                    &a.db,
                    async |conn| fairness::resume(conn, &a.key).await,
                    out,
                )
                .await
        }
    }
}

async fn list(args: ListArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let pool = args.db.connect().await?;
    let keys = fairness::backlog(
        &mut *pool.acquire().await?,
        args.topic.as_deref(),
        args.limit,
    )
    .await
    .context(
        "reading the backlog per fairness key (is the schema migrated? run `outbox migrate`)",
    )?;
    if args.json {
        writeln!(out, "{}", serde_json::to_string(&keys)?)?;
    } else {
        write_tenants(&keys, out)?;
    }
    Ok(())
}

/// A pause or a resume: the database first, then (with `--qstash`) the tenant's flow-control keys.
struct Change<'a> {
    key: &'a str,
    action: FlowAction,
    qstash: &'a QstashArgs,
    json: bool,
}

impl Change<'_> {
    async fn run(
        &self,
        db: &DbArgs,
        work: impl AsyncFnOnce(&mut sqlx::PgConnection) -> Result<PauseOutcome, PauseError>,
        out: &mut dyn Write,
    ) -> anyhow::Result<()> {
        // Refused before anything changes: --qstash without QStash's address or token, or QStash refusing the
        // list of the tenant's flow-control keys.
        let client = self.qstash.client()?;
        let flows = match &client {
            Some(c) => Some(
                c.keys_of(self.key)
                    .await
                    .context("nothing was changed (neither in the outbox nor at QStash)")?,
            ),
            None => None,
        };
        let pool = db.connect().await?;
        let mut conn = pool.acquire().await?;
        let outcome = work(&mut conn).await.map_err(|e| match e {
            PauseError::InvalidKey(e) => anyhow::Error::new(e),
            e @ PauseError::Database(_) => {
                anyhow::Error::new(e).context("is the schema migrated? run `outbox migrate`")
            }
        })?;
        if let (Some(c), Some(keys)) = (&client, &flows) {
            c.apply(keys, self.action).await.with_context(|| {
                format!(
                    "the outbox is done ({}), QStash is not: run the command again",
                    self.said(&outcome)
                )
            })?;
        }
        if self.json {
            writeln!(
                out,
                "{}",
                serde_json::json!({
                    "fairness_key": self.key,
                    "action": self.action.verb(),
                    "outcome": outcome,
                    "qstash_flow_control_keys": flows,
                })
            )?;
            return Ok(());
        }
        writeln!(out, "{}", self.said(&outcome))?;
        if let Some(flows) = flows {
            if flows.is_empty() {
                writeln!(
                    out,
                    "QStash: no flow-control key of {} (nothing of it waits there in a tenant lane)",
                    util::printable(self.key)
                )?;
            }
            for f in flows {
                writeln!(
                    out,
                    "QStash: {} flow-control key {}",
                    self.action.past(),
                    util::printable(&f)
                )?;
            }
        }
        Ok(())
    }

    fn said(&self, o: &PauseOutcome) -> String {
        said(self.action, self.key, o)
    }
}

/// What a pause or resume changed, in words: `paused acme: 1,234 waiting events held`, `acme was already paused`
/// (the CLI's line, the console's report).
pub fn said(action: FlowAction, key: &str, o: &PauseOutcome) -> String {
    let key = util::printable(key);
    let n = thousands(o.events);
    match (action, o.changed) {
        (FlowAction::Pause, true) => format!("paused {key}: {n} waiting events held"),
        (FlowAction::Pause, false) if o.events > 0 => {
            format!("{key} was already paused ({n} more waiting events held)")
        }
        (FlowAction::Pause, false) => format!("{key} was already paused"),
        (FlowAction::Resume, true) => format!("resumed {key}: {n} waiting events due again"),
        (FlowAction::Resume, false) if o.events > 0 => {
            format!("{key} was not paused ({n} held events due again)")
        }
        (FlowAction::Resume, false) => format!("{key} was not paused"),
    }
}
