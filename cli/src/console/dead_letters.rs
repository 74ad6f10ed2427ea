//! The dead-letter pages: filters, the groups by normalised error, the list, one dead letter, and the guarded
//! actions — redrive one; bulk redrive and purge only with a filter, after a confirmation page that shows how many
//! they will touch (and fixes the selection to the dead letters counted), with a report afterwards. Every action
//! is recorded in the action log with who took it.

use axum::Extension;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};
use axum::response::Response;
use chrono::{DateTime, Utc};
use outbox::dead_letters::{
    self, BulkOutcome, DeadLetterSummary, Filter, ListQuery, RedriveOptions, Source,
};
use outbox::ops::actions::{self, NewAction};
use serde_json::json;

use super::html::Html;
use super::layout::{self, cut, dead_letter_link, event_link, opt, opt_time, time};
use super::server::{self, Ctx, Params, S};

/// Dead letters per list page.
const PAGE: u32 = 50;

/// Groups shown.
const GROUPS: u32 = 30;

/// The filter the parameters describe (`max_id` too, when given), or what is wrong with them.
fn filter_of(p: &Params) -> Result<Filter, String> {
    let time = |name: &str| -> Result<Option<DateTime<Utc>>, String> {
        p.get(name)
            .map(|v| crate::dead_letters::parse_time(v).map_err(|e| format!("{name}: {e}")))
            .transpose()
    };
    Ok(Filter {
        topic: p.string("topic"),
        source: p.get("source").map(str::parse::<Source>).transpose()?,
        key: p.string("key"),
        since: time("since")?,
        until: time("until")?,
        error: p.string("error"),
        error_group: p.string("group"),
        max_id: p
            .get("max_id")
            .map(|v| {
                v.parse::<i64>()
                    .map_err(|_| "max_id: not a number".to_owned())
            })
            .transpose()?,
        subscriber: p
            .get("subscriber")
            .map(|v| outbox::subscribers::parse_name(v).map_err(|e| e.to_string()))
            .transpose()?,
    })
}

/// The filter as parameters (times as RFC 3339, so a confirmation carries exactly what was counted).
fn params_of(f: &Filter) -> Vec<(&'static str, String)> {
    let mut v = vec![
        ("topic", f.topic.clone().unwrap_or_default()),
        (
            "source",
            f.source.map(|s| s.as_str().to_owned()).unwrap_or_default(),
        ),
        ("key", f.key.clone().unwrap_or_default()),
        ("error", f.error.clone().unwrap_or_default()),
        ("group", f.error_group.clone().unwrap_or_default()),
        ("since", f.since.map(|t| t.to_rfc3339()).unwrap_or_default()),
        ("until", f.until.map(|t| t.to_rfc3339()).unwrap_or_default()),
    ];
    if let Some(m) = f.max_id {
        v.push(("max_id", m.to_string()));
    }
    v
}

fn pairs<'a>(v: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    v.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// The filter in words.
fn describe(h: &mut Html, f: &Filter) {
    let mut first = true;
    let mut part = |h: &mut Html, name: &'static str, value: String| {
        if !first {
            h.lit(", ");
        }
        first = false;
        h.lit(name).lit(" <code>").text(value).lit("</code>");
    };
    if let Some(t) = &f.topic {
        part(h, "topic", t.clone());
    }
    if let Some(s) = f.source {
        part(h, "source", s.as_str().to_owned());
    }
    if let Some(k) = &f.key {
        part(h, "key", k.clone());
    }
    if let Some(e) = &f.error {
        part(h, "error contains", e.clone());
    }
    if let Some(g) = &f.error_group {
        part(h, "error group", g.clone());
    }
    if let Some(t) = f.since {
        part(
            h,
            "recorded since",
            t.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
        );
    }
    if let Some(t) = f.until {
        part(
            h,
            "recorded before",
            t.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
        );
    }
    if let Some(m) = f.max_id {
        part(h, "id up to", m.to_string());
    }
    if first {
        h.lit("no filter");
    }
}

fn bad_request(ctx: &Ctx, message: &str) -> Response {
    let mut h = Html::new();
    h.text(message);
    server::error_page(ctx, StatusCode::BAD_REQUEST, &h)
}

