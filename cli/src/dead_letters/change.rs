//! `outbox dead-letters redrive` and `purge`: the commands that change something, each behind a filter and a
//! confirmation.

use std::io::Write;

use anyhow::bail;
use outbox::dead_letters::{self, BulkOutcome, RedriveOptions, RedriveOrder, Redriven};

use super::args::*;
use crate::util;

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

pub(super) async fn redrive(
    a: RedriveArgs,
    out: &mut dyn Write,
    confirm: Confirm,
) -> anyhow::Result<()> {
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
            "give a dead letter's id, or at least one filter (--topic, --subscriber, --source, --key, --since, \
             --until) for a bulk redrive; `outbox dead-letters list` shows what there is"
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
            outcome_line(o, done, n)
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
    write_redrive_totals(&report, json, out)?;
    if report.failed > 0 {
        bail!("{} redrive(s) failed", report.failed);
    }
    Ok(())
}

/// One bulk redrive outcome, `[done/n]` first.
fn outcome_line(o: &BulkOutcome, done: u64, n: i64) -> String {
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
}

/// A bulk redrive's totals, as JSON or words with what to do next.
fn write_redrive_totals(
    report: &dead_letters::BulkReport,
    json: bool,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
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
    Ok(())
}

pub(super) async fn purge(
    a: PurgeArgs,
    out: &mut dyn Write,
    confirm: Confirm,
) -> anyhow::Result<()> {
    let filter = a.filter.filter();
    if filter.is_empty() {
        bail!(
            "purge needs at least one filter (--topic, --subscriber, --source, --key, --since, --until), so that it \
             cannot delete every dead letter by accident"
        );
    }
    let pool = a.db.connect().await?;
    let counts = {
        let mut conn = pool.acquire().await?;
        dead_letters::count_purge(&mut conn, &filter, a.scope()).await?
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
    let done = dead_letters::purge(&pool, &filter, a.scope(), a.batch, |n| {
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
    write_purged(&done, json, out)
}

/// What a purge did, as JSON or words.
fn write_purged(
    done: &dead_letters::PurgeCounts,
    json: bool,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    if json {
        writeln!(out, "{}", serde_json::to_string(done)?)?;
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
