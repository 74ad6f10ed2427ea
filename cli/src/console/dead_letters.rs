//! The dead-letter pages: filters, the groups by normalised error, the list, one dead letter, and the guarded
//! actions — redrive one; bulk redrive and purge only with a filter, after a confirmation page that shows how many
//! they will touch (and fixes the selection to the dead letters counted), with a report afterwards. Every action
//! is recorded in the action log with who took it: before it runs, then completed with what it did.
//!
//! | Rule | Why |
//! |---|---|
//! | Every field of [`Filter`] travels in every link, form and confirmation ([`params_of`], [`filter_form`] and [`describe`] are made from one list of its fields, [`parts`], which takes the filter apart field by field: a new field does not compile until it is carried) | An action never widens: what the list shows is what the confirmation counts and what the action touches |
//! | The action log row is written before the action, and completed after it, also when it fails | A failure half-way leaves a record of what was started and done |

use axum::Extension;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};
use axum::response::Response;
use chrono::{DateTime, Utc};
use outbox::dead_letters::{
    self, BulkOutcome, BulkReport, DeadLetterSummary, Filter, ListQuery, PurgeScope, RedriveError,
    RedriveOptions, Source,
};
use outbox::ops::actions::{self, NewAction};
use serde_json::json;

use super::context::{self, App, Ctx, Params, S};
use super::html::Html;
use super::layout::{self, cut, dead_letter_link, event_link, opt, opt_time, time};
use super::respond;

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

/// One field of a filter: its parameter, its name in words, and its value as a parameter and as shown (`None`:
/// not set).
struct Part {
    param: &'static str,
    words: &'static str,
    value: Option<String>,
    shown: Option<String>,
}

impl Part {
    fn new(param: &'static str, words: &'static str, value: Option<String>) -> Part {
        Part {
            param,
            words,
            shown: value.clone(),
            value,
        }
    }
}

/// The filter's fields, the one list that links ([`params_of`]), the words of a selection ([`describe`]) and the
/// filter form ([`filter_form`]) are made from: every field by name, so a field added to [`Filter`] does not
/// compile here until it has its part, and then no link, form or confirmation can drop it. Times as RFC 3339 (a
/// confirmation carries exactly what was counted), the default subscriber as `default`.
fn parts(f: &Filter) -> [Part; 9] {
    let Filter {
        topic,
        source,
        key,
        since,
        until,
        error,
        error_group,
        max_id,
        subscriber,
    } = f;
    let time = |param, words, t: &Option<DateTime<Utc>>| Part {
        param,
        words,
        value: t.map(|t| t.to_rfc3339()),
        shown: t.map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string()),
    };
    let subscriber = subscriber
        .as_deref()
        .map(|s| outbox::subscribers::label(s).to_owned());
    [
        Part::new("topic", "topic", topic.clone()),
        Part::new("subscriber", "subscriber", subscriber),
        Part::new("source", "source", source.map(|s| s.as_str().to_owned())),
        Part::new("key", "key", key.clone()),
        Part::new("error", "error contains", error.clone()),
        Part::new("group", "error group", error_group.clone()),
        time("since", "recorded since", since),
        time("until", "recorded before", until),
        Part::new("max_id", "id up to", max_id.map(|m| m.to_string())),
    ]
}

/// The filter as parameters: its set fields ([`parts`]).
fn params_of(f: &Filter) -> Vec<(&'static str, String)> {
    parts(f)
        .into_iter()
        .filter_map(|p| Some((p.param, p.value?)))
        .collect()
}

fn pairs<'a>(v: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    v.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// The filter in words: its set fields ([`parts`]), or `no filter`.
fn describe(h: &mut Html, f: &Filter) {
    let mut first = true;
    for p in parts(f) {
        let Some(shown) = p.shown else { continue };
        if !first {
            h.lit(", ");
        }
        first = false;
        h.lit(p.words).lit(" <code>").text(shown).lit("</code>");
    }
    if first {
        h.lit("no filter");
    }
}

