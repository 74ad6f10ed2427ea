//! Bulk redrive and purge: the confirmation page (which fixes the selection to what it counted) and the run.

use axum::Extension;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use outbox::dead_letters::{
    self, BulkOutcome, BulkReport, DeadLetterSummary, Filter, ListQuery, Listing, PurgeScope,
    RedriveOptions,
};
use outbox::ops::actions;
use serde_json::json;

use super::audit::{Run, log_start, stopped_page};
use super::filter::{
    bad_request, decode_selection, describe, encode_selection, filter_of, refuse_unfiltered,
    scope_of,
};
use super::list::summary_table;
use crate::console::context::{self, App, Ctx, Params, S};
use crate::console::html::Html;
use crate::console::layout::{self, cut, dead_letter_link, event_link, opt};
use crate::console::respond;

/// `GET /dead-letters/confirm?action=redrive|purge&…filter`: how many dead letters the action will touch, and
/// the form that runs it on exactly those (the largest id now is fixed into the selection).
pub async fn confirm(State(app): S, Extension(ctx): Extension<Ctx>, uri: Uri) -> Response {
    if ctx.read_only {
        let mut h = Html::new();
        h.lit("This console is read-only: redrive and purge are refused.");
        return respond::error_page(&ctx, StatusCode::FORBIDDEN, &h);
    }
    let p = context::query(&uri);
    let mut filter = match filter_of(&p) {
        Ok(f) => f,
        Err(e) => return bad_request(&ctx, &e),
    };
    let action = match p.get("action") {
        Some(a @ ("redrive" | "purge")) => a.to_owned(),
        _ => return bad_request(&ctx, "action: redrive or purge"),
    };
    if filter.is_empty() {
        return refuse_unfiltered(&ctx);
    }
    let scope = match scope_of(&p) {
        Ok(s) => s,
        Err(e) => return bad_request(&ctx, &e),
    };
    let counted = respond::read(&app, &ctx, async |conn| {
        counted(conn, &mut filter, &action, scope).await
    })
    .await;
    let (count, kept, preview) = match counted {
        Ok(c) => c,
        Err(stop) => return stop.into_response(),
    };
    let mut h = Html::new();
    h.lit("<h1>Confirm: ")
        .text(&action)
        .lit("</h1><p>Selection: ");
    describe(&mut h, &filter);
    h.lit(".</p>");
    what_it_will_do(&mut h, &action, count, kept, scope);
    if count == 0 {
        h.lit("<p class=\"muted\">Nothing to do.</p>");
    } else {
        confirm_form(&mut h, &ctx, &action, count, scope, &filter);
    }
    h.lit("<h2>The first of them</h2>");
    summary_table(&mut h, &preview);
    respond::ok_page(&ctx, "Confirm", None, &h)
}

/// Fixes the selection to the dead letters there are now (`max_id`), counts what the action will touch (and, for a
/// purge, what it keeps), and reads the first ten.
async fn counted(
    conn: &mut sqlx::PgConnection,
    filter: &mut Filter,
    action: &str,
    scope: PurgeScope,
) -> Result<(i64, i64, Vec<DeadLetterSummary>), sqlx::Error> {
    let upto = dead_letters::max_id(&mut *conn).await?;
    filter.max_id = Some(filter.max_id.map_or(upto, |m| m.min(upto)));
    let (count, kept) = if action == "redrive" {
        (dead_letters::count_unhandled(&mut *conn, filter).await?, 0)
    } else {
        let c = dead_letters::count_purge(&mut *conn, filter, scope).await?;
        (c.deleted, c.kept_blocking)
    };
    let preview = dead_letters::list(
        &mut *conn,
        &ListQuery {
            filter: filter.clone(),
            listing: if action == "purge" && scope != PurgeScope::Unhandled {
                Listing::All
            } else {
                Listing::Unhandled
            },
            after: None,
            limit: 10,
        },
    )
    .await?;
    Ok((count, kept, preview.items))
}

/// What the action will do, in words.
fn what_it_will_do(h: &mut Html, action: &str, count: i64, kept: i64, scope: PurgeScope) {
    h.lit("<p>This will ");
    if action == "redrive" {
        h.lit("redrive <strong id=\"count\">").text(count).lit("</strong> unhandled dead letter(s), oldest first, each in its own transaction. Middle events of ordered keys are skipped unless you tick “out of order”.");
    } else {
        h.lit("delete <strong id=\"count\">")
            .text(count)
            .lit("</strong> ")
            .lit(match scope {
                PurgeScope::Any => "",
                PurgeScope::Handled => "handled (redriven or resolved) ",
                PurgeScope::Unhandled => "unhandled ",
            })
            .lit("dead letter(s)");
        if kept > 0 {
            h.lit(" and keep ")
                .text(kept)
                .lit(" whose event blocks an ordered key (redrive those instead)");
        }
        h.lit(". Outbox rows are not touched.");
    }
    h.lit(" Dead letters recorded after this page was loaded are not included.</p>");
    h.lit(" Dead letters recorded after this page was loaded are not included.</p>");
}

