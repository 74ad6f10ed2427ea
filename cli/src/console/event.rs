//! The event pages: the search box (`GET /events`) and one event (`GET /events/{id}`) — its row, its copies
//! with their lanes, its timeline, headers, payload and dead letters.

use axum::Extension;
use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use outbox::OutboxId;
use outbox::ops;
use outbox::ops::timeline::{EventCopy, StepKind, Timeline};
use outbox::subscribers::label;

use super::context::{self, Ctx, S};
use super::html::Html;
use super::layout::{cut, dead_letter_link, event_link, key_link, opt, time};
use super::respond;

/// `GET /events?id=…`: the event search box.
pub async fn event_search(Extension(ctx): Extension<Ctx>, uri: Uri) -> Response {
    let p = context::query(&uri);
    match p
        .get("id")
        .map(|v| v.trim_start_matches('#').parse::<i64>())
    {
        Some(Ok(id)) if id > 0 => respond::redirect(&format!("/events/{id}")),
        _ => {
            let mut h = Html::new();
            h.lit("An event id is a positive number.");
            respond::error_page(&ctx, StatusCode::BAD_REQUEST, &h)
        }
    }
}

/// `GET /events/{id}`: everything the database records about one event, as a timeline.
pub async fn event(
    State(app): S,
    Extension(ctx): Extension<Ctx>,
    Path(id): Path<String>,
) -> Response {
    let Ok(id) = id.parse::<i64>().map(OutboxId::from) else {
        return not_found(&ctx, "event");
    };
    let t = match respond::read(&app, &ctx, async |conn| {
        ops::timeline::timeline(conn, id, &app.consumers).await
    })
    .await
    {
        Ok(Some(t)) => t,
        Ok(None) => return not_found(&ctx, "event"),
        Err(stop) => return stop.into_response(),
    };
    let mut h = Html::new();
    h.lit("<h1>Event #").text(id).lit("</h1>");
    event_row(&mut h, &t);
    copies_table(&mut h, id, &t.copies);
    timeline_and_rest(&mut h, &t);
    respond::ok_page(&ctx, "Event", None, &h)
}

/// The outbox row: state, topic, subscriber, key and sequence (with its lane), attempts, message id, last error.
fn event_row(h: &mut Html, t: &Timeline) {
    match &t.event {
        None => {
            h.lit("<p class=\"warn\">The outbox row is gone (pruned); what its dead letters kept is below.</p>");
        }
        Some(e) => {
            h.lit("<table id=\"event\"><tr><th>state</th><td id=\"event-state\">")
                .lit(e.state())
                .lit("</td></tr><tr><th>topic</th><td>")
                .text(&e.topic)
                .lit("</td></tr><tr><th>subscriber</th><td id=\"event-subscriber\">")
                .text(label(&e.subscriber));
            if t.event_id != e.id {
                h.lit(" <span class=\"muted\">(this row is its copy of event ");
                event_link(h, t.event_id);
                h.lit(")</span>");
            }
            h.lit("</td></tr><tr><th>key</th><td>");
            key_link(h, &e.topic, &e.partition_key);
            h.lit("</td></tr><tr><th>sequence</th><td>");
            opt(h, e.seq);
            if let Some(k) = &t.key {
                h.lit(" <span class=\"muted\">(key done up to ")
                    .text(k.done_seq);
                if let Some(last) = k.last_seq {
                    h.lit(", last ").text(last);
                }
                h.lit(")</span>");
                if k.blocked_id == Some(e.id) {
                    h.lit(" <span class=\"bad\">blocks its key</span>");
                }
            }
            h.lit("</td></tr><tr><th>attempts</th><td>")
                .text(e.attempts)
                .lit(" <span class=\"muted\">(this round; redriven ")
                .text(e.redrive_count)
                .lit("×, republished by the reconciler ")
                .text(e.republish_count)
                .lit("×)</span></td></tr><tr><th>QStash message id</th><td>");
            opt(h, e.qstash_message_id.as_deref());
            h.lit("</td></tr><tr><th>last error</th><td class=\"wrap\">");
            opt(h, e.last_error.as_deref());
            h.lit("</td></tr></table>");
        }
    }
}

