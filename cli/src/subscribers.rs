//! `outbox subscribers`: list, add (from now, or with the retained history replayed), replay (resume one), remove.
//! The rules are `outbox::subscribers`'s (decision record 0068); this module parses and prints.

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use outbox::db::{Db, Statements};
use outbox::subscribers::{self, ReplayProgress, Start};

use crate::util::{self, DbArgs};

/// `outbox subscribers …`.
#[derive(Subcommand, Debug)]
pub enum SubscribersCommand {
    /// Every subscriber on record (a topic not listed has only the default one, the relay's CONSUMER_URL).
    List(ListArgs),
    /// Adds a subscriber to a live topic: every event written from now on gets a copy for it; with --from, the
    /// events the outbox still retains from there are replayed to it first, in per-key order, with progress.
    Add(AddArgs),
    /// Resumes a replay that stopped (the command was interrupted, or older transactions kept it waiting).
    Replay(ReplayArgs),
    /// Stops deliveries to a subscriber: its pending and in-flight copies are deleted; its dead letters stay.
    Remove(RemoveArgs),
}

/// `outbox subscribers list`.
#[derive(Args, Debug)]
pub struct ListArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// One JSON array.
    #[arg(long)]
    pub json: bool,
}

/// `outbox subscribers add`.
#[derive(Args, Debug)]
pub struct AddArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// The topic.
    pub topic: String,
    /// The subscriber's name: its consumer's CONSUMER_NAME (or `default` to restore the default subscriber).
    pub name: String,
    /// Its consumer's base URL (deliveries go to {url}/events/{topic}); not for `default`.
    pub url: Option<String>,
    /// Where its history starts: `now` (no history), an outbox id, or an RFC 3339 timestamp.
    #[arg(long, default_value = "now")]
    pub from: Start,
    /// How long to wait for transactions older than the change (they may still write events without it).
    #[arg(long, default_value_t = 60)]
    pub wait_secs: u64,
    /// Record the subscriber and fix its replay, but leave the copying to `outbox subscribers replay`.
    #[arg(long)]
    pub no_replay: bool,
    /// The subscriber existed before (it was removed): add it again with its history (--from). Without it, such
    /// an add is refused with what would and would not be replayed.
    #[arg(long)]
    pub again: bool,
    /// Messages of its replay QStash delivers at once (1-1000; default: the relay's QSTASH_REPLAY_PARALLELISM).
    #[arg(long)]
    pub replay_parallelism: Option<u32>,
    /// One JSON object per line (each replay step, then the result).
    #[arg(long)]
    pub json: bool,
}

/// `outbox subscribers replay`.
#[derive(Args, Debug)]
pub struct ReplayArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// The topic.
    pub topic: String,
    /// The subscriber.
    pub name: String,
    /// How long to wait for transactions older than the subscriber, when its replay's end is not fixed yet.
    #[arg(long, default_value_t = 60)]
    pub wait_secs: u64,
    /// Messages of its replay QStash delivers at once from now on (1-1000; default: leave it as it is).
    #[arg(long)]
    pub replay_parallelism: Option<u32>,
    /// One JSON object per line.
    #[arg(long)]
    pub json: bool,
}

/// `outbox subscribers remove`.
#[derive(Args, Debug)]
pub struct RemoveArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// The topic.
    pub topic: String,
    /// The subscriber (`default` for the relay's CONSUMER_URL).
    pub name: String,
    /// How long to wait for transactions older than the change.
    #[arg(long, default_value_t = 60)]
    pub wait_secs: u64,
    /// One JSON object.
    #[arg(long)]
    pub json: bool,
}

async fn db(args: &DbArgs) -> anyhow::Result<Db> {
    Ok(Db::new(args.connect().await?, Statements::Unnamed))
}

/// Runs a `subscribers` subcommand.
pub async fn run(cmd: SubscribersCommand, out: &mut dyn Write) -> anyhow::Result<()> {
    match cmd {
        SubscribersCommand::List(a) => list(a, out).await,
        SubscribersCommand::Add(a) => add(a, out).await,
        SubscribersCommand::Replay(a) => replay(a, out).await,
        SubscribersCommand::Remove(a) => remove(a, out).await,
    }
}

async fn list(args: ListArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let db = db(&args.db).await?;
    let all = subscribers::list(&db)
        .await
        .context("reading the subscribers (is the schema migrated? run `outbox migrate`)")?;
    if args.json {
        writeln!(out, "{}", serde_json::to_string(&all)?)?;
        return Ok(());
    }
    if all.is_empty() {
        writeln!(
            out,
            "No subscribers on record: every topic delivers to its default subscriber (CONSUMER_URL)."
        )?;
        return Ok(());
    }
    writeln!(
        out,
        "{:<24} {:<20} {:<9} {:<40} replay",
        "topic", "name", "state", "url"
    )?;
    for s in &all {
        let state = if s.removed_at.is_some() {
            "removed"
        } else {
            "live"
        };
        let replay = match &s.replay {
            None => "-".to_owned(),
            Some(r) if r.done_at.is_some() => {
                format!("done ({} copied from #{})", r.copied, r.from)
            }
            Some(r) => format!(
                "under way: {} copied, at #{}",
                r.copied,
                r.done_to.unwrap_or(r.from)
            ),
        };
        let replay = match s.replay_parallelism {
            Some(p) => format!("{replay}; replay parallelism {p}"),
            None => replay,
        };
        writeln!(
            out,
            "{:<24} {:<20} {:<9} {:<40} {}",
            util::printable(&s.topic),
            subscribers::label(&s.name),
            state,
            util::printable(s.url.as_deref().unwrap_or("CONSUMER_URL")),
            replay
        )?;
    }
    Ok(())
}