/// The form that runs the action on exactly the selection counted.
fn confirm_form(
    h: &mut Html,
    ctx: &Ctx,
    action: &str,
    count: i64,
    scope: PurgeScope,
    filter: &Filter,
) {
    h.lit("<form id=\"confirm\" method=\"post\" action=\"/dead-letters/bulk\">");
    layout::csrf_field(h, ctx);
    h.lit("<input type=\"hidden\" name=\"action\" value=\"")
        .text(action)
        .lit("\">");
    h.lit("<input type=\"hidden\" name=\"expected\" value=\"")
        .text(count)
        .lit("\">");
    // The selection as one opaque field: stored text (a topic with control characters, say) round-trips
    // exactly, where an escaped attribute value would not.
    h.lit("<input type=\"hidden\" name=\"selection\" value=\"")
        .text(encode_selection(filter))
        .lit("\">");
    if action == "redrive" {
        h.lit("<label><input type=\"checkbox\" name=\"out_of_order\" value=\"1\"> out of order</label> ");
    } else {
        h.lit("<input type=\"hidden\" name=\"scope\" value=\"")
            .lit(scope.as_str())
            .lit("\">");
    }
    h.lit("<button class=\"danger\">")
        .text(action)
        .text(format!(" {count} dead letter(s)"))
        .lit("</button> ")
        .lit("<a href=\"/dead-letters\">cancel</a></form>");
}

/// `POST /dead-letters/bulk`: runs a confirmed bulk redrive or purge on the selection the confirmation counted,
/// logged before it starts and completed with what it did (also when it stops half-way), and reports it.
pub async fn bulk(State(app): S, Extension(ctx): Extension<Ctx>, body: Bytes) -> Response {
    let p = match respond::action_form(&ctx, &body) {
        Ok(p) => p,
        Err(refused) => return *refused,
    };
    let from_confirmation = "a bulk action runs from its confirmation page (which fixes the selection to what it \
                             counted)";
    let Some(filter) = p.get("selection").and_then(decode_selection) else {
        return bad_request(&ctx, from_confirmation);
    };
    if filter.is_empty() {
        return refuse_unfiltered(&ctx);
    }
    if filter.max_id.is_none() {
        return bad_request(&ctx, from_confirmation);
    }
    let action = match p.get("action") {
        Some("redrive") => "redrive_bulk",
        Some("purge") => "purge",
        _ => return bad_request(&ctx, "action: redrive or purge"),
    };
    let scope = match scope_of(&p) {
        Ok(s) => s,
        Err(e) => return bad_request(&ctx, &e),
    };
    let mut selection = serde_json::to_value(&filter).unwrap_or_default();
    if action == "purge" {
        selection["scope"] = json!(scope);
    }
    let logged = match respond::read(&app, &ctx, async |conn| {
        log_start(conn, &ctx, action, None, Some(selection)).await
    })
    .await
    {
        Ok(v) => v,
        Err(stop) => return stop.into_response(),
    };
    let mut h = Html::new();
    let run = if action == "purge" {
        run_purge(&app, &filter, scope, &p, &mut h).await
    } else {
        run_redrive(&app, &filter, &p, &mut h).await
    };
    let finished = match app.pool.acquire().await {
        Ok(mut conn) => actions::finish(&mut conn, logged, None, &run.outcome).await,
        Err(e) => Err(e),
    };
    if let Some(e) = &run.stopped {
        let mut h = Html::new();
        h.lit("<span id=\"report\">Stopped half-way</span>: the ")
            .text(action)
            .lit(" failed on a database error after ")
            .text(&run.done)
            .lit(" (of ");
        opt(&mut h, p.get("expected"));
        h.lit(" counted). ").lit(if finished.is_ok() {
            "What it did is recorded in the action log (#"
        } else {
            "The action log shows it started, but could not be completed with what it did (#"
        });
        h.text(logged).lit(
            "); the rest of the selection is untouched: run it again from a new confirmation page. ",
        );
        return stopped_page(&ctx, h, &**e);
    }
    if let Err(e) = finished {
        return respond::db_error(&ctx, e);
    }
    h.lit("<p>Selection: ");
    describe(&mut h, &filter);
    h.lit(". <a href=\"/dead-letters\">back to the dead letters</a> · <a href=\"/actions\">action log</a></p>");
    respond::ok_page(&ctx, "Report", None, &h)
}