fn filter_form(h: &mut Html, f: &Filter, include_handled: bool) {
    let field =
        |h: &mut Html, label: &'static str, name: &'static str, value: &str, size: &'static str| {
            h.lit("<label>")
                .lit(label)
                .lit("<input name=\"")
                .lit(name)
                .lit("\" size=\"")
                .lit(size)
                .lit("\" value=\"")
                .text(value)
                .lit("\"></label>");
        };
    h.lit("<form class=\"filters\" method=\"get\" action=\"/dead-letters\">");
    field(h, "topic", "topic", f.topic.as_deref().unwrap_or(""), "14");
    h.lit("<label>source<select name=\"source\"><option value=\"\">any</option>");
    for s in ["relay", "qstash"] {
        h.lit("<option");
        if f.source.map(Source::as_str) == Some(s) {
            h.lit(" selected");
        }
        h.lit(">").lit(s).lit("</option>");
    }
    h.lit("</select></label>");
    field(h, "key", "key", f.key.as_deref().unwrap_or(""), "14");
    field(
        h,
        "error contains",
        "error",
        f.error.as_deref().unwrap_or(""),
        "20",
    );
    field(
        h,
        "error group",
        "group",
        f.error_group.as_deref().unwrap_or(""),
        "20",
    );
    let since = f.since.map(|t| t.to_rfc3339()).unwrap_or_default();
    let until = f.until.map(|t| t.to_rfc3339()).unwrap_or_default();
    field(h, "since (30m, 2d, date)", "since", &since, "12");
    field(h, "until", "until", &until, "12");
    h.lit("<label><span><input type=\"checkbox\" name=\"all\" value=\"1\"");
    if include_handled {
        h.lit(" checked");
    }
    h.lit("> include handled</span></label><button>Filter</button> <a href=\"/dead-letters\">clear</a></form>");
}

/// `GET /dead-letters`: filters, groups by normalised error, one page of the list, and the bulk actions.
pub async fn list(State(app): S, Extension(ctx): Extension<Ctx>, uri: Uri) -> Response {
    let p = server::query(&uri);
    let filter = match filter_of(&p) {
        Ok(f) => f,
        Err(e) => return bad_request(&ctx, &e),
    };
    let include_handled = p.flag("all");
    let after = p.get("after").and_then(|a| a.parse().ok());
    let mut conn = match app.pool.acquire().await {
        Ok(c) => c,
        Err(e) => return server::db_error(&ctx, e),
    };
    let groups = dead_letters::error_groups(&mut conn, &filter, include_handled, GROUPS).await;
    let page = dead_letters::list(
        &mut conn,
        &ListQuery {
            filter: filter.clone(),
            include_handled,
            after,
            limit: PAGE,
        },
    )
    .await;
    let ((groups, total), page) = match (groups, page) {
        (Ok(g), Ok(p)) => (g, p),
        (Err(e), _) | (_, Err(e)) => return server::db_error(&ctx, e),
    };

    let mut h = Html::new();
    h.lit("<h1>Dead letters</h1>");
    filter_form(&mut h, &filter, include_handled);
    h.lit("<p><span id=\"total\">").text(total).lit("</span> ");
    h.lit(if include_handled {
        "dead letters"
    } else {
        "unhandled dead letters"
    });
    h.lit(" match (");
    describe(&mut h, &filter);
    h.lit(").</p>");

    if !ctx.read_only {
        let fp = params_of(&filter);
        h.lit("<p id=\"bulk\">Bulk: <a href=\"")
            .href("/dead-letters/confirm", &[pairs(&fp), vec![("action", "redrive")]].concat())
            .lit("\">redrive the matching…</a> · <a href=\"")
            .href("/dead-letters/confirm", &[pairs(&fp), vec![("action", "purge")]].concat())
            .lit("\">purge the matching…</a> <span class=\"muted\">(each shows the count and asks first; a filter is required)</span></p>");
    }

    h.lit("<h2>By error</h2>");
    if groups.is_empty() {
        h.lit("<p class=\"muted\">none</p>");
    } else {
        h.lit("<table id=\"groups\"><tr><th class=\"n\">count</th><th>normalised error</th>")
            .lit("<th>first</th><th>last</th><th>newest</th></tr>");
        for g in &groups {
            let mut with_group = filter.clone();
            with_group.error_group = Some(g.error_group.clone());
            let gp = params_of(&with_group);
            let all = if include_handled { "1" } else { "" };
            h.lit("<tr><td class=\"n\">")
                .text(g.count)
                .lit("</td><td class=\"wrap\"><a href=\"")
                .href("/dead-letters", &[pairs(&gp), vec![("all", all)]].concat())
                .lit("\">")
                .text(crate::util::one_line(&g.error_group, 200))
                .lit("</a></td><td>");
            opt_time(&mut h, g.first_at);
            h.lit("</td><td>");
            opt_time(&mut h, g.last_at);
            h.lit("</td><td>");
            dead_letter_link(&mut h, g.last_id);
            h.lit("</td></tr>");
        }
        h.lit("</table>");
    }

    h.lit("<h2>List</h2>");
    summary_table(&mut h, &page.items);
    if let Some(next) = page.next_after {
        let fp = params_of(&filter);
        let next = next.to_string();
        let all = if include_handled { "1" } else { "" };
        h.lit("<p class=\"pager\"><a id=\"next\" href=\"")
            .href(
                "/dead-letters",
                &[pairs(&fp), vec![("all", all), ("after", &next)]].concat(),
            )
            .lit("\">next page →</a></p>");
    }
    server::ok_page(&ctx, "Dead letters", None, &h)
}

