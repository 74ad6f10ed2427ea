//! One dead letter: its page, and redriving it.

use axum::Extension;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use outbox::dead_letters::{self, DeadLetter, EventState, RedriveError, RedriveOptions};
use outbox::ops::actions;
use serde_json::json;

use super::audit::{log_start, stopped_page};
use super::filter::bad_request;
use crate::console::context::{Ctx, S};
use crate::console::html::Html;
use crate::console::layout::{self, dead_letter_link, event_link, opt, opt_time, time};
use crate::console::respond;

/// `GET /dead-letters/{id}`: everything stored about one dead letter, its event now, and the redrive form.
pub async fn show(
    State(app): S,
    Extension(ctx): Extension<Ctx>,
    Path(id): Path<String>,
) -> Response {
    let Ok(id) = id.parse::<outbox::DeadLetterId>() else {
        return bad_request(&ctx, "a dead letter id is a number");
    };
    let mut conn = match respond::conn(&app, &ctx).await {
        Ok(c) => c,
        Err(stop) => return stop.into_response(),
    };
    let d = match dead_letters::get(&mut conn, id).await {
        Ok(Some(d)) => d,
        Ok(None) => {
            let mut h = Html::new();
            h.lit("No such dead letter.");
            return respond::error_page(&ctx, StatusCode::NOT_FOUND, &h);
        }
        Err(e) => return respond::db_error(&ctx, e),
    };
    let event = match d.outbox_id {
        Some(o) => match dead_letters::event_state(&mut conn, o).await {
            Ok(e) => e,
            Err(e) => return respond::db_error(&ctx, e),
        },
        None => None,
    };
    let mut h = Html::new();
    h.lit("<h1>Dead letter #").text(d.id).lit("</h1>");
    details(&mut h, &d);
    event_now(&mut h, &d, event.as_ref());
    if d.state() == "unhandled" && d.outbox_id.is_some() && !ctx.read_only {
        redrive_form(&mut h, &d, &ctx);
    }
    stored(&mut h, &d);
    respond::ok_page(&ctx, "Dead letter", None, &h)
}

/// Every stored field of `d`, as a table.
fn details(h: &mut Html, d: &DeadLetter) {
    h.lit("<table id=\"dead-letter\">");
    let row = |h: &mut Html, name: &'static str| {
        h.lit("<tr><th>").lit(name).lit("</th><td class=\"wrap\">");
    };
    row(h, "state");
    h.lit("<span id=\"dl-state\">")
        .lit(d.state())
        .lit("</span></td></tr>");
    row(h, "recorded");
    time(h, d.created_at);
    h.lit(" UTC</td></tr>");
    row(h, "source");
    h.text(&d.source)
        .lit(" <span class=\"muted\">(")
        .text(&d.natural_id)
        .lit(")</span></td></tr>");
    row(h, "event");
    match d.outbox_id {
        Some(o) => event_link(h, o),
        None => {
            h.lit("not linked to an event: it cannot be redriven");
        }
    }
    h.lit("</td></tr>");
    row(h, "topic");
    opt(h, d.topic.as_deref());
    h.lit("</td></tr>");
    row(h, "subscriber");
    h.lit("<span id=\"dl-subscriber\">")
        .text(outbox::subscribers::label(&d.subscriber))
        .lit("</span> <span class=\"muted\">(a redrive requeues the event for this subscriber only)</span></td></tr>");
    row(h, "key");
    match (&d.topic, &d.partition_key) {
        (Some(t), Some(k)) => layout::key_link(h, t, k),
        (_, k) => opt(h, k.as_deref()),
    }
    h.lit("</td></tr>");
    row(h, "sequence");
    opt(h, d.seq);
    h.lit("</td></tr>");
    row(h, "attempts");
    opt(h, d.attempts);
    h.lit("</td></tr>");
    row(h, "status");
    opt(h, d.status);
    h.lit("</td></tr>");
    row(h, "error");
    h.lit("<span id=\"dl-error\">")
        .text(&d.error)
        .lit("</span></td></tr>");
    row(h, "QStash message / DLQ id");
    opt(h, d.qstash_message_id.as_deref());
    h.lit(" / ");
    opt(h, d.dlq_id.as_deref());
    h.lit("</td></tr>");
    row(h, "redriven");
    opt_time(h, d.redriven_at);
    h.lit("</td></tr>");
    row(h, "resolved");
    opt_time(h, d.resolved_at);
    if let Some(r) = &d.resolution {
        h.lit(" (").text(r).lit(")");
    }
    h.lit("</td></tr></table>");
}

/// What became of the dead letter's event since.
fn event_now(h: &mut Html, d: &DeadLetter, event: Option<&EventState>) {
    match event {
        Some(e) => {
            h.lit("<p>Event ");
            event_link(h, e.id);
            h.lit(" now: <strong>")
                .lit(e.state())
                .lit("</strong>, ")
                .text(e.attempts);
            h.lit(" attempt(s), redriven ")
                .text(e.redrive_count)
                .lit(" time(s)");
            if let Some(done) = e.key_done_seq {
                h.lit("; its key is done up to ").text(done);
                if let Some(b) = e.key_blocked_by {
                    h.lit(", blocked by ");
                    event_link(h, b);
                }
            }
            h.lit(".</p>");
        }
        None if d.outbox_id.is_some() => {
            h.lit("<p class=\"warn\">The event's outbox row is gone (pruned): a redrive re-inserts it from this dead letter.</p>");
        }
        None => {}
    }
}