fn progress_line(json: bool, out: &mut dyn Write, p: &ReplayProgress) -> std::io::Result<()> {
    if json {
        writeln!(out, "{}", serde_json::json!({ "replay": p }))
    } else {
        writeln!(
            out,
            "replay: {} copied so far (this step {}), at event #{} of #{}{}",
            p.total,
            p.copied,
            p.done_to,
            p.to,
            if p.finished {
                ": done, its ordered keys are released"
            } else {
                ""
            }
        )
    }
}

async fn run_replay(
    db: &Db,
    topic: &str,
    name: &str,
    wait: Duration,
    json: bool,
    out: &mut dyn Write,
) -> anyhow::Result<Option<ReplayProgress>> {
    let mut write_error = None;
    let last = subscribers::replay(db, topic, name, wait, |p| {
        if let Err(e) = progress_line(json, out, p) {
            write_error.get_or_insert(e);
        }
    })
    .await?;
    if let Some(e) = write_error {
        return Err(e.into());
    }
    Ok(last)
}

async fn add(args: AddArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let name = subscribers::parse_name(&args.name)?;
    // Refused before anything changes (the subscriber would otherwise be added and the command fail after).
    subscribers::check_replay_parallelism(&name, args.replay_parallelism)?;
    let db = db(&args.db).await?;
    let wait = Duration::from_secs(args.wait_secs);
    let (topic, url) = (args.topic.as_str(), args.url.as_deref());
    let mut added = if args.again {
        subscribers::add_again(&db, topic, &name, url, args.from, wait).await?
    } else {
        subscribers::add(&db, topic, &name, url, args.from, wait).await?
    };
    // Before the copying: the relay delivers replayed copies as soon as each chunk commits.
    if let Some(p) = args.replay_parallelism {
        added.subscriber =
            subscribers::set_replay_parallelism(&db, &args.topic, &name, Some(p)).await?;
    }
    if !args.json {
        writeln!(
            out,
            "{} is a subscriber of {}: events written from now on are delivered to {}.",
            subscribers::label(&name),
            util::printable(&args.topic),
            util::printable(added.subscriber.url.as_deref().unwrap_or("CONSUMER_URL"))
        )?;
        if let Some(n) = added.to_replay {
            writeln!(out, "Retained events to replay: {n}.")?;
        }
    }
    let last = if added.to_replay.is_some() && !args.no_replay {
        run_replay(&db, &args.topic, &name, wait, args.json, out).await?
    } else {
        None
    };
    if args.json {
        writeln!(
            out,
            "{}",
            serde_json::json!({ "added": added, "replay": last })
        )?;
    } else if added.to_replay.is_some() && args.no_replay {
        writeln!(
            out,
            "Replay recorded, not run: `outbox subscribers replay {} {}` copies it.",
            util::printable(&args.topic),
            subscribers::label(&name)
        )?;
    }
    Ok(())
}

async fn replay(args: ReplayArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let name = subscribers::parse_name(&args.name)?;
    let db = db(&args.db).await?;
    if let Some(p) = args.replay_parallelism {
        subscribers::set_replay_parallelism(&db, &args.topic, &name, Some(p)).await?;
    }
    let last = run_replay(
        &db,
        &args.topic,
        &name,
        Duration::from_secs(args.wait_secs),
        args.json,
        out,
    )
    .await?;
    if last.is_none() && !args.json {
        writeln!(
            out,
            "No replay under way for {} of {}.",
            subscribers::label(&name),
            util::printable(&args.topic)
        )?;
    }
    Ok(())
}

async fn remove(args: RemoveArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let name = subscribers::parse_name(&args.name)?;
    let db = db(&args.db).await?;
    let removed =
        subscribers::remove(&db, &args.topic, &name, Duration::from_secs(args.wait_secs)).await?;
    if args.json {
        writeln!(out, "{}", serde_json::json!({ "removed": removed }))?;
    } else {
        writeln!(
            out,
            "{} no longer subscribes to {}: {} undelivered copies and {} ordered keys deleted; its dead \
             letters stay (`outbox dead-letters list --subscriber {}`).",
            subscribers::label(&name),
            util::printable(&args.topic),
            removed.copies_deleted,
            removed.keys_deleted,
            subscribers::label(&name)
        )?;
    }
    Ok(())
}