fn summary_table(h: &mut Html, items: &[DeadLetterSummary]) {
    if items.is_empty() {
        h.lit("<p class=\"muted\">none</p>");
        return;
    }
    h.lit("<table id=\"dead-letters\"><tr><th>id</th><th>recorded</th><th>source</th><th>topic</th><th>key</th>")
        .lit("<th class=\"n\">seq</th><th>event</th><th class=\"n\">attempts</th><th class=\"n\">status</th>")
        .lit("<th>state</th><th>error</th></tr>");
    for d in items {
        h.lit("<tr><td>");
        dead_letter_link(h, d.id);
        h.lit("</td><td>");
        time(h, d.created_at);
        h.lit("</td><td>").text(&d.source).lit("</td><td>");
        opt(h, d.topic.as_deref());
        h.lit("</td><td>");
        cut(h, d.partition_key.as_deref().unwrap_or("-"), 40);
        h.lit("</td><td class=\"n\">");
        opt(h, d.seq);
        h.lit("</td><td>");
        if let Some(id) = d.outbox_id {
            event_link(h, id);
        }
        h.lit("</td><td class=\"n\">");
        opt(h, d.attempts);
        h.lit("</td><td class=\"n\">");
        opt(h, d.status);
        h.lit("</td><td>")
            .lit(d.state())
            .lit("</td><td class=\"wrap\">");
        cut(h, &d.error, 160);
        h.lit("</td></tr>");
    }
    h.lit("</table>");
}