fn bad_request(ctx: &Ctx, message: &str) -> Response {
    let mut h = Html::new();
    h.text(message);
    respond::error_page(ctx, StatusCode::BAD_REQUEST, &h)
}

/// The filter form: a field for every part of the filter ([`parts`]; the source a choice, `max_id`, which only a
/// confirmation sets, hidden), so that filtering again never drops part of the selection.
fn filter_form(h: &mut Html, f: &Filter, include_handled: bool) {
    h.lit("<form class=\"filters\" method=\"get\" action=\"/dead-letters\">");
    for p in parts(f) {
        let value = p.value.as_deref().unwrap_or("");
        match p.param {
            "source" => source_choice(h, value),
            "max_id" if !value.is_empty() => {
                h.lit("<input type=\"hidden\" name=\"max_id\" value=\"")
                    .text(value)
                    .lit("\">");
            }
            "max_id" => {}
            param => {
                let size = match param {
                    "error" | "group" => "20",
                    "since" | "until" => "12",
                    _ => "14",
                };
                h.lit("<label>")
                    .lit(p.words)
                    .lit("<input name=\"")
                    .lit(param)
                    .lit("\" size=\"")
                    .lit(size)
                    .lit("\" value=\"")
                    .text(value)
                    .lit("\"");
                if param == "since" {
                    h.lit(" placeholder=\"30m, 2d, date\"");
                }
                h.lit("></label>");
            }
        }
    }
    h.lit("<label><span><input type=\"checkbox\" name=\"all\" value=\"1\"");
    if include_handled {
        h.lit(" checked");
    }
    h.lit("> include handled</span></label><button>Filter</button> <a href=\"/dead-letters\">clear</a></form>");
}

/// The source as a choice: any, relay or qstash.
fn source_choice(h: &mut Html, selected: &str) {
    h.lit("<label>source<select name=\"source\"><option value=\"\">any</option>");
    for s in ["relay", "qstash"] {
        h.lit("<option");
        if selected == s {
            h.lit(" selected");
        }
        h.lit(">").lit(s).lit("</option>");
    }
    h.lit("</select></label>");
}

