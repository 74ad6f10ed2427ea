//! The overview page (`GET /`): the numbers of `outbox status`, from the same library call, as cards the browser
//! tests read back, and dispatched per minute as a chart.

use axum::Extension;
use axum::extract::State;
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use outbox::ops::{self, Status};
use outbox::subscribers::label;

use super::context::{self, Ctx, S};
use super::html::Html;
use super::layout::{age, ago, cut, dead_letter_link, event_link, key_link, opt, opt_time, time};
use super::respond;
use super::tenants;

/// A figure the browser tests read back: `<span data-figure="backlog.pending">12</span>` (the path is the
/// figure's place in `outbox status --json`).
fn figure(h: &mut Html, path: &'static str, value: impl std::fmt::Display) {
    h.lit("<span data-figure=\"")
        .lit(path)
        .lit("\">")
        .text(value)
        .lit("</span>");
}

fn card(
    h: &mut Html,
    label: &'static str,
    path: &'static str,
    value: impl std::fmt::Display,
    class: &'static str,
) {
    h.lit("<div class=\"card\"><div class=\"v ")
        .lit(class)
        .lit("\">");
    figure(h, path, value);
    h.lit("</div><div class=\"l\">")
        .lit(label)
        .lit("</div></div>");
}

/// `GET /`: the numbers of `outbox status`, from the same library call, and dispatched per minute as a chart.
pub async fn overview(State(app): S, Extension(ctx): Extension<Ctx>, uri: Uri) -> Response {
    let s = match ops::status_with_horizon(&app.pool, app.horizon).await {
        Ok(s) => s,
        Err(e) => return respond::db_error(&ctx, e),
    };
    let params = context::query(&uri);
    let refresh = (app.refresh_secs > 0 && !params.flag("pause")).then_some(app.refresh_secs);
    let mut h = Html::new();
    h.lit("<h1>Overview</h1><p class=\"muted\">At ");
    time(&mut h, s.at);
    h.lit(" UTC · ");
    match refresh {
        Some(secs) => {
            h.lit("refreshes every ")
                .text(secs)
                .lit("s · <a href=\"/?pause=1\">pause</a>");
        }
        None => {
            h.lit("not refreshing · <a href=\"/\">refresh live</a>");
        }
    }
    h.lit("</p>");
    cards(&mut h, &s);
    outage(&mut h, &s);
    h.lit("<h2>Dispatched per minute, last hour</h2>");
    chart(&mut h, &s.throughput.per_minute);
    blocked_keys(&mut h, &s);
    match tenants::section(&app, &ctx, None).await {
        Ok(t) => h.push(&t),
        Err(stop) => return stop.into_response(),
    };
    subscribers(&mut h, &s.subscribers);
    dead_letters(&mut h, &s);
    stuck_and_flapping(&mut h, &s);
    reconciler(&mut h, &s);
    respond::ok_page(&ctx, "Overview", refresh, &h)
}

/// The figures of `outbox status`, as cards.
fn cards(h: &mut Html, s: &Status) {
    h.lit("<div class=\"cards\">");
    let b = &s.backlog;
    card(h, "pending", "backlog.pending", b.pending, "");
    let lag_class = if b.oldest_pending_age_secs > 300.0 {
        "warn"
    } else {
        ""
    };
    h.lit("<div class=\"card\"><div class=\"v ")
        .lit(lag_class)
        .lit("\">");
    age(h, b.oldest_pending_age_secs);
    h.lit("</div><div class=\"l\">oldest pending age (<span data-figure=\"backlog.oldest_pending_age_secs\">")
        .text(format!("{:.1}", b.oldest_pending_age_secs))
        .lit("</span> s)</div></div>");
    card(h, "in flight", "in_flight.total", s.in_flight.total, "");
    card(
        h,
        "unaccounted",
        "in_flight.unaccounted",
        s.in_flight.unaccounted,
        if s.in_flight.unaccounted > 0 {
            "bad"
        } else {
            ""
        },
    );
    card(
        h,
        "dispatched, last hour",
        "throughput.last_hour",
        s.throughput.last_hour,
        "",
    );
    card(
        h,
        "blocked keys",
        "blocked_keys.count",
        s.blocked_keys.count,
        if s.blocked_keys.count > 0 { "bad" } else { "" },
    );
    let unresolved = s.unresolved_dead_letters();
    card(
        h,
        "dead letters unresolved",
        "unresolved_dead_letters",
        unresolved,
        if unresolved > 0 { "bad" } else { "" },
    );
    card(
        h,
        "flapping",
        "backlog.flapping",
        b.flapping,
        if b.flapping > 0 { "warn" } else { "" },
    );
    card(
        h,
        "stuck leases",
        "stuck_leases.count",
        s.stuck_leases.count,
        if s.stuck_leases.count > 0 { "warn" } else { "" },
    );
    card(
        h,
        "awaiting evidence",
        "awaiting_evidence.count",
        s.awaiting_evidence.count,
        "",
    );
    h.lit("</div>");
}