/// `GET /dead-letters/{id}`: everything stored about one dead letter, its event now, and the redrive form.
pub async fn show(
    State(app): S,
    Extension(ctx): Extension<Ctx>,
    Path(id): Path<String>,
) -> Response {
    let Ok(id) = id.parse::<i64>() else {
        return bad_request(&ctx, "a dead letter id is a number");
    };
    let mut conn = match app.pool.acquire().await {
        Ok(c) => c,
        Err(e) => return server::db_error(&ctx, e),
    };
    let d = match dead_letters::get(&mut conn, id).await {
        Ok(Some(d)) => d,
        Ok(None) => {
            let mut h = Html::new();
            h.lit("No such dead letter.");
            return server::error_page(&ctx, StatusCode::NOT_FOUND, &h);
        }
        Err(e) => return server::db_error(&ctx, e),
    };
    let event = match d.outbox_id {
        Some(o) => match dead_letters::event_state(&mut conn, o).await {
            Ok(e) => e,
            Err(e) => return server::db_error(&ctx, e),
        },
        None => None,
    };
    let mut h = Html::new();
    h.lit("<h1>Dead letter #")
        .text(d.id)
        .lit("</h1><table id=\"dead-letter\">");
    let row = |h: &mut Html, name: &'static str| {
        h.lit("<tr><th>").lit(name).lit("</th><td class=\"wrap\">");
    };
    row(&mut h, "state");
    h.lit("<span id=\"dl-state\">")
        .lit(d.state())
        .lit("</span></td></tr>");
    row(&mut h, "recorded");
    time(&mut h, d.created_at);
    h.lit(" UTC</td></tr>");
    row(&mut h, "source");
    h.text(&d.source)
        .lit(" <span class=\"muted\">(")
        .text(&d.natural_id)
        .lit(")</span></td></tr>");
    row(&mut h, "event");
    match d.outbox_id {
        Some(o) => event_link(&mut h, o),
        None => {
            h.lit("not linked to an event: it cannot be redriven");
        }
    }
    h.lit("</td></tr>");
    row(&mut h, "topic");
    opt(&mut h, d.topic.as_deref());
    h.lit("</td></tr>");
    row(&mut h, "key");
    match (&d.topic, &d.partition_key) {
        (Some(t), Some(k)) => layout::key_link(&mut h, t, k),
        (_, k) => opt(&mut h, k.as_deref()),
    }
    h.lit("</td></tr>");
    row(&mut h, "sequence");
    opt(&mut h, d.seq);
    h.lit("</td></tr>");
    row(&mut h, "attempts");
    opt(&mut h, d.attempts);
    h.lit("</td></tr>");
    row(&mut h, "status");
    opt(&mut h, d.status);
    h.lit("</td></tr>");
    row(&mut h, "error");
    h.lit("<span id=\"dl-error\">")
        .text(&d.error)
        .lit("</span></td></tr>");
    row(&mut h, "QStash message / DLQ id");
    opt(&mut h, d.qstash_message_id.as_deref());
    h.lit(" / ");
    opt(&mut h, d.dlq_id.as_deref());
    h.lit("</td></tr>");
    row(&mut h, "redriven");
    opt_time(&mut h, d.redriven_at);
    h.lit("</td></tr>");
    row(&mut h, "resolved");
    opt_time(&mut h, d.resolved_at);
    if let Some(r) = &d.resolution {
        h.lit(" (").text(r).lit(")");
    }
    h.lit("</td></tr></table>");

    match &event {
        Some(e) => {
            h.lit("<p>Event ");
            event_link(&mut h, e.id);
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
                    event_link(&mut h, b);
                }
            }
            h.lit(".</p>");
        }
        None if d.outbox_id.is_some() => {
            h.lit("<p class=\"warn\">The event's outbox row is gone (pruned): a redrive re-inserts it from this dead letter.</p>");
        }
        None => {}
    }

    if d.state() == "unhandled" && d.outbox_id.is_some() && !ctx.read_only {
        h.lit("<form id=\"redrive\" method=\"post\" action=\"")
            .path_id("/dead-letters/", d.id)
            .lit("/redrive\">");
        layout::csrf_field(&mut h, &ctx);
        h.lit("<label><input type=\"checkbox\" name=\"out_of_order\" value=\"1\"> out of order (an event its key has moved past is republished unordered)</label> ")
            .lit("<button class=\"primary\">Redrive</button></form>");
    }

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
    server::ok_page(&ctx, "Dead letter", None, &h)
}

