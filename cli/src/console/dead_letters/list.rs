//! `GET /dead-letters`: the filter form, the groups by normalised error, one page of the list, the bulk links.

use axum::Extension;
use axum::extract::State;
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use outbox::dead_letters::{
    self, DeadLetterSummary, ErrorGroup, Filter, ListQuery, Listing, PurgeScope,
};

use super::filter::{bad_request, describe, filter_form, filter_of, pairs, params_of};
use crate::console::context::{self, Ctx, S};
use crate::console::html::Html;
use crate::console::layout::{cut, dead_letter_link, event_link, opt, opt_time, time};
use crate::console::respond;

/// Dead letters per list page.
pub(super) const PAGE: u32 = 50;

/// Groups shown.
pub(super) const GROUPS: u32 = 30;

/// `GET /dead-letters`: filters, groups by normalised error, one page of the list, and the bulk actions.
pub async fn list(State(app): S, Extension(ctx): Extension<Ctx>, uri: Uri) -> Response {
    let p = context::query(&uri);
    let filter = match filter_of(&p) {
        Ok(f) => f,
        Err(e) => return bad_request(&ctx, &e),
    };
    let include_handled = p.flag("all");
    let after = p.get("after").and_then(|a| a.parse().ok());
    let mut conn = match respond::conn(&app, &ctx).await {
        Ok(c) => c,
        Err(stop) => return stop.into_response(),
    };
    let listing = if include_handled {
        Listing::All
    } else {
        Listing::Unhandled
    };
    let groups = dead_letters::error_groups(&mut conn, &filter, listing, GROUPS).await;
    let page = dead_letters::list(
        &mut conn,
        &ListQuery {
            filter: filter.clone(),
            listing,
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
        bulk_links(&mut h, &filter, include_handled);
    }
    error_groups(&mut h, &filter, include_handled, &groups);
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

/// The bulk actions' links: to their confirmation, with the whole filter (and, for a purge, the scope the list
/// shows).
fn bulk_links(h: &mut Html, filter: &Filter, include_handled: bool) {
    let fp = params_of(filter);
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

/// The groups by normalised error, each linking to the list narrowed to it.
fn error_groups(h: &mut Html, filter: &Filter, include_handled: bool, groups: &[ErrorGroup]) {
    h.lit("<h2>By error</h2>");
    if groups.is_empty() {
        h.lit("<p class=\"muted\">none</p>");
    } else {
        h.lit("<table id=\"groups\"><tr><th class=\"n\">count</th><th>normalised error</th>")
            .lit("<th>first</th><th>last</th><th>newest</th></tr>");
        for g in groups {
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
            opt_time(h, g.first_at);
            h.lit("</td><td>");
            opt_time(h, g.last_at);
            h.lit("</td><td>");
            dead_letter_link(h, g.last_id);
            h.lit("</td></tr>");
        }
        h.lit("</table>");
    }
}

pub(super) fn summary_table(h: &mut Html, items: &[DeadLetterSummary]) {
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
