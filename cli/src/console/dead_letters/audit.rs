//! The action log around an action: the row written before it runs, and a run that stopped half-way.

use axum::http::StatusCode;
use axum::response::Response;
use outbox::ops::actions::{self, NewAction};

use crate::console::context::Ctx;
use crate::console::html::Html;
use crate::console::respond;

/// Logs an action before it runs (on one dead letter, or a bulk action's selection); its id, for
/// [`actions::finish`].
pub(super) async fn log_start(
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
pub(super) struct Run {
    pub(super) outcome: serde_json::Value,
    pub(super) done: String,
    pub(super) stopped: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// An action that stopped on a database error, as a page: 503 when it was the statement timeout, else 500.
pub(super) fn stopped_page(
    ctx: &Ctx,
    mut h: Html,
    e: &(dyn std::error::Error + 'static),
) -> Response {
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