/// The timeline of what happened to the event, its headers and payload, and its dead letters.
fn timeline_and_rest(h: &mut Html, t: &Timeline) {
    h.lit("<h2>Timeline</h2><ol class=\"timeline\" id=\"timeline\">");
    for s in &t.steps {
        let class = match &s.what {
            StepKind::DeadLettered { .. } | StepKind::DeadLetterRecorded { .. } => "bad",
            StepKind::Delivered | StepKind::Applied { .. } | StepKind::Resolved { .. } => "ok",
            _ => "",
        };
        h.lit("<li class=\"")
            .lit(class)
            .lit("\"><span class=\"t\">");
        time(h, s.at);
        h.lit("</span>");
        step(h, &s.what);
        h.lit("</li>");
    }
    h.lit("</ol><p class=\"muted\">The database keeps the number of publish attempts, the current lease and the \
           last error of an event, not each attempt; every failure that ended an attempt round is a dead letter.</p>");
    if let Some(e) = &t.event {
        h.lit("<h2>Headers</h2><pre id=\"headers\">")
            .lines(&serde_json::to_string_pretty(&e.headers).unwrap_or_default())
            .lit("</pre><h2>Payload</h2><pre id=\"payload\">")
            .lines(&serde_json::to_string_pretty(&e.payload).unwrap_or_default())
            .lit("</pre>");
    }
    if !t.dead_letters.is_empty() {
        h.lit("<h2>Dead letters</h2><table><tr><th>id</th><th>recorded</th><th>source</th><th>state</th>")
            .lit("<th class=\"n\">status</th><th>error</th></tr>");
        for d in &t.dead_letters {
            h.lit("<tr><td>");
            dead_letter_link(h, d.id);
            h.lit("</td><td>");
            time(h, d.created_at);
            h.lit("</td><td>")
                .text(&d.source)
                .lit("</td><td>")
                .lit(d.state())
                .lit("</td><td class=\"n\">");
            opt(h, d.status);
            h.lit("</td><td class=\"wrap\">");
            cut(h, &d.error, 200);
            h.lit("</td></tr>");
        }
        h.lit("</table>");
    }
}

/// Each copy of the event (fan-out: one per subscriber) with its own state, lane and dead letter; nothing when the
/// event has one copy, the default subscriber's (no fan-out).
fn copies_table(h: &mut Html, this: OutboxId, copies: &[EventCopy]) {
    if copies.len() < 2 && copies.iter().all(|c| c.subscriber.is_empty()) {
        return;
    }
    h.lit("<h2>Copies (one per subscriber)</h2><table id=\"copies\"><tr><th>copy</th><th>subscriber</th>")
        .lit("<th>state</th><th class=\"n\">seq</th><th class=\"n\">attempts</th><th class=\"n\">redriven</th>")
        .lit("<th>lane</th><th>dead letter</th><th>applied</th><th>last error</th></tr>");
    for c in copies {
        h.lit("<tr data-copy-state=\"")
            .lit(c.state())
            .lit("\"><td>");
        event_link(h, c.id);
        if c.id == this {
            h.lit(" <span class=\"muted\">(this page)</span>");
        }
        h.lit("</td><td>")
            .text(label(&c.subscriber))
            .lit("</td><td class=\"")
            .lit(match c.state() {
                "dead" => "bad",
                "delivered" => "ok",
                _ => "",
            })
            .lit("\">")
            .lit(c.state())
            .lit("</td><td class=\"n\">");
        opt(h, c.seq);
        h.lit("</td><td class=\"n\">")
            .text(c.attempts)
            .lit("</td><td class=\"n\">")
            .text(c.redrive_count)
            .lit("</td><td>");
        lane(h, c);
        h.lit("</td><td>");
        if let Some(d) = c.dead_letter_id {
            dead_letter_link(h, d);
        }
        h.lit("</td><td>");
        match c.applied_at {
            Some(t) => time(h, t),
            None => {
                h.lit("-");
            }
        }
        h.lit("</td><td class=\"wrap\">");
        cut(h, c.last_error.as_deref().unwrap_or(""), 160);
        h.lit("</td></tr>");
    }
    h.lit("</table><p class=\"muted\">Each subscriber's copy has its own attempts, delivery, dead letter and \
           redrive, and its own lane of an ordered key; applied: its subscriber's consumer has a dedupe row for it.</p>");
}