/// QStash: an outage under way, or none.
fn outage(h: &mut Html, s: &Status) {
    h.lit("<h2>QStash</h2><p id=\"outage\">");
    let o = &s.qstash_outage;
    match o.since {
        None => {
            h.lit("<span class=\"ok\" data-figure=\"qstash_outage.active\">no outage</span>");
        }
        Some(since) => {
            h.lit("<span class=\"bad\" data-figure=\"qstash_outage.active\">outage</span> since ");
            time(h, since);
            h.lit(" UTC (");
            ago(h, o.now, since);
            h.lit("), ")
                .text(o.failures)
                .lit(" failed cycles or probes; next probe ");
            opt_time(h, o.next_probe_at);
            h.lit("; last error: ");
            cut(h, o.last_error.as_deref().unwrap_or(""), 200);
        }
    }
    h.lit("</p>");
}

/// The blocked ordered keys, with their head event and dead letter.
fn blocked_keys(h: &mut Html, s: &Status) {
    h.lit("<h2>Blocked keys</h2>");
    if s.blocked_keys.keys.is_empty() {
        h.lit("<p class=\"muted\">none</p>");
    } else {
        h.lit(
            "<table id=\"blocked\"><tr><th>topic</th><th>key</th><th>subscriber</th><th>since</th><th>head event</th>",
        )
        .lit("<th>dead letter</th><th class=\"n\">waiting</th><th>reason</th></tr>");
        for k in &s.blocked_keys.keys {
            h.lit("<tr><td>").text(&k.topic).lit("</td><td>");
            key_link(h, &k.topic, &k.partition_key);
            h.lit("</td><td>")
                .text(label(&k.subscriber))
                .lit("</td><td>");
            ago(h, s.at, k.since);
            h.lit("</td><td>");
            if let Some(id) = k.blocking_event {
                event_link(h, id);
            }
            h.lit("</td><td>");
            if let Some(id) = k.dead_letter_id {
                dead_letter_link(h, id);
            }
            h.lit("</td><td class=\"n\">");
            opt(h, k.waiting);
            h.lit("</td><td class=\"wrap\">");
            cut(h, k.reason.as_deref().unwrap_or(""), 160);
            h.lit("</td></tr>");
        }
        h.lit("</table>");
        if s.blocked_keys.count > s.blocked_keys.keys.len() as i64 {
            h.lit("<p><a href=\"/keys?blocked=1\">all blocked keys</a></p>");
        }
    }
}

/// Dead letters by topic and source.
fn dead_letters(h: &mut Html, s: &Status) {
    h.lit("<h2>Dead letters by topic and source</h2>");
    if s.dead_letters.is_empty() {
        h.lit("<p class=\"muted\">none</p>");
    } else {
        h.lit("<table><tr><th>topic</th><th>source</th><th class=\"n\">unresolved</th><th class=\"n\">redriven</th>")
            .lit("<th class=\"n\">resolved</th><th class=\"n\">applied</th><th>oldest unresolved</th></tr>");
        for d in &s.dead_letters {
            h.lit("<tr><td>");
            match &d.topic {
                Some(t) => {
                    h.lit("<a href=\"")
                        .href("/dead-letters", &[("topic", t), ("source", &d.source)])
                        .lit("\">")
                        .text(t)
                        .lit("</a>");
                }
                None => {
                    h.lit("<span class=\"muted\">(unknown)</span>");
                }
            }
            h.lit("</td><td>")
                .text(&d.source)
                .lit("</td><td class=\"n\">")
                .text(d.unresolved);
            h.lit("</td><td class=\"n\">")
                .text(d.redriven)
                .lit("</td><td class=\"n\">")
                .text(d.resolved);
            h.lit("</td><td class=\"n\">")
                .text(d.applied)
                .lit("</td><td>");
            if let Some(t) = d.oldest_unresolved {
                ago(h, s.at, t);
            }
            h.lit("</td></tr>");
        }
        h.lit("</table>");
    }
}

/// Stuck leases and flapping events.
fn stuck_and_flapping(h: &mut Html, s: &Status) {
    let b = &s.backlog;
    h.lit("<h2>Stuck leases and flapping events</h2>");
    let lines: Vec<_> = s
        .stuck_leases
        .oldest
        .iter()
        .chain(&b.flapping_rows)
        .collect();
    if lines.is_empty() {
        h.lit("<p class=\"muted\">none</p>");
    } else {
        h.lit("<table><tr><th>event</th><th>topic</th><th>key</th><th>subscriber</th><th class=\"n\">attempts</th><th>written</th>")
            .lit("<th>last error</th></tr>");
        for e in lines {
            h.lit("<tr><td>");
            event_link(h, e.id);
            h.lit("</td><td>").text(&e.topic).lit("</td><td>");
            cut(h, &e.partition_key, 40);
            h.lit("</td><td>")
                .text(label(&e.subscriber))
                .lit("</td><td class=\"n\">")
                .text(e.attempts)
                .lit("</td><td>");
            ago(h, s.at, e.created_at);
            h.lit("</td><td class=\"wrap\">");
            cut(h, e.last_error.as_deref().unwrap_or(""), 160);
            h.lit("</td></tr>");
        }
        h.lit("</table>");
    }
}

