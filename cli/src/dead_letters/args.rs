//! The arguments of `outbox dead-letters` (clap), and the small parsers and formatters the commands share.

use std::io::{BufRead, IsTerminal, Write};

use anyhow::bail;
use chrono::{DateTime, NaiveDate, TimeDelta, Utc};
use clap::{Args, Subcommand};
use outbox::DeadLetterId;
use outbox::dead_letters::{self, Filter, Source};

use crate::util::{self, DbArgs};

const REDRIVE_ABOUT: &str = "Redrive one dead letter (by id) or every unhandled one matching the filters.

The event goes back through the outbox: it keeps its outbox id (the consumer's dedupe key, so an event that was \
applied after all is not applied twice) and gets a fresh QStash deduplication id (outbox-<id>-r<n>), so QStash's \
10-minute dedup window cannot swallow it. A pruned outbox row is re-inserted from the dead letter with the same id.

Ordered topics: if the event is its key's head (the key is blocked by it), the key is unblocked and the event is \
delivered first, then everything that queued behind it, in order. A \"middle\" event — one its key has already moved \
past (later events were delivered, the head was skipped, or its row was pruned) — would be delivered AFTER later \
events of its key: it is refused unless --out-of-order, which republishes it as an UNORDERED event (its sequence is \
dropped, so the consumer's per-key order check does not refuse it as late).

A bulk redrive needs at least one filter, processes each dead letter in its own transaction, skips (and lists) \
middle events unless --out-of-order, and asks for confirmation unless --yes (without a terminal it refuses \
unless --yes).";

/// `outbox dead-letters …`
#[derive(Subcommand, Debug)]
pub enum DeadLettersCommand {
    /// List dead letters, oldest first (unhandled ones only unless --include-redriven), a page at a time.
    List(ListArgs),
    /// Show everything about one dead letter: payload, error, attempts, QStash's or the consumer's response, and
    /// the event's current state.
    Show(ShowArgs),
    #[command(about = "Redrive one dead letter (by id) or a filtered set", long_about = REDRIVE_ABOUT)]
    Redrive(RedriveArgs),
    /// Delete dead letters matching the filters (at least one). The outbox rows are not touched: dead events stay
    /// in the outbox until `outbox prune --dead-letters-days` removes them. Dead letters whose event blocks an
    /// ordered key are kept (redrive them instead).
    Purge(PurgeArgs),
}

/// Which dead letters.
#[derive(Args, Debug, Clone, Default)]
pub struct FilterArgs {
    /// Only this topic.
    #[arg(long)]
    pub topic: Option<String>,
    /// Only this source: relay (publishing gave up) or qstash (delivery gave up).
    #[arg(long, value_parser = parse_source)]
    pub source: Option<Source>,
    /// Only this partition key.
    #[arg(long)]
    pub key: Option<String>,
    /// Recorded at or after: RFC 3339 (2026-03-01T12:00:00Z), a date (2026-03-01, UTC) or an age (30m, 6h, 7d).
    #[arg(long, value_parser = parse_time)]
    pub since: Option<DateTime<Utc>>,
    /// Recorded before (same formats as --since).
    #[arg(long, value_parser = parse_time)]
    pub until: Option<DateTime<Utc>>,
    /// Only this subscriber's (`default` for the relay's CONSUMER_URL; see `outbox subscribers`). A redrive
    /// requeues the event for that subscriber only.
    #[arg(long, value_parser = parse_subscriber)]
    pub subscriber: Option<String>,
}

fn parse_subscriber(s: &str) -> Result<String, String> {
    outbox::subscribers::parse_name(s).map_err(|e| e.to_string())
}

impl FilterArgs {
    /// The library filter.
    pub fn filter(&self) -> Filter {
        Filter {
            topic: self.topic.clone().map(Into::into),
            source: self.source,
            key: self.key.clone().map(Into::into),
            since: self.since,
            until: self.until,
            subscriber: self.subscriber.clone(),
            ..Filter::default()
        }
    }

    /// The set filters as (flag, value): every field by name, so a field added to [`FilterArgs`] does not compile
    /// here until it is carried — into the words of a selection ([`Self::describe`]) and the next page's command
    /// ([`Self::as_flags`]), which then never widens it.
    pub(super) fn parts(&self) -> Vec<(&'static str, String)> {
        let FilterArgs {
            topic,
            source,
            key,
            since,
            until,
            subscriber,
        } = self;
        [
            ("topic", topic.clone()),
            ("source", source.map(|s| s.as_str().to_owned())),
            ("key", key.clone()),
            (
                "subscriber",
                subscriber
                    .as_deref()
                    .map(|s| outbox::subscribers::label(s).to_owned()),
            ),
            ("since", since.map(|t| t.to_rfc3339())),
            ("until", until.map(|t| t.to_rfc3339())),
        ]
        .into_iter()
        .filter_map(|(flag, value)| Some((flag, value?)))
        .collect()
    }

    /// The filters in words: `topic=orders subscriber=shipping`.
    pub(super) fn describe(&self) -> String {
        self.parts()
            .iter()
            .map(|(flag, value)| format!("{flag}={}", util::printable(value)))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The filters as command-line flags: ` --topic orders --subscriber shipping`.
    pub(super) fn as_flags(&self) -> String {
        self.parts()
            .iter()
            .map(|(flag, value)| format!(" --{flag} {}", util::printable(&shell_quote(value))))
            .collect()
    }
}

/// `list`.
#[derive(Args, Debug)]
pub struct ListArgs {
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Also list dead letters already redriven or resolved (delivered after all).
    #[arg(long, alias = "all")]
    pub include_redriven: bool,
    /// Start after this id (the cursor printed at the end of the previous page).
    #[arg(long)]
    pub after: Option<DeadLetterId>,
    /// Page size.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=10000))]
    pub limit: u32,
    /// One JSON object: {"items": [...], "next_after": id|null}.
    #[arg(long)]
    pub json: bool,
}

/// `show`.
#[derive(Args, Debug)]
pub struct ShowArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// The dead letter's id.
    pub id: DeadLetterId,
    /// As JSON.
    #[arg(long)]
    pub json: bool,
}

