//! `outbox status`: the three status queries (backlog depth, oldest pending age and flapping rows; dispatched per
//! minute over the last hour; stuck leases), blocked ordered keys, heads awaiting delivery evidence, and
//! dead-letter counts by topic and source, and the tenants (fairness keys) with the oldest waiting events — a table
//! for people, `--json` for scripts. The figures come from `outbox::ops::status` and `outbox::fairness::backlog`.

use std::io::Write;

use anyhow::Context;
use clap::Args;
use outbox::fairness::KeyBacklog;
use outbox::ops::{self, Status};

use crate::util::{self, DbArgs};

/// Arguments of `outbox status`.
#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// One JSON object (every figure, lists included).
    #[arg(long)]
    pub json: bool,
    /// Oldest pending age (seconds) above which the table warns that the relay may not be running.
    #[arg(long, default_value_t = 300)]
    pub warn_age_secs: u64,
}

/// `outbox status`.
pub async fn run(args: StatusArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let pool = args.db.connect().await?;
    let status = ops::status_with_horizon(&pool, reconcile_horizon()?)
        .await
        .context("reading the status figures (is the schema migrated? run `outbox migrate`)")?;
    let tenants = outbox::fairness::backlog(&mut *pool.acquire().await?, None, TOP_TENANTS)
        .await
        .context("reading the backlog per fairness key")?;
    if args.json {
        let mut v = serde_json::to_value(&status)?;
        if let Some(o) = v.as_object_mut() {
            o.insert("tenants".into(), serde_json::to_value(&tenants)?);
        }
        writeln!(out, "{v}")?;
    } else {
        write_table(&status, &tenants, args.warn_age_secs as f64, out)?;
    }
    Ok(())
}

/// How many fairness keys `outbox status` (and the console's overview) lists.
pub const TOP_TENANTS: i64 = 10;

/// A fairness key as shown: `(none)` for events without one.
pub fn tenant_label(key: &str) -> String {
    if key.is_empty() {
        "(none)".into()
    } else {
        util::printable(key)
    }
}

