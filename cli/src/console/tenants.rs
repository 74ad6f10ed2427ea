//! Tenants (fairness keys): the backlog and lag per key (the overview's top ten, a topic's own), and pausing or
//! resuming one (`POST /tenants/pause|resume`): guarded like every action (CSRF token, not read-only), recorded in
//! the action log (`pause_tenant`, `resume_tenant`, selection `{"fairness_key": …}`) before it runs and completed
//! with what it did or why it was refused. The rules are `outbox::fairness`'s, as for `outbox tenants`.

use axum::Extension;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use outbox::fairness::{self, KeyBacklog, PauseError};
use outbox::ops::actions::{self, NewAction};
use serde_json::json;

use super::context::{App, Ctx, S};
use super::html::Html;
use super::layout::{self, age, cut, time};
use super::respond::{self, Stop};
use crate::flow_control::FlowAction;
use crate::status::TOP_TENANTS;

/// The tenants section of a page: the top keys by lag of `topic` (of all topics with `None`), then every paused key.
pub async fn section(app: &App, ctx: &Ctx, topic: Option<&str>) -> Result<Html, Stop> {
    let keys = respond::read(app, ctx, async |conn| {
        fairness::backlog(conn, topic, TOP_TENANTS).await
    })
    .await?;
    let mut h = Html::new();
    h.lit("<h2>Tenants (fairness keys) by lag</h2>");
    if keys.is_empty() {
        h.lit("<p class=\"muted\" id=\"no-tenants\">Nothing waiting, no tenant paused.</p>");
        return Ok(h);
    }
    h.lit("<table id=\"tenants\"><tr><th>key</th><th class=\"n\">pending</th><th>lag (oldest pending)</th>")
        .lit("<th>paused</th><th></th></tr>");
    for k in &keys {
        row(&mut h, ctx, k);
    }
    h.lit("</table><p class=\"muted\">The ")
        .text(TOP_TENANTS)
        .lit(" keys with the oldest waiting events, then every paused key (its events wait in the outbox until \
               it is resumed; <code>outbox tenants pause --qstash</code> also holds what QStash already has). \
               Events without a key show as (none) and cannot be paused.</p>");
    Ok(h)
}

/// One key: its figures, its pause, and the button that pauses or resumes it.
fn row(h: &mut Html, ctx: &Ctx, k: &KeyBacklog) {
    h.lit("<tr data-tenant=\"")
        .text(&k.fairness_key)
        .lit("\"><td>");
    if k.fairness_key.is_empty() {
        h.lit("<span class=\"muted\">(none)</span>");
    } else {
        cut(h, &k.fairness_key, 64);
    }
    h.lit("</td><td class=\"n\">")
        .text(crate::status::thousands(k.pending))
        .lit("</td><td>");
    if k.pending > 0 {
        age(h, k.oldest_age_secs);
    }
    h.lit("</td><td class=\"wrap\">");
    if let Some(at) = k.paused_at {
        h.lit("<span class=\"warn\">paused</span> since ");
        time(h, at);
        h.lit(" UTC by ")
            .text(k.paused_by.as_deref().unwrap_or("?"));
        if let Some(r) = &k.paused_reason {
            h.lit(": ");
            cut(h, r, 160);
        }
    }
    h.lit("</td><td>");
    if !ctx.read_only && !k.fairness_key.is_empty() {
        form(h, ctx, k);
    }
    h.lit("</td></tr>");
}

/// The pause form (with a reason) or the resume form of a key.
fn form(h: &mut Html, ctx: &Ctx, k: &KeyBacklog) {
    let paused = k.paused_at.is_some();
    h.lit("<form id=\"")
        .lit(if paused { "resume-" } else { "pause-" })
        .text(&k.fairness_key)
        .lit("\" method=\"post\" action=\"")
        .lit(if paused {
            "/tenants/resume"
        } else {
            "/tenants/pause"
        })
        .lit("\">");
    layout::csrf_field(h, ctx);
    h.lit("<input type=\"hidden\" name=\"key\" value=\"")
        .text(&k.fairness_key)
        .lit("\">");
    if paused {
        h.lit("<button>Resume</button></form>");
    } else {
        h.lit("<input name=\"reason\" size=\"14\" placeholder=\"reason\" aria-label=\"reason\"> ")
            .lit("<button class=\"danger\">Pause</button></form>");
    }
}