/// `redrive`.
#[derive(Args, Debug)]
pub struct RedriveArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// One dead letter's id (or use filters for a bulk redrive).
    #[arg(conflicts_with_all = ["topic", "source", "key", "since", "until", "subscriber"])]
    pub id: Option<DeadLetterId>,
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Also redrive ordered events their key has moved past, as UNORDERED events (applied after later events of
    /// their key).
    #[arg(long)]
    pub out_of_order: bool,
    /// Do not ask for confirmation (needed without a terminal).
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// JSON lines: one per dead letter, then the totals.
    #[arg(long)]
    pub json: bool,
}

/// `purge`.
#[derive(Args, Debug)]
pub struct PurgeArgs {
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Only dead letters already redriven or resolved.
    #[arg(long)]
    pub handled_only: bool,
    /// Rows deleted per statement.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100000))]
    pub batch: u32,
    /// Do not ask for confirmation (needed without a terminal).
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// One JSON line with the totals.
    #[arg(long)]
    pub json: bool,
}

impl PurgeArgs {
    /// `--handled-only`, or every matching dead letter.
    pub(super) fn scope(&self) -> dead_letters::PurgeScope {
        if self.handled_only {
            dead_letters::PurgeScope::Handled
        } else {
            dead_letters::PurgeScope::Any
        }
    }
}

/// How to ask "are you sure?".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confirm {
    /// Ask on the terminal (stdin).
    Terminal,
    /// No terminal: refuse unless `--yes`.
    NoTerminal,
    /// Answer without asking (tests).
    Answer(bool),
}

impl Confirm {
    /// `Terminal` when stdin is a terminal, else `NoTerminal`.
    pub fn detect() -> Self {
        if std::io::stdin().is_terminal() {
            Confirm::Terminal
        } else {
            Confirm::NoTerminal
        }
    }

    /// Asks (or refuses). `what`: "redrive 12 dead letters".
    pub(super) fn ask(self, yes: bool, what: &str, out: &mut dyn Write) -> anyhow::Result<bool> {
        if yes {
            return Ok(true);
        }
        match self {
            Confirm::Answer(a) => Ok(a),
            Confirm::NoTerminal => bail!(
                "refusing to {what} without confirmation: standard input is not a terminal. Check the selection \
                 (`outbox dead-letters list` with the same filters), then re-run with --yes"
            ),
            Confirm::Terminal => {
                write!(out, "{what}? [y/N] ")?;
                out.flush()?;
                let mut line = String::new();
                std::io::stdin().lock().read_line(&mut line)?;
                Ok(matches!(line.trim(), "y" | "Y" | "yes" | "YES" | "Yes"))
            }
        }
    }
}

fn parse_source(s: &str) -> Result<Source, String> {
    s.parse()
}

/// Parses RFC 3339, a date (UTC midnight), or an age such as `30m`, `6h`, `7d`, `2w` (that long ago).
pub fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    parse_time_at(s, Utc::now())
}

/// [`parse_time`] relative to `now`.
pub fn parse_time_at(s: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
    let s = s.trim();
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    if let Ok(d) = NaiveDate::parse_from_str(s, "%Y-%m-%d")
        && let Some(t) = d.and_hms_opt(0, 0, 0)
    {
        return Ok(t.and_utc());
    }
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: i64 = n.parse().map_err(|_| {
        format!("{s:?} is not a time: use RFC 3339 (2026-03-01T12:00:00Z), a date (2026-03-01) or an age (30m, 6h, 7d)")
    })?;
    let delta = match unit {
        "s" => TimeDelta::try_seconds(n),
        "m" | "min" => TimeDelta::try_minutes(n),
        "h" => TimeDelta::try_hours(n),
        "d" => TimeDelta::try_days(n),
        "w" => TimeDelta::try_weeks(n),
        _ => None,
    }
    .ok_or_else(|| format!("{s:?}: unknown unit {unit:?} (use s, m, h, d or w)"))?;
    now.checked_sub_signed(delta)
        .ok_or_else(|| format!("{s:?} is too far back"))
}

pub(super) fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/@".contains(&b))
    {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

pub(super) fn time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S").to_string()
}

pub(super) fn opt<T: ToString>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times() {
        let now = DateTime::parse_from_rfc3339("2026-03-10T12:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(
            parse_time_at("2026-03-01T08:30:00+01:00", now).unwrap(),
            DateTime::parse_from_rfc3339("2026-03-01T07:30:00Z").unwrap()
        );
        assert_eq!(
            parse_time_at("2026-03-01", now).unwrap(),
            DateTime::parse_from_rfc3339("2026-03-01T00:00:00Z").unwrap()
        );
        assert_eq!(
            parse_time_at("30m", now).unwrap(),
            now - TimeDelta::minutes(30)
        );
        assert_eq!(parse_time_at("7d", now).unwrap(), now - TimeDelta::days(7));
        assert!(parse_time_at("7y", now).unwrap_err().contains("unit"));
        assert!(parse_time_at("yesterday", now).is_err());
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("orders"), "orders");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
    }
}