/// `GET /dead-letters`: filters, groups by normalised error, one page of the list, and the bulk actions.
pub async fn list(State(app): S, Extension(ctx): Extension<Ctx>, uri: Uri) -> Response {
    let p = context::query(&uri);
    let filter = match filter_of(&p) {
        Ok(f) => f,
        Err(e) => return bad_request(&ctx, &e),
    };
    let include_handled = p.flag("all");
    let after = p.get("after").and_then(|a| a.parse().ok());
    let mut conn = match app.pool.acquire().await {
        Ok(c) => c,
        Err(e) => return respond::db_error(&ctx, e),
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
        (Err(e), _) | (_, Err(e)) => return respond::db_error(&ctx, e),
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
        // What the list matched: without "include handled", the unhandled ones only.
        let scope = if include_handled {
            PurgeScope::Any
        } else {
            PurgeScope::Unhandled
        };
        let purge = vec![("action", "purge"), ("scope", scope.as_str())];
        h.lit("<p id=\"bulk\">Bulk: <a href=\"")
            .href("/dead-letters/confirm", &[pairs(&fp), vec![("action", "redrive")]].concat())
            .lit("\">redrive the matching…</a> · <a href=\"")
            .href("/dead-letters/confirm", &[pairs(&fp), purge].concat())
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
    respond::ok_page(&ctx, "Dead letters", None, &h)
}

fn summary_table(h: &mut Html, items: &[DeadLetterSummary]) {
    if items.is_empty() {
        h.lit("<p class=\"muted\">none</p>");
        return;
    }
    h.lit("<table id=\"dead-letters\"><tr><th>id</th><th>recorded</th><th>source</th><th>topic</th>")
        .lit("<th>subscriber</th><th>key</th>")
        .lit("<th class=\"n\">seq</th><th>event</th><th class=\"n\">attempts</th><th class=\"n\">status</th>")
        .lit("<th>state</th><th>error</th></tr>");
    for d in items {
        h.lit("<tr><td>");
        dead_letter_link(h, d.id);
        h.lit("</td><td>");
        time(h, d.created_at);
        h.lit("</td><td>").text(&d.source).lit("</td><td>");
        opt(h, d.topic.as_deref());
        h.lit("</td><td>")
            .text(outbox::subscribers::label(&d.subscriber))
            .lit("</td><td>");
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
        Err(e) => return respond::db_error(&ctx, e),
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
    row(&mut h, "subscriber");
    h.lit("<span id=\"dl-subscriber\">")
        .text(outbox::subscribers::label(&d.subscriber))
        .lit("</span> <span class=\"muted\">(a redrive requeues the event for this subscriber only)</span></td></tr>");
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
    respond::ok_page(&ctx, "Dead letter", None, &h)
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
    let Ok(id) = id.parse::<i64>() else {
        return bad_request(&ctx, "a dead letter id is a number");
    };
    let opts = RedriveOptions {
        out_of_order: params.flag("out_of_order"),
    };
    let mut conn = match app.pool.acquire().await {
        Ok(c) => c,
        Err(e) => return respond::db_error(&ctx, e),
    };
    let logged = match log_start(&mut conn, &ctx, "redrive", Some(id), None).await {
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
    respond::html(status, layout::page(&ctx, "Redrive", None, &h))
}

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
    let mut conn = match app.pool.acquire().await {
        Ok(c) => c,
        Err(e) => return respond::db_error(&ctx, e),
    };
    let upto = match dead_letters::max_id(&mut conn).await {
        Ok(m) => m,
        Err(e) => return respond::db_error(&ctx, e),
    };
    filter.max_id = Some(filter.max_id.map_or(upto, |m| m.min(upto)));
    let scope = match scope_of(&p) {
        Ok(s) => s,
        Err(e) => return bad_request(&ctx, &e),
    };
    let counted = if action == "redrive" {
        dead_letters::count_unhandled(&mut conn, &filter)
            .await
            .map(|n| (n, 0))
    } else {
        dead_letters::count_purge(&mut conn, &filter, scope)
            .await
            .map(|c| (c.deleted, c.kept_blocking))
    };
    let (count, kept) = match counted {
        Ok(c) => c,
        Err(e) => return respond::db_error(&ctx, e),
    };
    let preview = dead_letters::list(
        &mut conn,
        &ListQuery {
            filter: filter.clone(),
            include_handled: action == "purge" && scope != PurgeScope::Unhandled,
            after: None,
            limit: 10,
        },
    )
    .await;
    let preview = match preview {
        Ok(p) => p,
        Err(e) => return respond::db_error(&ctx, e),
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
        } else {
            h.lit("<input type=\"hidden\" name=\"scope\" value=\"")
                .lit(scope.as_str())
                .lit("\">");
        }
        h.lit("<button class=\"danger\">")
            .text(&action)
            .text(format!(" {count} dead letter(s)"))
            .lit("</button> ")
            .lit("<a href=\"/dead-letters\">cancel</a></form>");
    }
    h.lit("<h2>The first of them</h2>");
    summary_table(&mut h, &preview.items);
    respond::ok_page(&ctx, "Confirm", None, &h)
}

/// Which dead letters a purge takes (`scope`: `any`, the default, `handled` or `unhandled`; `handled_only=1` is
/// `handled`): the list's purge link says `unhandled` unless the list includes handled ones, so that the
/// confirmation counts what the list matched.
fn scope_of(p: &Params) -> Result<PurgeScope, String> {
    match (p.get("scope"), p.flag("handled_only")) {
        (Some(s), _) => s.parse(),
        (None, true) => Ok(PurgeScope::Handled),
        (None, false) => Ok(PurgeScope::Any),
    }
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
    h.lit("<span id=\"refused\">A bulk action needs a filter</span> (topic, subscriber, source, key, error, error \
           group or a time range), so that it cannot touch every dead letter by accident. To select all of them on purpose, \
           give an explicit time range (since <code>1970-01-01</code>).");
    respond::error_page(ctx, StatusCode::BAD_REQUEST, &h)
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
    let logged = match app.pool.acquire().await {
        Ok(mut conn) => log_start(&mut conn, &ctx, action, None, Some(selection)).await,
        Err(e) => Err(e),
    };
    let logged = match logged {
        Ok(id) => id,
        Err(e) => return respond::db_error(&ctx, e),
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
/// [`actions::finish`].
async fn log_start(
    conn: &mut sqlx::PgConnection,
    ctx: &Ctx,
    action: &str,
    dead_letter_id: Option<i64>,
    selection: Option<serde_json::Value>,
) -> Result<i64, sqlx::Error> {
    let new = NewAction {
        actor: &ctx.session.actor,
        action,
        dead_letter_id,
        outbox_id: None,
        selection,
    };
    actions::start(conn, &new).await
}

/// A bulk action's run: its outcome for the action log, what it did in words, and the error that stopped it
/// half-way, if one did.
struct Run {
    outcome: serde_json::Value,
    done: String,
    stopped: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// An action that stopped on a database error, as a page: 503 when it was the statement timeout, else 500.
fn stopped_page(ctx: &Ctx, mut h: Html, e: &(dyn std::error::Error + 'static)) -> Response {
    let status = if respond::timed_out(e) {
        h.lit("A statement ran longer than the console's statement timeout (<code>--statement-timeout-secs</code>): \
               it waited on a lock held elsewhere, or the database is overloaded. ");
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    };
    h.lit("<span class=\"muted\">(").text(e).lit(")</span>");
    respond::error_page(ctx, status, &h)
}

/// Bulk redrive of `filter`, its report written into `h`.
async fn run_redrive(app: &App, filter: &Filter, p: &Params, h: &mut Html) -> Run {
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
fn tally(r: &mut BulkReport, o: &BulkOutcome) {
    match o {
        BulkOutcome::Redriven(_) => r.redriven += 1,
        BulkOutcome::Skipped { out_of_order, .. } => {
            r.skipped += 1;
            r.out_of_order += u64::from(*out_of_order);
        }
        BulkOutcome::Failed { .. } => r.failed += 1,
    }
}

fn redrive_report(
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
async fn run_purge(app: &App, filter: &Filter, scope: PurgeScope, p: &Params, h: &mut Html) -> Run {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of a filter survives the trip through a link or a form (what [`params_of`] writes,
    /// [`filter_of`] reads back), the default subscriber included: no link or form drops part of a selection.
    #[test]
    fn a_filter_with_every_field_set_round_trips_through_its_parameters() {
        let at = |s: &str| DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc);
        for subscriber in ["shipping", ""] {
            let f = Filter {
                topic: Some("orders".into()),
                source: Some(Source::Qstash),
                key: Some("customer 42&x=1".into()),
                since: Some(at("2026-03-01T12:00:00Z")),
                until: Some(at("2026-03-02T00:00:00Z")),
                error: Some("answered 489".into()),
                error_group: Some("consumer answered N".into()),
                max_id: Some(77),
                subscriber: Some(subscriber.into()),
            };
            let query = url::form_urlencoded::Serializer::new(String::new())
                .extend_pairs(params_of(&f))
                .finish();
            assert_eq!(filter_of(&Params::parse(query.as_bytes())), Ok(f.clone()));
            let mut described = Html::new();
            describe(&mut described, &f);
            let described = described.into_string();
            assert!(
                described.contains(&format!(
                    "subscriber <code>{}</code>",
                    outbox::subscribers::label(subscriber)
                )),
                "{described}"
            );
            let mut form = Html::new();
            filter_form(&mut form, &f, false);
            let form = form.into_string();
            for name in [
                "topic",
                "subscriber",
                "source",
                "key",
                "error",
                "group",
                "since",
                "until",
                "max_id",
            ] {
                assert!(form.contains(&format!("name=\"{name}\"")), "{name}: {form}");
            }
        }
    }
}