/// `POST /tenants/pause` (`key`, `reason`): holds the tenant's events in the outbox.
pub async fn pause(State(app): S, Extension(ctx): Extension<Ctx>, body: Bytes) -> Response {
    act(&app, &ctx, &body, FlowAction::Pause).await
}

/// `POST /tenants/resume` (`key`): makes the tenant's events due again.
pub async fn resume(State(app): S, Extension(ctx): Extension<Ctx>, body: Bytes) -> Response {
    act(&app, &ctx, &body, FlowAction::Resume).await
}

/// A pause or resume: logged, run, completed in the log, reported (a refused key: 400 with the reason).
async fn act(app: &App, ctx: &Ctx, body: &Bytes, action: FlowAction) -> Response {
    let params = match respond::action_form(ctx, body) {
        Ok(p) => p,
        Err(refused) => return *refused,
    };
    let Some(key) = params.string("key") else {
        let mut h = Html::new();
        h.lit("<span id=\"report\">Which tenant?</span> The form names no fairness key (<code>key</code>).");
        return respond::error_page(ctx, StatusCode::BAD_REQUEST, &h);
    };
    let mut conn = match respond::conn(app, ctx).await {
        Ok(c) => c,
        Err(stop) => return stop.into_response(),
    };
    let new = NewAction {
        actor: &ctx.session.actor,
        action: match action {
            FlowAction::Pause => "pause_tenant",
            FlowAction::Resume => "resume_tenant",
        },
        dead_letter_id: None,
        outbox_id: None,
        selection: Some(json!({ "fairness_key": key })),
    };
    let logged = match actions::start(&mut conn, &new).await {
        Ok(id) => id,
        Err(e) => return respond::db_error(ctx, e),
    };
    let result = match action {
        FlowAction::Pause => {
            let reason = params.get("reason");
            fairness::pause(&mut conn, &key, &ctx.session.actor, reason).await
        }
        FlowAction::Resume => fairness::resume(&mut conn, &key).await,
    };
    let outcome = match &result {
        Ok(o) => json!({ action.past(): o }),
        Err(e @ PauseError::Database(_)) => json!({ "failed": e.to_string() }),
        Err(e) => json!({ "refused": e.to_string() }),
    };
    if let Err(e) = actions::finish(&mut conn, logged, None, &outcome).await {
        return respond::db_error(ctx, e);
    }
    report(ctx, action, &key, logged, &result)
}

/// The page after a pause or resume.
fn report(
    ctx: &Ctx,
    action: FlowAction,
    key: &str,
    logged: i64,
    result: &Result<fairness::PauseOutcome, PauseError>,
) -> Response {
    let mut h = Html::new();
    let status = match result {
        Ok(o) => {
            h.lit("<div class=\"report\" id=\"report\">")
                .text(crate::tenants::said(action, key, o))
                .lit("</div>");
            StatusCode::OK
        }
        Err(e @ PauseError::Database(_)) => {
            h.lit("<div class=\"refused\" id=\"report\">Not ")
                .lit(action.past())
                .lit(": the database failed and nothing was changed (")
                .text(e)
                .lit(").</div>");
            if respond::timed_out(e) {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
        Err(e) => {
            h.lit("<div class=\"refused\" id=\"report\">Not ")
                .lit(action.past())
                .lit(": ")
                .text(e)
                .lit("</div>");
            StatusCode::BAD_REQUEST
        }
    };
    h.lit("<p>Action #").text(logged).lit(
        " in the <a href=\"/actions\">action log</a>. <a href=\"/\">Back to the overview</a>.</p>",
    );
    respond::html(status, layout::page(ctx, "Tenant", None, &h))
}