/// `POST /dead-letters/{id}/redrive`: one dead letter back through the outbox; the outcome (or refusal) is
/// recorded and reported.
pub async fn redrive_one(
    State(app): S,
    Extension(ctx): Extension<Ctx>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let params = match server::action_form(&ctx, &body) {
        Ok(p) => p,
        Err(refused) => return *refused,
    };
    let Ok(id) = id.parse::<i64>() else {
        return bad_request(&ctx, "a dead letter id is a number");
    };
    let opts = RedriveOptions {
        out_of_order: params.flag("out_of_order"),
    };
    let mut conn = match app.pool.acquire().await {
        Ok(c) => c,
        Err(e) => return server::db_error(&ctx, e),
    };
    let result = dead_letters::redrive(&mut conn, id, opts).await;
    let (outbox_id, outcome) = match &result {
        Ok(r) => (Some(r.outbox_id), json!({"redriven": r})),
        Err(e) => (None, json!({"refused": e.to_string()})),
    };
    let recorded = actions::record(
        &mut conn,
        &NewAction {
            actor: &ctx.session.actor,
            action: "redrive",
            dead_letter_id: Some(id),
            outbox_id,
            selection: None,
            outcome,
        },
    )
    .await;
    if let Err(e) = recorded {
        return server::db_error(&ctx, e);
    }
    let mut h = Html::new();
    let status = match &result {
        Ok(r) => {
            h.lit("<div class=\"report\" id=\"report\">Dead letter ");
            dead_letter_link(&mut h, id);
            h.lit(" redriven: event ");
            event_link(&mut h, r.outbox_id);
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
    };
    h.lit("<p><a href=\"")
        .path_id("/dead-letters/", id)
        .lit("\">back to the dead letter</a></p>");
    server::html(status, layout::page(&ctx, "Redrive", None, &h))
}

/// `GET /dead-letters/confirm?action=redrive|purge&…filter`: how many dead letters the action will touch, and
/// the form that runs it on exactly those (the largest id now is fixed into the selection).
pub async fn confirm(State(app): S, Extension(ctx): Extension<Ctx>, uri: Uri) -> Response {
    if ctx.read_only {
        let mut h = Html::new();
        h.lit("This console is read-only: redrive and purge are refused.");
        return server::error_page(&ctx, StatusCode::FORBIDDEN, &h);
    }
    let p = server::query(&uri);
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
    let mut conn = match app.pool.acquire().await {
        Ok(c) => c,
        Err(e) => return server::db_error(&ctx, e),
    };
    let upto = match dead_letters::max_id(&mut conn).await {
        Ok(m) => m,
        Err(e) => return server::db_error(&ctx, e),
    };
    filter.max_id = Some(filter.max_id.map_or(upto, |m| m.min(upto)));
    let handled_only = p.flag("handled_only");
    let counted = if action == "redrive" {
        dead_letters::count_unhandled(&mut conn, &filter)
            .await
            .map(|n| (n, 0))
    } else {
        dead_letters::count_purge(&mut conn, &filter, handled_only)
            .await
            .map(|c| (c.deleted, c.kept_blocking))
    };
    let (count, kept) = match counted {
        Ok(c) => c,
        Err(e) => return server::db_error(&ctx, e),
    };
    let preview = dead_letters::list(
        &mut conn,
        &ListQuery {
            filter: filter.clone(),
            include_handled: action == "purge",
            after: None,
            limit: 10,
        },
    )
    .await;
    let preview = match preview {
        Ok(p) => p,
        Err(e) => return server::db_error(&ctx, e),
    };

    let mut h = Html::new();
    h.lit("<h1>Confirm: ")
        .text(&action)
        .lit("</h1><p>Selection: ");
    describe(&mut h, &filter);
    h.lit(".</p><p>This will ");
    if action == "redrive" {
        h.lit("redrive <strong id=\"count\">").text(count).lit("</strong> unhandled dead letter(s), oldest first, each in its own transaction. Middle events of ordered keys are skipped unless you tick “out of order”.");
    } else {
        h.lit("delete <strong id=\"count\">")
            .text(count)
            .lit("</strong> dead letter(s)");
        if kept > 0 {
            h.lit(" and keep ")
                .text(kept)
                .lit(" whose event blocks an ordered key (redrive those instead)");
        }
        h.lit(". Outbox rows are not touched.");
    }
    h.lit(" Dead letters recorded after this page was loaded are not included.</p>");
    if count == 0 {
        h.lit("<p class=\"muted\">Nothing to do.</p>");
    } else {
        h.lit("<form id=\"confirm\" method=\"post\" action=\"/dead-letters/bulk\">");
        layout::csrf_field(&mut h, &ctx);
        h.lit("<input type=\"hidden\" name=\"action\" value=\"")
            .text(&action)
            .lit("\">");
        h.lit("<input type=\"hidden\" name=\"expected\" value=\"")
            .text(count)
            .lit("\">");
        // The selection as one opaque field: stored text (a topic with control characters, say) round-trips
        // exactly, where an escaped attribute value would not.
        h.lit("<input type=\"hidden\" name=\"selection\" value=\"")
            .text(encode_selection(&filter))
            .lit("\">");
        if action == "redrive" {
            h.lit("<label><input type=\"checkbox\" name=\"out_of_order\" value=\"1\"> out of order</label> ");
        } else if handled_only {
            h.lit("<input type=\"hidden\" name=\"handled_only\" value=\"1\">");
        }
        h.lit("<button class=\"danger\">")
            .text(&action)
            .text(format!(" {count} dead letter(s)"))
            .lit("</button> ")
            .lit("<a href=\"/dead-letters\">cancel</a></form>");
    }
    h.lit("<h2>The first of them</h2>");
    summary_table(&mut h, &preview.items);
    server::ok_page(&ctx, "Confirm", None, &h)
}

/// A confirmed selection as a form field: base64url of the filter's JSON.
fn encode_selection(f: &Filter) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(serde_json::to_vec(f).unwrap_or_default())
}

/// [`encode_selection`] back; `None` when it is not one.
fn decode_selection(s: &str) -> Option<Filter> {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(s)
        .ok()?;
    serde_json::from_slice(&bytes).ok()
}