/// The reconciler's counts, all time.
fn reconciler(h: &mut Html, s: &Status) {
    let r = &s.reconciler;
    h.lit("<h2>Reconciler (all time)</h2><p>applied by dedupe row ")
        .text(r.swept_applied)
        .lit(" · recorded from QStash's DLQ ")
        .text(r.recorded_from_dlq)
        .lit(" · republished ")
        .text(r.republished)
        .lit(" · still retrying ")
        .text(r.still_retrying)
        .lit(" · dead-lettered unaccounted ")
        .text(r.unaccounted_dead)
        .lit(" · failed lookups ")
        .text(r.lookup_failures);
    if let Some(e) = &r.last_error {
        h.lit(" · last error: ");
        cut(h, e, 200);
    }
    h.lit("</p>");
}

/// Per subscriber of the topics with named subscribers (fan-out; nothing without it): its lag, in flight, blocked
/// lanes and dead letters, each linking to the subscribers page.
fn subscribers(h: &mut Html, subs: &[ops::subscribers::SubscriberStatus]) {
    if subs.is_empty() {
        return;
    }
    h.lit("<h2>Subscribers</h2><table id=\"overview-subscribers\"><tr><th>topic</th><th>subscriber</th>")
        .lit("<th class=\"n\">pending</th><th>lag</th><th class=\"n\">in flight</th>")
        .lit("<th class=\"n\">blocked keys</th><th class=\"n\">dead letters</th><th></th></tr>");
    for x in subs {
        let name = label(&x.subscriber);
        h.lit("<tr><td><a href=\"")
            .href("/subscribers", &[("topic", &x.topic)])
            .lit("\">")
            .text(&x.topic)
            .lit("</a></td><td>")
            .text(name)
            .lit("</td><td class=\"n\">")
            .text(x.pending)
            .lit("</td><td>");
        if x.pending > 0 {
            age(h, x.oldest_pending_age_secs);
        }
        h.lit("</td><td class=\"n\">")
            .text(x.in_flight)
            .lit("</td><td class=\"n\">")
            .text(x.blocked_keys)
            .lit("</td><td class=\"n\">")
            .text(x.dead_letters)
            .lit("</td><td>");
        if x.replaying {
            h.lit("<span class=\"warn\">replaying</span>");
        }
        h.lit("</td></tr>");
    }
    h.lit("</table>");
}

/// Dispatched per minute as an SVG bar chart (60 bars, oldest first; each bar's count in its tooltip).
fn chart(h: &mut Html, minutes: &[ops::MinuteCount]) {
    const W: i64 = 720;
    const H: i64 = 140;
    const TOP: i64 = 16;
    const BOTTOM: i64 = 20;
    let max = minutes
        .iter()
        .map(|m| m.dispatched)
        .max()
        .unwrap_or(0)
        .max(1);
    let bar = W / 60;
    h.lit("<svg class=\"chart\" id=\"throughput\" width=\"720\" height=\"140\" viewBox=\"0 0 720 140\" role=\"img\" aria-label=\"dispatched per minute\">");
    h.lit("<text x=\"4\" y=\"12\" font-size=\"11\" fill=\"#5f6b7a\">max ")
        .text(max)
        .lit("/min</text>");
    for (i, m) in minutes.iter().enumerate() {
        let height = (m.dispatched * (H - TOP - BOTTOM)) / max;
        let x = i as i64 * bar;
        h.lit("<rect x=\"")
            .text(x + 1)
            .lit("\" y=\"")
            .text(H - BOTTOM - height)
            .lit("\" width=\"")
            .text(bar - 2)
            .lit("\" height=\"")
            .text(height)
            .lit("\" fill=\"#1f6feb\"><title>")
            .text(m.minute.format("%H:%M"))
            .lit(" UTC: ")
            .text(m.dispatched)
            .lit("</title></rect>");
        if i % 10 == 0 {
            h.lit("<text x=\"")
                .text(x)
                .lit("\" y=\"")
                .text(H - 5)
                .lit("\" font-size=\"11\" fill=\"#5f6b7a\">")
                .text(m.minute.format("%H:%M"))
                .lit("</text>");
        }
    }
    h.lit("</svg>");
}
