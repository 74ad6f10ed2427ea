//! The read-only pages besides the overview (`overview.rs`), the subscribers (`subscribers.rs`) and the events
//! (`event.rs`): topics, keys (a line per subscriber's lane), the action log; and logging in and out.

use axum::Extension;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use outbox::ops::keys::{KeyCursor, KeyLine, KeyQuery};
use outbox::ops::{self};
use outbox::subscribers::label;

use super::auth;
use super::context::{self, Ctx, Params, S};
use super::html::Html;
use super::layout::{age, ago, cut, dead_letter_link, event_link, opt, time};
use super::respond;
use super::tenants;

/// How many keys a page lists.
const KEYS_PAGE: u32 = 50;

/// `GET /topics[?topic=…]`: per topic, the backlog and lag, what is in flight, its ordered keys and dead letters;
/// one topic's page adds its tenants (fairness keys) by lag.
pub async fn topics(State(app): S, Extension(ctx): Extension<Ctx>, uri: Uri) -> Response {
    let topic = context::query(&uri).string("topic");
    let mut rows = match respond::read(&app, &ctx, async |conn| {
        ops::topics::topics(conn, 500).await
    })
    .await
    {
        Ok(v) => v,
        Err(stop) => return stop.into_response(),
    };
    let mut h = Html::new();
    match &topic {
        Some(t) => {
            rows.retain(|r| &r.topic == t);
            h.lit("<h1>Topic ")
                .text(t)
                .lit("</h1><p><a href=\"/topics\">all topics</a></p>");
        }
        None => {
            h.lit("<h1>Topics</h1>");
        }
    }
    if rows.is_empty() {
        h.lit("<p class=\"muted\">Nothing pending, in flight, blocked or dead.</p>");
    } else {
        h.lit("<table id=\"topics\"><tr><th>topic</th><th class=\"n\">pending</th><th>lag (oldest pending)</th>")
            .lit("<th class=\"n\">in flight</th><th>oldest in flight</th><th class=\"n\">active keys</th>")
            .lit("<th class=\"n\">blocked keys</th><th class=\"n\">dead letters</th></tr>");
        for t in &rows {
            h.lit("<tr><td><a href=\"")
                .href("/topics", &[("topic", &t.topic)])
                .lit("\">")
                .text(&t.topic)
                .lit("</a></td><td class=\"n\">")
                .text(t.pending)
                .lit("</td><td>");
            if t.pending > 0 {
                age(&mut h, t.oldest_pending_age_secs);
            }
            h.lit("</td><td class=\"n\">")
                .text(t.in_flight)
                .lit("</td><td>");
            if t.in_flight > 0 {
                age(&mut h, t.oldest_in_flight_secs);
            }
            h.lit("</td><td class=\"n\"><a href=\"")
                .href("/keys", &[("topic", &t.topic)])
                .lit("\">")
                .text(t.active_keys)
                .lit("</a></td><td class=\"n\"><a href=\"")
                .href("/keys", &[("topic", &t.topic), ("blocked", "1")])
                .lit("\">")
                .text(t.blocked_keys)
                .lit("</a></td><td class=\"n\"><a href=\"")
                .href("/dead-letters", &[("topic", &t.topic)])
                .lit("\">")
                .text(t.unhandled_dead_letters)
                .lit("</a></td></tr>");
        }
        h.lit("</table>");
    }
    h.lit("<p class=\"muted\">Lag is the age of the topic's oldest pending event; in flight means accepted by QStash with no outcome yet. \
           With fan-out the figures count copies (one per subscriber of each event) over all subscribers; each \
           subscriber's own are on the <a href=\"/subscribers\">subscribers</a> page.</p>");
    if let Some(t) = &topic {
        match tenants::section(&app, &ctx, Some(t)).await {
            Ok(section) => h.push(&section),
            Err(stop) => return stop.into_response(),
        };
    }
    respond::ok_page(&ctx, "Topics", None, &h)
}