fn refuse_unfiltered(ctx: &Ctx) -> Response {
    let mut h = Html::new();
    h.lit("<span id=\"refused\">A bulk action needs a filter</span> (topic, source, key, error, error group or a \
           time range), so that it cannot touch every dead letter by accident. To select all of them on purpose, \
           give an explicit time range (since <code>1970-01-01</code>).");
    server::error_page(ctx, StatusCode::BAD_REQUEST, &h)
}

/// `POST /dead-letters/bulk`: runs a confirmed bulk redrive or purge on the selection the confirmation counted,
/// records it, and reports what it did.
pub async fn bulk(State(app): S, Extension(ctx): Extension<Ctx>, body: Bytes) -> Response {
    let p = match server::action_form(&ctx, &body) {
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
    let selection = serde_json::to_value(&filter).unwrap_or_default();
    let mut h = Html::new();
    let (action, outcome) = match p.get("action") {
        Some("redrive") => {
            let opts = RedriveOptions {
                out_of_order: p.flag("out_of_order"),
            };
            let mut lines = Vec::new();
            let report = dead_letters::redrive_matching(&app.pool, &filter, opts, |o| {
                if lines.len() < 500 {
                    lines.push(o.clone());
                }
            })
            .await;
            let report = match report {
                Ok(r) => r,
                Err(e) => return server::db_error(&ctx, e),
            };
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
            opt(&mut h, p.get("expected"));
            h.lit(" counted).</div><table id=\"outcomes\"><tr><th>dead letter</th><th>outcome</th><th>event</th><th>detail</th></tr>");
            for o in &lines {
                h.lit("<tr><td>");
                match o {
                    BulkOutcome::Redriven(r) => {
                        dead_letter_link(&mut h, r.dead_letter_id);
                        h.lit("</td><td class=\"ok\">redriven</td><td>");
                        event_link(&mut h, r.outbox_id);
                        h.lit("</td><td>").text(&r.dedup_id);
                    }
                    BulkOutcome::Skipped {
                        dead_letter_id,
                        reason,
                        ..
                    } => {
                        dead_letter_link(&mut h, *dead_letter_id);
                        h.lit("</td><td class=\"warn\">skipped</td><td></td><td class=\"wrap\">");
                        cut(&mut h, reason, 300);
                    }
                    BulkOutcome::Failed {
                        dead_letter_id,
                        error,
                    } => {
                        dead_letter_link(&mut h, *dead_letter_id);
                        h.lit("</td><td class=\"bad\">failed</td><td></td><td class=\"wrap\">");
                        cut(&mut h, error, 300);
                    }
                }
                h.lit("</td></tr>");
            }
            h.lit("</table>");
            ("redrive_bulk", json!(report))
        }
        Some("purge") => {
            let handled_only = p.flag("handled_only");
            let counts =
                match dead_letters::purge(&app.pool, &filter, handled_only, 1000, |_| {}).await {
                    Ok(c) => c,
                    Err(e) => return server::db_error(&ctx, e),
                };
            h.lit("<div class=\"report\" id=\"report\">Purged <strong id=\"done\">")
                .text(counts.deleted)
                .lit("</strong> dead letter(s) (of ");
            opt(&mut h, p.get("expected"));
            h.lit(" counted)");
            if counts.kept_blocking > 0 {
                h.lit("; kept ")
                    .text(counts.kept_blocking)
                    .lit(" whose event blocks an ordered key");
            }
            h.lit(".</div>");
            ("purge", json!(counts))
        }
        _ => return bad_request(&ctx, "action: redrive or purge"),
    };
    let mut conn = match app.pool.acquire().await {
        Ok(c) => c,
        Err(e) => return server::db_error(&ctx, e),
    };
    let recorded = actions::record(
        &mut conn,
        &NewAction {
            actor: &ctx.session.actor,
            action,
            dead_letter_id: None,
            outbox_id: None,
            selection: Some(selection),
            outcome,
        },
    )
    .await;
    if let Err(e) = recorded {
        return server::db_error(&ctx, e);
    }
    h.lit("<p>Selection: ");
    describe(&mut h, &filter);
    h.lit(". <a href=\"/dead-letters\">back to the dead letters</a> · <a href=\"/actions\">action log</a></p>");
    server::ok_page(&ctx, "Report", None, &h)
}