/// A copy's lane in words: blocked by it, waiting on an event in flight, or done up to a sequence.
fn lane(h: &mut Html, c: &EventCopy) {
    match (c.lane_done_seq, c.lane_blocked_id, c.lane_inflight_id) {
        (None, ..) => {
            h.lit("<span class=\"muted\">-</span>");
        }
        (Some(_), Some(b), _) if b == c.id => {
            h.lit("<span class=\"bad\">blocked by this copy</span>");
        }
        (Some(done), blocked, inflight) => {
            h.lit("done up to ").text(done);
            if let Some(b) = blocked {
                h.lit(", blocked by ");
                event_link(h, b);
            } else if let Some(i) = inflight {
                h.lit(", waiting on ");
                event_link(h, i);
            }
        }
    }
}

fn step(h: &mut Html, what: &StepKind) {
    match what {
        StepKind::Created => {
            h.lit("written by the producer");
        }
        StepKind::Due { attempts } => {
            h.lit("due (delay or backoff; ")
                .text(attempts)
                .lit(" attempts so far)");
        }
        StepKind::LeaseEnds {
            attempts,
            lease_token,
        } => {
            h.lit("relay lease ends (attempt ").text(attempts);
            if let Some(t) = lease_token {
                h.lit(", lease token ").text(t);
            }
            h.lit(")");
        }
        StepKind::Dispatched { qstash_message_id } => {
            h.lit("accepted by QStash");
            if let Some(m) = qstash_message_id {
                h.lit(", message ").text(m);
            }
        }
        StepKind::Reconciled => {
            h.lit("reconciler: QStash still retrying");
        }
        StepKind::Delivered => {
            h.lit("delivery evidence recorded");
        }
        StepKind::Applied { consumer } => {
            h.lit("applied by consumer ")
                .text(consumer)
                .lit(" (dedupe row)");
        }
        StepKind::DeadLettered { .. }
        | StepKind::DeadLetterRecorded { .. }
        | StepKind::Redriven { .. }
        | StepKind::Resolved { .. }
        | StepKind::ConsoleAction { .. } => failure_step(h, what),
    }
}

/// A step of [`step`] about a failure: marked dead, a dead letter recorded, redriven or resolved, a console action.
fn failure_step(h: &mut Html, what: &StepKind) {
    match what {
        StepKind::DeadLettered { last_error } => {
            h.lit("marked dead");
            if let Some(e) = last_error {
                h.lit(": ");
                cut(h, e, 200);
            }
        }
        StepKind::DeadLetterRecorded {
            dead_letter_id,
            source,
            error,
            status,
        } => {
            h.lit("dead letter ");
            dead_letter_link(h, *dead_letter_id);
            h.lit(" recorded (").text(source);
            if let Some(s) = status {
                h.lit(", status ").text(s);
            }
            h.lit("): ");
            cut(h, error, 200);
        }
        StepKind::Redriven { dead_letter_id } => {
            h.lit("redriven (dead letter ");
            dead_letter_link(h, *dead_letter_id);
            h.lit(")");
        }
        StepKind::Resolved {
            dead_letter_id,
            resolution,
        } => {
            h.lit("dead letter ");
            dead_letter_link(h, *dead_letter_id);
            h.lit(" resolved: ");
            opt(h, resolution.as_deref());
        }
        StepKind::ConsoleAction {
            actor,
            action,
            finished,
            ..
        } => {
            h.lit("console: ").text(action).lit(" by ").text(actor);
            if !*finished {
                h.lit(" (started; no outcome recorded)");
            }
        }
        StepKind::Created
        | StepKind::Due { .. }
        | StepKind::LeaseEnds { .. }
        | StepKind::Dispatched { .. }
        | StepKind::Reconciled
        | StepKind::Delivered
        | StepKind::Applied { .. } => {}
    }
}

pub(super) fn not_found(ctx: &Ctx, what: &'static str) -> Response {
    let mut h = Html::new();
    h.lit("No such ").lit(what).lit(".");
    respond::error_page(ctx, StatusCode::NOT_FOUND, &h)
}