/// `1,234,567`.
pub fn thousands(n: impl Into<i128>) -> String {
    let digits = n.into().unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The tenants table: a line per fairness key, its waiting events, their oldest age and its pause (`outbox status`,
/// `outbox tenants list`).
pub fn write_tenants(keys: &[KeyBacklog], out: &mut dyn Write) -> std::io::Result<()> {
    if keys.is_empty() {
        return writeln!(out, "  none");
    }
    writeln!(
        out,
        "  {:<32} {:>10} {:>10}  PAUSED",
        "KEY", "PENDING", "OLDEST"
    )?;
    for k in keys {
        let paused = match k.paused_at {
            None => "-".to_owned(),
            Some(at) => format!(
                "since {} UTC by {}{}",
                at.format("%Y-%m-%d %H:%M:%S"),
                util::one_line(k.paused_by.as_deref().unwrap_or("?"), 40),
                k.paused_reason
                    .as_deref()
                    .map(|r| format!(": {}", util::one_line(r, 100)))
                    .unwrap_or_default()
            ),
        };
        writeln!(
            out,
            "  {:<32} {:>10} {:>10}  {}",
            if k.fairness_key.is_empty() {
                "(none)".to_owned()
            } else {
                util::one_line(&k.fairness_key, 32)
            },
            thousands(k.pending),
            if k.pending > 0 {
                age(k.oldest_age_secs)
            } else {
                "-".into()
            },
            paused
        )?;
    }
    Ok(())
}

/// The relay's reconciler horizon, from the relay's own variables and defaults (`RELAY_RECONCILE_AFTER_SECS`,
/// `QSTASH_RETRIES`): in-flight events older than it count as unaccounted.
pub fn reconcile_horizon() -> anyhow::Result<std::time::Duration> {
    let env = outbox::config::ProcessEnv;
    let vars = outbox::config::Vars::new(&env);
    let relay =
        outbox::config::RelayConfig::from_vars(&vars, vars.ranged_or("QSTASH_RETRIES", 5, 0, 100)?)
            .context("reading the relay's settings (RELAY_RECONCILE_AFTER_SECS, QSTASH_RETRIES)")?;
    Ok(relay.accounting.horizon)
}

/// Oldest transaction age above which the table warns (the `OldestTransactionAlarm`'s default threshold).
pub const WARN_TRANSACTION_SECS: f64 = 600.0;

/// Dead-tuple share above which the table warns (the `DeadTuplesAlarm`'s default threshold).
pub const WARN_DEAD_PERCENT: f64 = 50.0;

/// `12.3 MB`, `512 kB`, `80 B`.
pub fn bytes(n: i64) -> String {
    let n = n.max(0) as f64;
    if n >= 1e9 {
        format!("{:.1} GB", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.1} MB", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.0} kB", n / 1e3)
    } else {
        format!("{n:.0} B")
    }
}

/// ` (subscriber shipping)` after a copy or lane of a named subscriber; nothing for the default one (a deployment
/// without fan-out reads as before).
fn for_subscriber(name: &str) -> String {
    if name.is_empty() {
        String::new()
    } else {
        format!(" (subscriber {})", util::printable(name))
    }
}

/// The "Subscribers" section: one line per subscriber of each topic with named subscribers (none otherwise).
fn write_subscribers(
    subs: &[outbox::ops::subscribers::SubscriberStatus],
    out: &mut dyn Write,
) -> std::io::Result<()> {
    if subs.is_empty() {
        return Ok(());
    }
    writeln!(
        out,
        "\nSubscribers (fan-out: each subscriber's copies of its topic's events)"
    )?;
    writeln!(
        out,
        "  {:<22} {:<16} {:>8} {:>10} {:>9} {:>10} {:>7} {:>6}",
        "topic", "subscriber", "pending", "oldest", "in flight", "oldest", "blocked", "dead"
    )?;
    for x in subs {
        writeln!(
            out,
            "  {:<22} {:<16} {:>8} {:>10} {:>9} {:>10} {:>7} {:>6}{}",
            util::one_line(&x.topic, 22),
            outbox::subscribers::label(&x.subscriber),
            x.pending,
            age(x.oldest_pending_age_secs),
            x.in_flight,
            age(x.oldest_in_flight_age_secs),
            x.blocked_keys,
            x.dead_letters,
            if x.replaying {
                "  (replay under way: its ordered keys wait)"
            } else {
                ""
            }
        )?;
    }
    Ok(())
}

/// The "Database" section: the xmin horizon and the watched tables.
fn write_database(d: &outbox::DatabaseHealth, out: &mut dyn Write) -> std::io::Result<()> {
    let h = &d.horizon;
    writeln!(
        out,
        "\nDatabase (what vacuum may clean, and what retention leaves behind)"
    )?;
    writeln!(
        out,
        "  oldest transaction     {}{}",
        age(h.oldest_transaction_age_secs),
        if h.oldest_transaction_age_secs >= WARN_TRANSACTION_SECS {
            "  (vacuum can clean nothing deleted since it began: end it; docs/operations.md, \"Database health\")"
        } else {
            ""
        }
    )?;
    writeln!(
        out,
        "  xmin horizon           {} transactions behind{}",
        h.horizon_age_xids,
        h.held_by
            .as_deref()
            .map(|w| format!(", held by {}", util::one_line(w, 120)))
            .unwrap_or_default()
    )?;
    if !h.sees_all_sessions {
        writeln!(
            out,
            "  (this role sees only its own sessions' transactions: grant it pg_read_all_stats to see all)"
        )?;
    }
    for t in &d.tables {
        let pct = t.dead_percent();
        writeln!(
            out,
            "  {:<20} {:>10} live {:>10} dead ({:>4.1} %)  {:>9} ({} indexes)  autovacuum {} runs, last {}{}",
            t.table,
            t.live_tuples,
            t.dead_tuples,
            pct,
            bytes(t.total_bytes),
            bytes(t.index_bytes),
            t.autovacuum_count,
            t.last_autovacuum
                .map(|at| at.format("%Y-%m-%d %H:%M:%S UTC").to_string())
                .unwrap_or_else(|| "never".into()),
            if pct >= WARN_DEAD_PERCENT {
                "  (bloated: check the horizon, then autovacuum)"
            } else {
                ""
            }
        )?;
    }
    Ok(())
}

/// `1h 02m`, `3m 12s`, `4.2s`.
pub fn age(secs: f64) -> String {
    if secs < 60.0 {
        return format!("{secs:.1}s");
    }
    let s = secs as u64;
    if s < 3600 {
        format!("{}m {:02}s", s / 60, s % 60)
    } else if s < 86_400 {
        format!("{}h {:02}m", s / 3600, (s % 3600) / 60)
    } else {
        format!("{}d {:02}h", s / 86_400, (s % 86_400) / 3600)
    }
}

fn shown(total: i64, listed: usize) -> String {
    if total > listed as i64 {
        format!("  (the first {listed} listed)")
    } else {
        String::new()
    }
}

/// The table for people (`tenants`: [`outbox::fairness::backlog`]'s top keys).
pub fn write_table(
    s: &Status,
    tenants: &[KeyBacklog],
    warn_age: f64,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    writeln!(
        out,
        "outbox status at {} UTC",
        s.at.format("%Y-%m-%d %H:%M:%S")
    )?;

    write_backlog(s, out)?;
    write_outage(s, out)?;
    write_database(&s.database, out)?;
    write_subscribers(&s.subscribers, out)?;

    write_in_flight(s, out)?;
    write_ordered_keys(s, out)?;
    write_dead_letters(s, out)?;
    writeln!(
        out,
        "\nTenants (fairness keys) by lag (the {TOP_TENANTS} with the oldest waiting events, then every paused one)"
    )?;
    write_tenants(tenants, out)?;
    write_hints(s, warn_age, out)
}

/// Backlog, flapping events, throughput and stuck leases.
fn write_backlog(s: &Status, out: &mut dyn Write) -> std::io::Result<()> {
    let at = s.at;
    writeln!(out, "\nBacklog (events neither dispatched nor dead)")?;
    writeln!(out, "  pending                {}", s.backlog.pending)?;
    writeln!(
        out,
        "  oldest pending age     {}",
        age(s.backlog.oldest_pending_age_secs)
    )?;
    writeln!(
        out,
        "  flapping (>{} attempts) {}{}",
        ops::FLAPPING_ATTEMPTS,
        s.backlog.flapping,
        shown(s.backlog.flapping, s.backlog.flapping_rows.len())
    )?;
    for e in &s.backlog.flapping_rows {
        writeln!(
            out,
            "    event #{} {}/{}{}  {} attempts, written {} ago  {}",
            e.id,
            util::printable(&e.topic),
            util::one_line(&e.partition_key, 40),
            for_subscriber(&e.subscriber),
            e.attempts,
            age((at - e.created_at).as_seconds_f64()),
            util::one_line(e.last_error.as_deref().unwrap_or(""), 100)
        )?;
    }

    writeln!(
        out,
        "\nThroughput (dispatched per minute, last hour; oldest first)"
    )?;
    writeln!(
        out,
        "  total {}   average {:.1}/min   this minute so far {}",
        s.throughput.last_hour,
        s.throughput.last_hour as f64 / 60.0,
        s.throughput.per_minute.last().map_or(0, |m| m.dispatched)
    )?;
    for row in s.throughput.per_minute.chunks(10) {
        let start = row.first().map(|m| m.minute.format("%H:%M").to_string());
        let counts: Vec<String> = row.iter().map(|m| format!("{:>6}", m.dispatched)).collect();
        writeln!(out, "  {}  {}", start.unwrap_or_default(), counts.join(""))?;
    }

    writeln!(
        out,
        "\nStuck leases (lease ended without a settle: a relay stopped mid-attempt)"
    )?;
    writeln!(
        out,
        "  count                  {}{}",
        s.stuck_leases.count,
        shown(s.stuck_leases.count, s.stuck_leases.oldest.len())
    )?;
    for e in &s.stuck_leases.oldest {
        writeln!(
            out,
            "    event #{} {}/{}{}  lease ended {} ago, {} attempts",
            e.id,
            util::printable(&e.topic),
            util::one_line(&e.partition_key, 40),
            for_subscriber(&e.subscriber),
            e.locked_until
                .map(|t| age((at - t).as_seconds_f64()))
                .unwrap_or_else(|| "?".into()),
            e.attempts
        )?;
    }
    Ok(())
}

/// The QStash outage, if any.
fn write_outage(s: &Status, out: &mut dyn Write) -> std::io::Result<()> {
    let o = &s.qstash_outage;
    writeln!(
        out,
        "\nQStash outage (relays publish nothing until the next probe gets through)"
    )?;
    match o.since {
        None => writeln!(out, "  none")?,
        Some(since) => {
            writeln!(
                out,
                "  since                  {} UTC ({} ago)",
                since.format("%Y-%m-%d %H:%M:%S"),
                age(o.duration().as_secs_f64())
            )?;
            writeln!(out, "  failed cycles/probes   {}", o.failures)?;
            writeln!(
                out,
                "  next probe             {}",
                match o.next_probe_at {
                    Some(t) if t > o.now => format!("in {}", age((t - o.now).as_seconds_f64())),
                    Some(_) => "due (the next relay invocation probes)".into(),
                    None => "due".into(),
                }
            )?;
            writeln!(
                out,
                "  last error             {}",
                util::one_line(o.last_error.as_deref().unwrap_or(""), 200)
            )?;
        }
    }
    Ok(())
}

/// In flight and the reconciler's counts.
fn write_in_flight(s: &Status, out: &mut dyn Write) -> std::io::Result<()> {
    let f = &s.in_flight;
    writeln!(
        out,
        "\nIn flight (accepted by QStash, no outcome recorded yet)"
    )?;
    writeln!(
        out,
        "  total {}   <1m {}   1-10m {}   10m-1h {}   >1h {}   oldest {}",
        f.total,
        f.under_1m,
        f.from_1m_to_10m,
        f.from_10m_to_1h,
        f.over_1h,
        age(f.oldest_secs)
    )?;
    writeln!(
        out,
        "  unaccounted            {}{}",
        f.unaccounted,
        if f.unaccounted > 0 {
            format!(
                "  (in flight for longer than {}: the reconciler asks QStash; if this stays, see docs/operations.md)",
                age(f.horizon_secs)
            )
        } else {
            String::new()
        }
    )?;
    let r = &s.reconciler;
    writeln!(
        out,
        "  reconciler (all time)  applied by dedupe row {}, recorded from QStash's DLQ {}, republished {}, \
         still retrying {}, dead-lettered unaccounted {}, failed lookups {}{}",
        r.swept_applied,
        r.recorded_from_dlq,
        r.republished,
        r.still_retrying,
        r.unaccounted_dead,
        r.lookup_failures,
        r.last_error
            .as_deref()
            .map(|e| format!("; last error: {}", util::one_line(e, 150)))
            .unwrap_or_default()
    )?;
    Ok(())
}

/// Ordered keys: awaiting evidence, blocked.
fn write_ordered_keys(s: &Status, out: &mut dyn Write) -> std::io::Result<()> {
    let at = s.at;
    writeln!(out, "\nOrdered keys")?;
    writeln!(
        out,
        "  blocked by a dead head {}{}",
        s.blocked_keys.count,
        shown(s.blocked_keys.count, s.blocked_keys.keys.len())
    )?;
    for k in &s.blocked_keys.keys {
        writeln!(
            out,
            "    {}/{}{}  since {} ago, by event #{}{}{}: {}",
            util::printable(&k.topic),
            util::one_line(&k.partition_key, 40),
            for_subscriber(&k.subscriber),
            age((at - k.since).as_seconds_f64()),
            k.blocking_event
                .map(|i| i.to_string())
                .unwrap_or_else(|| "?".into()),
            k.dead_letter_id
                .map(|d| format!(" (dead letter #{d})"))
                .unwrap_or_default(),
            k.waiting
                .filter(|w| *w > 0)
                .map(|w| format!(", {w} waiting behind it"))
                .unwrap_or_default(),
            util::one_line(k.reason.as_deref().unwrap_or(""), 100)
        )?;
    }
    writeln!(
        out,
        "  awaiting delivery evidence {} (oldest {})",
        s.awaiting_evidence.count,
        age(s.awaiting_evidence.oldest_secs)
    )?;
    Ok(())
}

/// Dead letters by topic and source.
fn write_dead_letters(s: &Status, out: &mut dyn Write) -> std::io::Result<()> {
    let at = s.at;
    writeln!(out, "\nDead letters")?;
    if s.dead_letters.is_empty() {
        writeln!(out, "  none")?;
    } else {
        writeln!(
            out,
            "  {:<24} {:<7} {:>10} {:>9} {:>9} {:>8}  OLDEST UNRESOLVED",
            "TOPIC", "SOURCE", "UNRESOLVED", "REDRIVEN", "RESOLVED", "APPLIED"
        )?;
        for d in &s.dead_letters {
            writeln!(
                out,
                "  {:<24} {:<7} {:>10} {:>9} {:>9} {:>8}  {}",
                util::one_line(d.topic.as_deref().unwrap_or("(unknown)"), 24),
                util::one_line(&d.source, 7),
                d.unresolved,
                d.redriven,
                d.resolved,
                d.applied,
                d.oldest_unresolved
                    .map(|t| format!("{} ago", age((at - t).as_seconds_f64())))
                    .unwrap_or_else(|| "-".into())
            )?;
        }
    }
    Ok(())
}

/// What to do next, from the figures.
fn write_hints(s: &Status, warn_age: f64, out: &mut dyn Write) -> std::io::Result<()> {
    let mut hints = Vec::new();
    if s.backlog.oldest_pending_age_secs > warn_age {
        hints.push(format!(
            "the oldest pending event is {} old: is a relay running? (check the relay Lambda's schedule and logs, or \
             run `outbox relay` locally)",
            age(s.backlog.oldest_pending_age_secs)
        ));
    }
    if s.stuck_leases.count > 0 {
        hints.push(format!(
            "{} lease(s) ended without a settle: a relay stopped mid-attempt. The next relay cycle claims them again; \
             if they stay, no relay is running",
            s.stuck_leases.count
        ));
    }
    if s.backlog.flapping > 0 {
        hints.push(
            "flapping events keep failing to publish: their last error says why (QStash token, URL, quota?)"
                .to_owned(),
        );
    }
    if s.blocked_keys.count > 0 {
        hints.push(
            "a blocked key waits for an operator: fix the cause, then `outbox dead-letters redrive <dead letter id>` \
             (the key then resumes in order)"
                .to_owned(),
        );
    }
    let unresolved = s.unresolved_dead_letters();
    if unresolved > 0 {
        hints.push(format!(
            "{unresolved} unresolved dead letter(s): `outbox dead-letters list` to inspect, then redrive or purge"
        ));
    }
    if !hints.is_empty() {
        writeln!(out, "\nWhat to do next")?;
        for h in hints {
            writeln!(out, "  - {h}")?;
        }
    }
    Ok(())
}