/// Logs an action before it runs (on one dead letter, or a bulk action's selection); its id, for
/// Bulk redrive of `filter`, its report written into `h`.
pub(super) async fn run_redrive(app: &App, filter: &Filter, p: &Params, h: &mut Html) -> Run {
    let opts = RedriveOptions {
        out_of_order: p.flag("out_of_order"),
    };
    let mut lines = Vec::new();
    let mut so_far = BulkReport::default();
    let report = dead_letters::redrive_matching(&app.pool, filter, opts, |o| {
        tally(&mut so_far, o);
        if lines.len() < 500 {
            lines.push(o.clone());
        }
    })
    .await;
    let done = |r: &BulkReport| {
        format!(
            "redriving {}, skipping {} and failing {}",
            r.redriven, r.skipped, r.failed
        )
    };
    match report {
        Ok(report) => {
            redrive_report(h, &report, &lines, p.get("expected"));
            Run {
                outcome: json!(report),
                done: done(&report),
                stopped: None,
            }
        }
        Err(e) => Run {
            outcome: json!({"stopped": e.to_string(), "done": so_far}),
            done: done(&so_far),
            stopped: Some(Box::new(e)),
        },
    }
}

/// Counts one outcome into `r`, as [`dead_letters::redrive_matching`] counts its report.
pub(super) fn tally(r: &mut BulkReport, o: &BulkOutcome) {
    match o {
        BulkOutcome::Redriven(_) => r.redriven += 1,
        BulkOutcome::Skipped { out_of_order, .. } => {
            r.skipped += 1;
            r.out_of_order += u64::from(*out_of_order);
        }
        BulkOutcome::Failed { .. } => r.failed += 1,
    }
}

pub(super) fn redrive_report(
    h: &mut Html,
    report: &BulkReport,
    lines: &[BulkOutcome],
    expected: Option<&str>,
) {
    h.lit("<div class=\"report\" id=\"report\">Redriven <strong id=\"done\">")
        .text(report.redriven)
        .lit("</strong>, skipped ")
        .text(report.skipped);
    if report.out_of_order > 0 {
        h.lit(" (")
            .text(report.out_of_order)
            .lit(" middle events: need “out of order”)");
    }
    h.lit(", failed ").text(report.failed).lit(" (of ");
    opt(h, expected);
    h.lit(" counted).</div><table id=\"outcomes\"><tr><th>dead letter</th><th>outcome</th><th>event</th><th>detail</th></tr>");
    for o in lines {
        h.lit("<tr><td>");
        match o {
            BulkOutcome::Redriven(r) => {
                dead_letter_link(h, r.dead_letter_id);
                h.lit("</td><td class=\"ok\">redriven</td><td>");
                event_link(h, r.outbox_id);
                h.lit("</td><td>").text(&r.dedup_id);
            }
            BulkOutcome::Skipped {
                dead_letter_id,
                reason,
                ..
            } => {
                dead_letter_link(h, *dead_letter_id);
                h.lit("</td><td class=\"warn\">skipped</td><td></td><td class=\"wrap\">");
                cut(h, reason, 300);
            }
            BulkOutcome::Failed {
                dead_letter_id,
                error,
            } => {
                dead_letter_link(h, *dead_letter_id);
                h.lit("</td><td class=\"bad\">failed</td><td></td><td class=\"wrap\">");
                cut(h, error, 300);
            }
        }
        h.lit("</td></tr>");
    }
    h.lit("</table>");
}

/// Bulk purge of `filter`, its report written into `h`.
pub(super) async fn run_purge(
    app: &App,
    filter: &Filter,
    scope: PurgeScope,
    p: &Params,
    h: &mut Html,
) -> Run {
    let mut deleted = 0i64;
    let result = dead_letters::purge(&app.pool, filter, scope, 1000, |n| {
        deleted = n;
    })
    .await;
    match result {
        Ok(counts) => {
            h.lit("<div class=\"report\" id=\"report\">Purged <strong id=\"done\">")
                .text(counts.deleted)
                .lit("</strong> dead letter(s) (of ");
            opt(h, p.get("expected"));
            h.lit(" counted)");
            if counts.kept_blocking > 0 {
                h.lit("; kept ")
                    .text(counts.kept_blocking)
                    .lit(" whose event blocks an ordered key");
            }
            h.lit(".</div>");
            Run {
                outcome: json!(counts),
                done: format!("deleting {} dead letter(s)", counts.deleted),
                stopped: None,
            }
        }
        Err(e) => Run {
            outcome: json!({"stopped": e.to_string(), "deleted": deleted}),
            done: format!("deleting {deleted} dead letter(s)"),
            stopped: Some(Box::new(e)),
        },
    }
}
