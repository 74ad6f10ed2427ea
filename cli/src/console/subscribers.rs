//! The subscribers page (`GET /subscribers`): fan-out per subscriber and topic — its lag, what it has in flight,
//! its blocked lanes and dead letters (each linking to the keys and dead letters of that subscriber), and its
//! replay's progress. The figures are `outbox status`'s and the list `outbox subscribers list`'s
//! ([`outbox::ops::fanout`]).

use axum::Extension;
use axum::extract::State;
use axum::http::Uri;
use axum::response::Response;
use outbox::db::{Db, Statements};
use outbox::ops::fanout::{self, SubscriberLine};
use outbox::subscribers::{Replay, label};

use super::context::{self, Ctx, S};
use super::html::Html;
use super::layout::{age, opt, opt_time};
use super::respond;

/// `GET /subscribers[?topic=…]`.
pub async fn subscribers(State(app): S, Extension(ctx): Extension<Ctx>, uri: Uri) -> Response {
    let p = context::query(&uri);
    let topic = p.string("topic");
    let db = Db::new(app.pool.clone(), Statements::Prepared);
    let lines = match fanout::subscribers(&db, topic.as_deref()).await {
        Ok(l) => l,
        Err(e) => return respond::db_error(&ctx, e),
    };
    let mut h = Html::new();
    h.lit("<h1>Subscribers</h1><form class=\"filters\" method=\"get\" action=\"/subscribers\">")
        .lit("<label>topic<input name=\"topic\" value=\"")
        .text(topic.as_deref().unwrap_or(""))
        .lit("\"></label><button>Filter</button> <a href=\"/subscribers\">all</a></form>");
    if lines.is_empty() {
        h.lit("<p class=\"muted\" id=\"no-fanout\">No topic has named subscribers: every event goes to the default \
               subscriber (the relay's <code>CONSUMER_URL</code>), and the topics page shows its figures.</p>");
    } else {
        h.lit("<table id=\"subscribers\"><tr><th>topic</th><th>subscriber</th><th>state</th><th>URL</th>")
            .lit("<th>added</th><th class=\"n\">pending</th><th>lag (oldest pending)</th><th class=\"n\">in flight</th>")
            .lit("<th>oldest in flight</th><th class=\"n\">blocked keys</th><th class=\"n\">dead letters</th>")
            .lit("<th>replay</th></tr>");
        for l in &lines {
            row(&mut h, l);
        }
        h.lit("</table>");
    }
    h.lit("<p class=\"muted\">Each subscriber gets its own copy of every event of its topic, with its own retries, \
           dead letters and ordered lanes: one subscriber's dead head or slow consumer holds back its own events \
           only. Lag is the age of its oldest pending copy. A topic with only the default subscriber is not listed. \
           Manage them with <code>outbox subscribers</code>.</p>");
    respond::ok_page(&ctx, "Subscribers", None, &h)
}

/// One subscriber's line.
fn row(h: &mut Html, l: &SubscriberLine) {
    let s = &l.subscriber;
    let name = label(&s.name);
    h.lit("<tr data-subscriber=\"")
        .text(name)
        .lit("\" data-state=\"")
        .lit(l.state())
        .lit("\"><td>")
        .text(&s.topic)
        .lit("</td><td>")
        .text(name)
        .lit("</td><td class=\"")
        .lit(match l.state() {
            "removed" => "muted",
            "replaying" => "warn",
            _ => "",
        })
        .lit("\">")
        .lit(l.state());
    if s.removed_at.is_some() {
        h.lit(" ");
        opt_time(h, s.removed_at);
    }
    h.lit("</td><td class=\"wrap\">");
    match &s.url {
        Some(u) => {
            h.text(u);
        }
        None => {
            h.lit("<span class=\"muted\">the relay's CONSUMER_URL</span>");
        }
    }
    h.lit("</td><td>");
    opt_time(h, s.added_at);
    h.lit("</td>");
    figures(h, l);
    h.lit("<td>");
    if let Some(r) = &s.replay {
        replay(h, r);
    }
    h.lit("</td></tr>");
}

/// The figures' cells (empty for a removed subscriber, but for its dead letters' link).
fn figures(h: &mut Html, l: &SubscriberLine) {
    let s = &l.subscriber;
    let name = label(&s.name);
    let Some(f) = &l.figures else {
        h.lit("<td></td><td></td><td></td><td></td><td></td><td class=\"n\"><a href=\"")
            .href(
                "/dead-letters",
                &[("topic", &s.topic), ("subscriber", name)],
            )
            .lit("\">list</a></td>");
        return;
    };
    h.lit("<td class=\"n\" data-figure=\"pending\">")
        .text(f.pending)
        .lit("</td><td>");
    if f.pending > 0 {
        age(h, f.oldest_pending_age_secs);
    }
    h.lit("</td><td class=\"n\" data-figure=\"in_flight\">")
        .text(f.in_flight)
        .lit("</td><td>");
    if f.in_flight > 0 {
        age(h, f.oldest_in_flight_age_secs);
    }
    h.lit("</td><td class=\"n\"><a data-figure=\"blocked_keys\" href=\"")
        .href(
            "/keys",
            &[("topic", &s.topic), ("subscriber", name), ("blocked", "1")],
        )
        .lit("\">")
        .text(f.blocked_keys)
        .lit("</a></td><td class=\"n\"><a data-figure=\"dead_letters\" href=\"")
        .href(
            "/dead-letters",
            &[("topic", &s.topic), ("subscriber", name)],
        )
        .lit("\">")
        .text(f.dead_letters)
        .lit("</a></td>");
}

/// A replay's progress: `copied 40 of events 17–120, up to 64` or done at.
fn replay(h: &mut Html, r: &Replay) {
    h.lit("<span data-figure=\"replay\">events ").text(r.from);
    match r.to {
        Some(to) => {
            h.lit("–").text(to);
        }
        None => {
            h.lit(" on (end not fixed yet)");
        }
    }
    h.lit(": ").text(r.copied).lit(" copied");
    match r.done_at {
        Some(_) => {
            h.lit(", done ");
            opt_time(h, r.done_at);
        }
        None => {
            h.lit(", up to ");
            opt(h, r.done_to);
        }
    }
    h.lit("</span>");
}