/// `GET /keys`: ordered keys, a line per subscriber's lane, a page at a time; search by key prefix, one topic, one
/// subscriber, blocked only.
pub async fn keys(State(app): S, Extension(ctx): Extension<Ctx>, uri: Uri) -> Response {
    let p = context::query(&uri);
    let subscriber = match p.get("subscriber").map(outbox::subscribers::parse_name) {
        Some(Err(e)) => {
            let mut h = Html::new();
            h.text(e);
            return respond::error_page(&ctx, StatusCode::BAD_REQUEST, &h);
        }
        Some(Ok(s)) => Some(s),
        None => None,
    };
    let after = match (p.string("after_topic"), p.string("after_key")) {
        (Some(topic), Some(partition_key)) => Some(KeyCursor {
            topic,
            partition_key,
            subscriber: p.string("after_subscriber").unwrap_or_default(),
        }),
        _ => None,
    };
    let q = KeyQuery {
        topic: p.string("topic"),
        key_prefix: p.string("key"),
        subscriber,
        blocked_only: p.flag("blocked"),
        after,
        limit: KEYS_PAGE,
    };
    let page = match respond::read(&app, &ctx, async |conn| ops::keys::keys(conn, &q).await).await {
        Ok(v) => v,
        Err(stop) => return stop.into_response(),
    };
    let now = chrono::Utc::now();
    let mut h = Html::new();
    let subscriber = q.subscriber.as_deref().map(label).unwrap_or("");
    h.lit("<h1>Ordered keys</h1><form class=\"filters\" method=\"get\" action=\"/keys\">")
        .lit("<label>key starts with<input name=\"key\" value=\"")
        .text(q.key_prefix.as_deref().unwrap_or(""))
        .lit("\"></label><label>topic<input name=\"topic\" value=\"")
        .text(q.topic.as_deref().unwrap_or(""))
        .lit("\"></label><label>subscriber<input name=\"subscriber\" size=\"12\" value=\"")
        .text(subscriber)
        .lit("\"></label><label><span><input type=\"checkbox\" name=\"blocked\" value=\"1\"");
    if q.blocked_only {
        h.lit(" checked");
    }
    h.lit("> blocked only</span></label><button>Search</button></form>");
    if page.items.is_empty() {
        h.lit("<p class=\"muted\">No key matches.</p>");
    } else {
        h.lit("<table id=\"keys\"><tr><th>topic</th><th>key</th><th>subscriber</th><th>state</th>")
            .lit("<th class=\"n\">done</th><th class=\"n\">last</th><th class=\"n\">unfinished</th><th>head</th>")
            .lit("<th>head age</th><th class=\"n\">attempts</th><th>in flight</th><th>blocked</th>")
            .lit("<th>reason / last error</th></tr>");
        for k in &page.items {
            key_row(&mut h, k, now);
        }
        h.lit("</table>");
    }
    h.lit("<p class=\"muted\">A line per subscriber's lane: each subscriber of a topic has its own state of each key \
           (fan-out). A key no subscriber has work on shows once, without a subscriber.</p>");
    if let Some(c) = &page.next_after {
        h.lit("<p class=\"pager\"><a id=\"next\" href=\"")
            .href(
                "/keys",
                &[
                    ("key", q.key_prefix.as_deref().unwrap_or("")),
                    ("topic", q.topic.as_deref().unwrap_or("")),
                    ("subscriber", subscriber),
                    ("blocked", if q.blocked_only { "1" } else { "" }),
                    ("after_topic", &c.topic),
                    ("after_key", &c.partition_key),
                    ("after_subscriber", &c.subscriber),
                ],
            )
            .lit("\">next page →</a></p>");
    }
    respond::ok_page(&ctx, "Keys", None, &h)
}

/// One line of the keys page.
fn key_row(h: &mut Html, k: &KeyLine, now: chrono::DateTime<chrono::Utc>) {
    let state = k.state();
    h.lit("<tr data-key-state=\"")
        .lit(state)
        .lit("\"><td>")
        .text(&k.topic)
        .lit("</td><td>");
    cut(h, &k.partition_key, 60);
    h.lit("</td><td class=\"subscriber\">");
    match &k.subscriber {
        Some(s) => {
            h.text(label(s));
        }
        None => {
            h.lit("<span class=\"muted\">-</span>");
        }
    }
    h.lit("</td><td class=\"");
    h.lit(match state {
        "blocked" => "bad",
        "in flight" => "ok",
        _ => "",
    });
    h.lit("\">").lit(state).lit("</td><td class=\"n\">");
    opt(h, k.done_seq);
    h.lit("</td><td class=\"n\">")
        .text(k.last_seq)
        .lit("</td><td class=\"n\">")
        .text(k.unfinished());
    h.lit("</td><td>");
    if let Some(id) = k.head_id {
        event_link(h, id);
    }
    h.lit("</td><td>");
    if let Some(t) = k.head_created_at {
        ago(h, now, t);
    }
    h.lit("</td><td class=\"n\">");
    opt(h, k.head_attempts);
    h.lit("</td><td>");
    if let Some(id) = k.inflight_id {
        event_link(h, id);
        if let Some(t) = k.inflight_since {
            h.lit(" for ");
            age(h, (now - t).as_seconds_f64());
        }
    }
    h.lit("</td><td>");
    if let Some(t) = k.blocked_at {
        ago(h, now, t);
        if let Some(id) = k.blocked_id {
            h.lit(" by ");
            event_link(h, id);
        }
    }
    h.lit("</td><td class=\"wrap\">");
    let why = k.blocked_reason.as_deref().or(k.head_last_error.as_deref());
    cut(h, why.unwrap_or(""), 160);
    h.lit("</td></tr>");
}

