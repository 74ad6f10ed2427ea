//! `outbox dead-letters list` and `show`: reading dead letters, nothing changes.

use std::io::Write;

use anyhow::{Context, bail};
use outbox::dead_letters::{self, ListQuery};

use super::args::*;
use crate::util;

pub(super) async fn list(a: ListArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let pool = a.db.connect().await?;
    let mut conn = pool.acquire().await?;
    let page = dead_letters::list(
        &mut conn,
        &ListQuery {
            filter: a.filter.filter(),
            listing: if a.include_redriven {
                dead_letters::Listing::All
            } else {
                dead_letters::Listing::Unhandled
            },
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
        "{:>7}  {:<19}  {:<6}  {:<16}  {:<12}  {:<18}  {:>5}  {:>8}  {:>4}  {:>6}  {:<9}  ERROR",
        "ID",
        "RECORDED (UTC)",
        "SOURCE",
        "TOPIC",
        "SUBSCRIBER",
        "KEY",
        "SEQ",
        "EVENT",
        "ATT",
        "STATUS",
        "STATE"
    )?;
    for d in &page.items {
        write_row(d, out)?;
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

/// One dead letter as a line of the list.
fn write_row(d: &dead_letters::DeadLetterSummary, out: &mut dyn Write) -> anyhow::Result<()> {
    writeln!(
        out,
        "{:>7}  {:<19}  {:<6}  {:<16}  {:<12}  {:<18}  {:>5}  {:>8}  {:>4}  {:>6}  {:<9}  {}",
        d.id,
        time(d.created_at),
        util::one_line(&d.source, 6),
        util::one_line(d.topic.as_deref().unwrap_or("?"), 16),
        util::one_line(outbox::subscribers::label(&d.subscriber), 12),
        util::one_line(d.partition_key.as_deref().unwrap_or("?"), 18),
        opt(d.seq),
        opt(d.outbox_id),
        opt(d.attempts),
        opt(d.status),
        d.state(),
        util::one_line(&d.error, 80)
    )?;
    Ok(())
}

pub(super) async fn show(a: ShowArgs, out: &mut dyn Write) -> anyhow::Result<()> {
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
    write_fields(&d, out)?;
    write_stored(&d, out)?;
    write_event(&d, event.as_ref(), out)?;
    if d.state() == "unhandled" && d.outbox_id.is_some() {
        writeln!(out, "redrive: outbox dead-letters redrive {}", d.id)?;
    }
    Ok(())
}

/// The dead letter's own fields.
fn write_fields(d: &dead_letters::DeadLetter, out: &mut dyn Write) -> anyhow::Result<()> {
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
    writeln!(
        out,
        "  subscriber    {} (a redrive requeues the event for this subscriber only)",
        outbox::subscribers::label(&d.subscriber)
    )?;
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
            Some("withdrawn") => {
                "withdrawn: a copy for a subscriber whose removal deleted it; QStash still held its message"
            }
            _ => "delivered after all",
        };
        writeln!(out, "  resolved at   {} UTC ({how})", time(t))?;
    }
    Ok(())
}

/// What it kept of the delivery: the response, the payload or body, headers, a parse error, the raw callback.
fn write_stored(d: &dead_letters::DeadLetter, out: &mut dyn Write) -> anyhow::Result<()> {
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
    Ok(())
}

/// Its event now, or why it has none.
fn write_event(
    d: &dead_letters::DeadLetter,
    event: Option<&dead_letters::EventState>,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    match (d.outbox_id, event) {
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
    Ok(())
}

fn indent(s: &str) -> String {
    s.lines()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}
