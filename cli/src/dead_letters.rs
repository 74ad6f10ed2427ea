//! `outbox dead-letters` (alias `dlq`): list, show, redrive, purge. Only argument parsing and printing live here;
//! the semantics are `outbox::dead_letters` (decision record 0060).

use std::io::{BufRead, IsTerminal, Write};

use anyhow::{Context, bail};
use chrono::{DateTime, NaiveDate, TimeDelta, Utc};
use clap::{Args, Subcommand};
use outbox::dead_letters::{
    self, BulkOutcome, Filter, ListQuery, RedriveOptions, RedriveOrder, Redriven, Source,
};

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
}

impl FilterArgs {
    /// The library filter.
    pub fn filter(&self) -> Filter {
        Filter {
            topic: self.topic.clone(),
            source: self.source,
            key: self.key.clone(),
            since: self.since,
            until: self.until,
        }
    }

    fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(t) = &self.topic {
            parts.push(format!("topic={}", util::printable(t)));
        }
        if let Some(s) = self.source {
            parts.push(format!("source={}", s.as_str()));
        }
        if let Some(k) = &self.key {
            parts.push(format!("key={}", util::printable(k)));
        }
        if let Some(s) = self.since {
            parts.push(format!("since={}", s.to_rfc3339()));
        }
        if let Some(u) = self.until {
            parts.push(format!("until={}", u.to_rfc3339()));
        }
        parts.join(" ")
    }

    fn as_flags(&self) -> String {
        let mut s = String::new();
        if let Some(t) = &self.topic {
            s.push_str(&format!(" --topic {}", util::printable(&shell_quote(t))));
        }
        if let Some(x) = self.source {
            s.push_str(&format!(" --source {}", x.as_str()));
        }
        if let Some(k) = &self.key {
            s.push_str(&format!(" --key {}", util::printable(&shell_quote(k))));
        }
        if let Some(x) = self.since {
            s.push_str(&format!(" --since {}", x.to_rfc3339()));
        }
        if let Some(x) = self.until {
            s.push_str(&format!(" --until {}", x.to_rfc3339()));
        }
        s
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
    pub after: Option<i64>,
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
    pub id: i64,
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
    #[arg(conflicts_with_all = ["topic", "source", "key", "since", "until"])]
    pub id: Option<i64>,
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
    fn ask(self, yes: bool, what: &str, out: &mut dyn Write) -> anyhow::Result<bool> {
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

fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/@".contains(&b))
    {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

fn time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S").to_string()
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
}

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

async fn list(a: ListArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let pool = a.db.connect().await?;
    let mut conn = pool.acquire().await?;
    let page = dead_letters::list(
        &mut conn,
        &ListQuery {
            filter: a.filter.filter(),
            include_handled: a.include_redriven,
            after: a.after,
            limit: a.limit,
        },
    )
    .await
    .context("listing dead letters")?;
    if a.json {
        writeln!(out, "{}", serde_json::to_string(&page)?)?;
        return Ok(());
    }
    if page.items.is_empty() {
        writeln!(
            out,
            "no {}dead letters{}{}",
            if a.include_redriven { "" } else { "unhandled " },
            if a.filter.filter().is_empty() {
                String::new()
            } else {
                format!(" matching {}", a.filter.describe())
            },
            if a.after.is_some() {
                " after that cursor"
            } else {
                ""
            },
        )?;
        return Ok(());
    }
    writeln!(
        out,
        "{:>7}  {:<19}  {:<6}  {:<16}  {:<18}  {:>5}  {:>8}  {:>4}  {:>6}  {:<9}  ERROR",
        "ID", "RECORDED (UTC)", "SOURCE", "TOPIC", "KEY", "SEQ", "EVENT", "ATT", "STATUS", "STATE"
    )?;
    for d in &page.items {
        writeln!(
            out,
            "{:>7}  {:<19}  {:<6}  {:<16}  {:<18}  {:>5}  {:>8}  {:>4}  {:>6}  {:<9}  {}",
            d.id,
            time(d.created_at),
            util::one_line(&d.source, 6),
            util::one_line(d.topic.as_deref().unwrap_or("?"), 16),
            util::one_line(d.partition_key.as_deref().unwrap_or("?"), 18),
            opt(d.seq),
            opt(d.outbox_id),
            opt(d.attempts),
            opt(d.status),
            d.state(),
            util::one_line(&d.error, 80)
        )?;
    }
    match page.next_after {
        Some(next) => writeln!(
            out,
            "\nmore: outbox dead-letters list --after {next} --limit {}{}{}",
            a.limit,
            a.filter.as_flags(),
            if a.include_redriven {
                " --include-redriven"
            } else {
                ""
            }
        )?,
        None => writeln!(out, "\n(end of list)")?,
    }
    writeln!(
        out,
        "details: outbox dead-letters show <ID>    redrive: outbox dead-letters redrive <ID>"
    )?;
    Ok(())
}

async fn show(a: ShowArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let pool = a.db.connect().await?;
    let mut conn = pool.acquire().await?;
    let Some(d) = dead_letters::get(&mut conn, a.id).await? else {
        bail!(
            "dead letter #{} does not exist (list them with `outbox dead-letters list --include-redriven`)",
            a.id
        );
    };
    let event = match d.outbox_id {
        Some(id) => dead_letters::event_state(&mut conn, id).await?,
        None => None,
    };
    if a.json {
        writeln!(
            out,
            "{}",
            serde_json::json!({"dead_letter": d, "state": d.state(), "event": event})
        )?;
        return Ok(());
    }
    writeln!(out, "dead letter #{}  ({})", d.id, d.state())?;
    writeln!(out, "  recorded      {} UTC", time(d.created_at))?;
    writeln!(
        out,
        "  source        {} ({})",
        util::printable(&d.source),
        if d.source == "relay" {
            "the relay gave up publishing"
        } else {
            "QStash gave up delivering"
        }
    )?;
    writeln!(out, "  natural id    {}", util::printable(&d.natural_id))?;
    writeln!(out, "  event         {}", opt(d.outbox_id))?;
    writeln!(
        out,
        "  topic / key   {} / {}{}",
        util::printable(d.topic.as_deref().unwrap_or("?")),
        util::printable(d.partition_key.as_deref().unwrap_or("?")),
        d.seq.map(|s| format!("  (seq {s})")).unwrap_or_default()
    )?;
    writeln!(out, "  attempts      {}", opt(d.attempts))?;
    writeln!(out, "  status        {}", opt(d.status))?;
    writeln!(out, "  error         {}", util::printable(&d.error))?;
    if let Some(m) = &d.qstash_message_id {
        writeln!(out, "  qstash msg    {}", util::printable(m))?;
    }
    if let Some(m) = &d.dlq_id {
        writeln!(out, "  qstash dlq id {}", util::printable(m))?;
    }
    if let Some(t) = d.redriven_at {
        writeln!(out, "  redriven at   {} UTC", time(t))?;
    }
    if let Some(t) = d.resolved_at {
        let how = match d.resolution.as_deref() {
            Some("applied") => {
                "applied: the consumer's dedupe row shows it applied; QStash gave up because every response was lost"
            }
            _ => "delivered after all",
        };
        writeln!(out, "  resolved at   {} UTC ({how})", time(t))?;
    }
    if let Some(r) = &d.response_body {
        writeln!(out, "  response      {}", util::one_line(r, 2000))?;
    }
    match (&d.payload, &d.body) {
        (Some(p), _) => writeln!(
            out,
            "  payload\n{}",
            indent(&util::printable_lines(&serde_json::to_string_pretty(p)?))
        )?,
        (None, Some(b)) => writeln!(
            out,
            "  body (not JSON, {} bytes)\n    {}",
            b.len(),
            util::one_line(&String::from_utf8_lossy(b), 2000)
        )?,
        (None, None) => writeln!(out, "  payload       (none stored)")?,
    }
    if let Some(h) = &d.headers {
        writeln!(out, "  headers       {}", util::printable(&h.to_string()))?;
    }
    if let Some(p) = &d.parse_error {
        writeln!(out, "  parse error   {}", util::printable(p))?;
    }
    if let Some(raw) = &d.raw_callback {
        writeln!(
            out,
            "  raw callback  ({} bytes) {}",
            raw.len(),
            util::one_line(&String::from_utf8_lossy(raw), 2000)
        )?;
    }
    match (d.outbox_id, &event) {
        (None, _) => writeln!(
            out,
            "\nnot linked to an outbox event: it cannot be redriven (republish by hand if needed, then purge it)"
        )?,
        (Some(id), None) => writeln!(
            out,
            "\nevent #{id}: its outbox row is gone (pruned); a redrive re-inserts it from this dead letter{}",
            if d.seq.is_some() {
                " as an unordered event (needs --out-of-order)"
            } else {
                ""
            }
        )?,
        (Some(_), Some(e)) => {
            writeln!(
                out,
                "\nevent #{} now: {}, {} attempt(s), redriven {} time(s){}",
                e.id,
                e.state(),
                e.attempts,
                e.redrive_count,
                e.seq.map(|s| format!(", seq {s}")).unwrap_or_default()
            )?;
            if let Some(done) = e.key_done_seq {
                writeln!(
                    out,
                    "  key: done up to seq {done}{}",
                    e.key_blocked_by
                        .map(|b| format!(", blocked by event #{b}"))
                        .unwrap_or_default()
                )?;
            }
        }
    }
    if d.state() == "unhandled" && d.outbox_id.is_some() {
        writeln!(out, "redrive: outbox dead-letters redrive {}", d.id)?;
    }
    Ok(())
}

fn indent(s: &str) -> String {
    s.lines()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn describe_redriven(r: &Redriven) -> String {
    let mut s = format!(
        "dead letter #{} redriven: event #{} ({}/{}) is pending again{}; the relay republishes it with deduplication \
         id {}",
        r.dead_letter_id,
        r.outbox_id,
        util::printable(&r.topic),
        util::printable(&r.partition_key),
        if r.reinserted {
            " (its pruned outbox row was re-inserted with the same id)"
        } else {
            ""
        },
        util::printable(&r.dedup_id)
    );
    match r.order {
        RedriveOrder::Unordered => {}
        RedriveOrder::InOrder {
            seq,
            key_unblocked: true,
        } => s.push_str(&format!(
            "\n  ordered: seq {seq} is its key's head again — the key is unblocked and the events behind it follow \
             in order"
        )),
        RedriveOrder::InOrder {
            seq,
            key_unblocked: false,
        } => s.push_str(&format!(
            "\n  ordered: seq {seq} waits for the earlier events of its key, then goes in order"
        )),
        RedriveOrder::OutOfOrder { former_seq } => s.push_str(&format!(
            "\n  OUT OF ORDER: it had seq {former_seq}, but its key has moved past it; it was republished as an \
             UNORDERED event and will be applied after later events of its key"
        )),
    }
    if !r.also_marked.is_empty() {
        s.push_str(&format!(
            "\n  also marked redriven (earlier dead letters of the same event): {}",
            r.also_marked
                .iter()
                .map(|i| format!("#{i}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    s
}

async fn redrive(a: RedriveArgs, out: &mut dyn Write, confirm: Confirm) -> anyhow::Result<()> {
    let opts = RedriveOptions {
        out_of_order: a.out_of_order,
    };
    let pool = a.db.connect().await?;
    if let Some(id) = a.id {
        let mut conn = pool.acquire().await?;
        let r = dead_letters::redrive(&mut conn, id, opts).await?;
        if a.json {
            writeln!(out, "{}", serde_json::to_string(&r)?)?;
        } else {
            writeln!(out, "{}", describe_redriven(&r))?;
        }
        return Ok(());
    }
    let filter = a.filter.filter();
    if filter.is_empty() {
        bail!(
            "give a dead letter's id, or at least one filter (--topic, --source, --key, --since, --until) for a bulk \
             redrive; `outbox dead-letters list` shows what there is"
        );
    }
    let n = {
        let mut conn = pool.acquire().await?;
        dead_letters::count_unhandled(&mut conn, &filter).await?
    };
    if n == 0 {
        writeln!(
            out,
            "no unhandled dead letters match {}: nothing to redrive",
            a.filter.describe()
        )?;
        return Ok(());
    }
    if !a.json {
        writeln!(
            out,
            "{n} unhandled dead letter(s) match {}{}",
            a.filter.describe(),
            if a.out_of_order {
                " (middle events of ordered keys WILL be republished unordered: --out-of-order)"
            } else {
                " (middle events of ordered keys are skipped: add --out-of-order to republish them unordered)"
            }
        )?;
    }
    if !confirm.ask(a.yes, &format!("redrive {n} dead letter(s)"), out)? {
        writeln!(out, "cancelled: nothing was redriven")?;
        return Ok(());
    }
    let mut done = 0u64;
    let json = a.json;
    let mut write_err: Option<std::io::Error> = None;
    let report = dead_letters::redrive_matching(&pool, &filter, opts, |o| {
        done += 1;
        let line = if json {
            serde_json::to_string(o).unwrap_or_default()
        } else {
            match o {
                BulkOutcome::Redriven(r) => format!(
                    "[{done}/{n}] #{} redriven: event #{} ({}/{}) dedup id {}{}",
                    r.dead_letter_id,
                    r.outbox_id,
                    util::printable(&r.topic),
                    util::printable(&r.partition_key),
                    util::printable(&r.dedup_id),
                    match r.order {
                        RedriveOrder::OutOfOrder { former_seq } =>
                            format!(" — OUT OF ORDER (was seq {former_seq}), now unordered"),
                        RedriveOrder::InOrder {
                            key_unblocked: true,
                            ..
                        } => " — key unblocked".into(),
                        _ => String::new(),
                    }
                ),
                BulkOutcome::Skipped {
                    dead_letter_id,
                    reason,
                    ..
                } => format!(
                    "[{done}/{n}] #{dead_letter_id} skipped: {}",
                    util::printable(reason)
                ),
                BulkOutcome::Failed {
                    dead_letter_id,
                    error,
                } => format!(
                    "[{done}/{n}] #{dead_letter_id} FAILED: {}",
                    util::printable(error)
                ),
            }
        };
        if let Err(e) = writeln!(out, "{line}")
            && write_err.is_none()
        {
            write_err = Some(e);
        }
    })
    .await?;
    if let Some(e) = write_err {
        return Err(e.into());
    }
    if json {
        writeln!(out, "{}", serde_json::json!({"totals": report}))?;
    } else {
        writeln!(
            out,
            "redriven {}, skipped {}, failed {}",
            report.redriven, report.skipped, report.failed
        )?;
        if report.out_of_order > 0 {
            writeln!(
                out,
                "{} skipped dead letter(s) are middle events of ordered keys: re-run with --out-of-order to republish \
                 them as unordered events (applied after later events of their key)",
                report.out_of_order
            )?;
        }
        if report.failed > 0 {
            writeln!(
                out,
                "some redrives failed on a database error: re-run the same command (redriven ones are not touched \
                 again)"
            )?;
        }
    }
    if report.failed > 0 {
        bail!("{} redrive(s) failed", report.failed);
    }
    Ok(())
}

async fn purge(a: PurgeArgs, out: &mut dyn Write, confirm: Confirm) -> anyhow::Result<()> {
    let filter = a.filter.filter();
    if filter.is_empty() {
        bail!(
            "purge needs at least one filter (--topic, --source, --key, --since, --until), so that it cannot delete \
             every dead letter by accident"
        );
    }
    let pool = a.db.connect().await?;
    let counts = {
        let mut conn = pool.acquire().await?;
        dead_letters::count_purge(&mut conn, &filter, a.handled_only).await?
    };
    if counts.deleted == 0 {
        if a.json {
            writeln!(
                out,
                "{}",
                serde_json::json!({"deleted": 0, "kept_blocking": counts.kept_blocking})
            )?;
        } else {
            writeln!(
                out,
                "no dead letters to purge match {}{}",
                a.filter.describe(),
                kept_note(counts.kept_blocking)
            )?;
        }
        return Ok(());
    }
    if !a.json {
        writeln!(
            out,
            "{} dead letter(s) match {}{}. Their outbox rows are not touched.",
            counts.deleted,
            a.filter.describe(),
            if a.handled_only {
                " (redriven or resolved only)"
            } else {
                ""
            }
        )?;
    }
    if !confirm.ask(
        a.yes,
        &format!("delete {} dead letter(s)", counts.deleted),
        out,
    )? {
        writeln!(out, "cancelled: nothing was deleted")?;
        return Ok(());
    }
    let total = counts.deleted;
    let json = a.json;
    let mut write_err: Option<std::io::Error> = None;
    let done = dead_letters::purge(&pool, &filter, a.handled_only, a.batch, |n| {
        if !json
            && let Err(e) = writeln!(out, "deleted {n}/{total}")
            && write_err.is_none()
        {
            write_err = Some(e);
        }
    })
    .await?;
    if let Some(e) = write_err {
        return Err(e.into());
    }
    if json {
        writeln!(out, "{}", serde_json::to_string(&done)?)?;
    } else {
        writeln!(
            out,
            "purged {} dead letter(s). The outbox rows were not touched: dead events stay in the outbox until \
             `outbox prune --dead-letters-days N` removes them.{}",
            done.deleted,
            kept_note(done.kept_blocking)
        )?;
    }
    Ok(())
}

fn kept_note(kept: i64) -> String {
    if kept > 0 {
        format!(
            " Kept {kept} whose events block ordered keys: redrive them (`outbox dead-letters redrive <id>`) to free \
             their keys."
        )
    } else {
        String::new()
    }
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