/// `GET /actions`: the latest actions taken through the console.
pub async fn actions(State(app): S, Extension(ctx): Extension<Ctx>) -> Response {
    let rows = match respond::read(&app, &ctx, async |conn| {
        ops::actions::recent(conn, 200).await
    })
    .await
    {
        Ok(v) => v,
        Err(stop) => return stop.into_response(),
    };
    let mut h = Html::new();
    h.lit("<h1>Console actions</h1>");
    if rows.is_empty() {
        h.lit("<p class=\"muted\">None yet.</p>");
    } else {
        h.lit("<table id=\"actions\"><tr><th>#</th><th>at</th><th>who</th><th>what</th><th>dead letter</th>")
            .lit("<th>event</th><th>selection</th><th>finished</th><th>outcome</th></tr>");
        for a in &rows {
            h.lit("<tr><td>").text(a.id).lit("</td><td>");
            time(&mut h, a.at);
            h.lit("</td><td>")
                .text(&a.actor)
                .lit("</td><td>")
                .text(&a.action)
                .lit("</td><td>");
            if let Some(id) = a.dead_letter_id {
                dead_letter_link(&mut h, id);
            }
            h.lit("</td><td>");
            if let Some(id) = a.outbox_id {
                event_link(&mut h, id);
            }
            h.lit("</td><td class=\"wrap\">");
            if let Some(s) = &a.selection {
                cut(&mut h, &s.to_string(), 200);
            }
            h.lit("</td><td>");
            match a.finished_at {
                Some(t) => time(&mut h, t),
                None => {
                    h.lit("<span class=\"warn\">not yet</span>");
                }
            }
            h.lit("</td><td class=\"wrap\">");
            match &a.outcome {
                Some(o) => cut(&mut h, &o.to_string(), 300),
                None => {
                    h.lit("<span class=\"muted\">under way, or it stopped without reporting back</span>");
                }
            }
            h.lit("</td></tr>");
        }
        h.lit("</table>");
    }
    respond::ok_page(&ctx, "Actions", None, &h)
}

fn login_page(message: Option<&'static str>) -> Html {
    let mut h = Html::new();
    h.lit("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><link rel=\"stylesheet\" href=\"/console.css\">")
        .lit("<title>Log in · outbox console</title></head><body><header><span class=\"brand\">outbox console</span></header><main>")
        .lit("<h1>Log in</h1>");
    if let Some(m) = message {
        h.lit("<div class=\"refused\">").lit(m).lit("</div>");
    }
    h.lit("<form method=\"post\" action=\"/login\"><label>Token (<code>name:secret</code>) ")
        .lit("<input type=\"password\" name=\"token\" autocomplete=\"current-password\" autofocus></label> ")
        .lit("<button class=\"primary\">Log in</button></form></main></body></html>");
    h
}

/// `GET /login`.
pub async fn login_form(State(app): S) -> Response {
    if app.tokens.is_empty() {
        return respond::redirect("/");
    }
    respond::html(StatusCode::OK, login_page(None))
}

/// `POST /login`: a token in, a session cookie out.
pub async fn login(State(app): S, body: Bytes) -> Response {
    if app.tokens.is_empty() {
        return respond::redirect("/");
    }
    let params = Params::parse(&body);
    let Some(name) = params
        .get("token")
        .and_then(|t| auth::check_token(&app.tokens, t))
    else {
        tracing::warn!("console log-in refused: unknown token");
        return respond::html(StatusCode::UNAUTHORIZED, login_page(Some("Unknown token.")));
    };
    tracing::info!(actor = %name, "console log-in");
    let (_, value) = app.keys.issue(&name, chrono::Utc::now().timestamp());
    let mut response = respond::redirect("/");
    if let Ok(v) = header::HeaderValue::from_str(&respond::session_cookie(&value)) {
        response.headers_mut().append(header::SET_COOKIE, v);
    }
    response
}

/// `POST /logout`: the session cookie is cleared (the session itself lives until it expires or the console
/// restarts: the cookie is all there is).
pub async fn logout(Extension(ctx): Extension<Ctx>, body: Bytes) -> Response {
    if let Err(refused) = respond::checked_csrf(&ctx, Params::parse(&body)) {
        return *refused;
    }
    let mut response = respond::redirect("/login");
    response.headers_mut().append(
        header::SET_COOKIE,
        header::HeaderValue::from_static(
            "outbox_console=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0",
        ),
    );
    response.into_response()
}