/// The redrive form (one dead letter, optionally out of order).
fn redrive_form(h: &mut Html, d: &DeadLetter, ctx: &Ctx) {
    h.lit("<form id=\"redrive\" method=\"post\" action=\"")
        .path_id("/dead-letters/", d.id)
        .lit("/redrive\">");
    layout::csrf_field(h, ctx);
    h.lit("<label><input type=\"checkbox\" name=\"out_of_order\" value=\"1\"> out of order (an event its key has moved past is republished unordered)</label> ")
        .lit("<button class=\"primary\">Redrive</button></form>");
}

/// What the dead letter kept: the consumer's response, the payload or body, headers, a parse error, the raw
/// callback.
fn stored(h: &mut Html, d: &DeadLetter) {
    if let Some(r) = &d.response_body {
        h.lit("<h2>Response</h2><pre id=\"response\">")
            .lines(r)
            .lit("</pre>");
    }
    match (&d.payload, &d.body) {
        (Some(p), _) => {
            h.lit("<h2>Payload</h2><pre id=\"payload\">")
                .lines(&serde_json::to_string_pretty(p).unwrap_or_default())
                .lit("</pre>");
        }
        (None, Some(b)) => {
            h.lit("<h2>Body (not JSON, ")
                .text(b.len())
                .lit(" bytes)</h2><pre id=\"payload\">")
                .lines(&String::from_utf8_lossy(b))
                .lit("</pre>");
        }
        (None, None) => {}
    }
    if let Some(hd) = &d.headers {
        h.lit("<h2>Headers</h2><pre>")
            .lines(&serde_json::to_string_pretty(hd).unwrap_or_default())
            .lit("</pre>");
    }
    if let Some(p) = &d.parse_error {
        h.lit("<h2>Parse error</h2><pre>").lines(p).lit("</pre>");
    }
    if let Some(raw) = &d.raw_callback {
        h.lit("<h2>Raw callback (")
            .text(raw.len())
            .lit(" bytes)</h2><pre>")
            .lines(&String::from_utf8_lossy(raw))
            .lit("</pre>");
    }
}

/// `POST /dead-letters/{id}/redrive`: one dead letter back through the outbox; the outcome (or refusal) is
/// recorded and reported.
pub async fn redrive_one(
    State(app): S,
    Extension(ctx): Extension<Ctx>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let params = match respond::action_form(&ctx, &body) {
        Ok(p) => p,
        Err(refused) => return *refused,
    };
    let Ok(id) = id.parse::<outbox::DeadLetterId>() else {
        return bad_request(&ctx, "a dead letter id is a number");
    };
    let opts = RedriveOptions {
        out_of_order: params.flag("out_of_order"),
    };
    let mut conn = match respond::conn(&app, &ctx).await {
        Ok(c) => c,
        Err(stop) => return stop.into_response(),
    };
    let logged = match log_start(&mut conn, &ctx, "redrive", Some(id.get()), None).await {
        Ok(l) => l,
        Err(e) => return respond::db_error(&ctx, e),
    };
    let result = dead_letters::redrive(&mut conn, id, opts).await;
    let (outbox_id, outcome) = match &result {
        Ok(r) => (Some(r.outbox_id), json!({"redriven": r})),
        Err(e @ RedriveError::Database(_)) => (None, json!({"failed": e.to_string()})),
        Err(e) => (None, json!({"refused": e.to_string()})),
    };
    if let Err(e) = actions::finish(&mut conn, logged, outbox_id, &outcome).await {
        return respond::db_error(&ctx, e);
    }
    if let Err(e @ RedriveError::Database(_)) = &result {
        let mut h = Html::new();
        h.lit("<span id=\"report\">Not redriven</span>: the redrive failed on a database error and was rolled back \
               (nothing changed; action #")
            .text(logged)
            .lit(" in the action log). ");
        return stopped_page(&ctx, h, e);
    }
    let mut h = Html::new();
    let status = redrive_report(&mut h, id, &result);
    h.lit("<p><a href=\"")
        .path_id("/dead-letters/", id)
        .lit("\">back to the dead letter</a></p>");
    respond::html(status, layout::page(&ctx, "Redrive", None, &h))
}

/// What one redrive did (or why it was refused), and the answer's status.
fn redrive_report(
    h: &mut Html,
    id: outbox::DeadLetterId,
    result: &Result<dead_letters::Redriven, RedriveError>,
) -> StatusCode {
    match result {
        Ok(r) => {
            h.lit("<div class=\"report\" id=\"report\">Dead letter ");
            dead_letter_link(h, id);
            h.lit(" redriven: event ");
            event_link(h, r.outbox_id);
            h.lit(" is pending again (QStash deduplication id <code>")
                .text(&r.dedup_id)
                .lit("</code>");
            match r.order {
                dead_letters::RedriveOrder::InOrder {
                    key_unblocked: true,
                    ..
                } => {
                    h.lit("; its key is unblocked");
                }
                dead_letters::RedriveOrder::OutOfOrder { former_seq } => {
                    h.lit("; republished unordered (it had sequence ")
                        .text(former_seq)
                        .lit(")");
                }
                _ => {}
            }
            if r.reinserted {
                h.lit("; its pruned outbox row was re-inserted");
            }
            h.lit(").</div>");
            StatusCode::OK
        }
        Err(e) => {
            h.lit("<div class=\"refused\" id=\"report\">Not redriven: ")
                .text(e)
                .lit("</div>");
            StatusCode::CONFLICT
        }
    }
}
