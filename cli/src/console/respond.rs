//! Answers: pages in the frame, error pages (a database error as 503 or 500), redirects, plain refusals, and the
//! checks of a state-changing form (read-only console, CSRF token).

use axum::body::Bytes;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, Postgres};

use super::auth;
use super::context::{App, Ctx, Params};
use super::html::Html;
use super::layout;

/// An answer that stops a handler early: the error page of a database error.
pub struct Stop(Box<Response>);

impl From<Response> for Stop {
    fn from(r: Response) -> Stop {
        Stop(Box::new(r))
    }
}

impl IntoResponse for Stop {
    fn into_response(self) -> Response {
        *self.0
    }
}

/// A connection of the console's pool, or the error page to answer with ([`db_error`]): for a handler that runs
/// several statements on one connection.
pub async fn conn(app: &App, ctx: &Ctx) -> Result<PoolConnection<Postgres>, Stop> {
    Ok(app.pool.acquire().await.map_err(|e| db_error(ctx, e))?)
}

/// Runs `work` on a connection of the console's pool (with [`conn`], the way handlers reach the database). A database error,
/// getting the connection or in `work`, becomes its error page ([`db_error`]).
pub async fn read<T, E: std::error::Error + 'static>(
    app: &App,
    ctx: &Ctx,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
) -> Result<T, Stop> {
    let mut conn = app.pool.acquire().await.map_err(|e| db_error(ctx, e))?;
    work(&mut conn).await.map_err(|e| db_error(ctx, e).into())
}

/// A short plain-text answer (for requests refused before there is a session to render a page for).
pub fn plain(status: StatusCode, message: &'static str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        message,
    )
        .into_response()
}

/// The `Set-Cookie` value of a session.
pub fn session_cookie(value: &str) -> String {
    format!(
        "{}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age=43200",
        auth::COOKIE
    )
}

/// A 303 to `to` (a path of this console).
pub fn redirect(to: &str) -> Response {
    match HeaderValue::from_str(to) {
        Ok(v) => (StatusCode::SEE_OTHER, [(header::LOCATION, v)]).into_response(),
        Err(_) => plain(StatusCode::BAD_REQUEST, "bad redirect"),
    }
}

/// A page with a status.
pub fn html(status: StatusCode, page: Html) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        page.into_string(),
    )
        .into_response()
}

/// A page in the frame, 200.
pub fn ok_page(ctx: &Ctx, title: &str, refresh: Option<u32>, body: &Html) -> Response {
    html(StatusCode::OK, layout::page(ctx, title, refresh, body))
}

/// An error page: `message` (the program's own text, with stored values escaped by the caller's [`Html`]).
pub fn error_page(ctx: &Ctx, status: StatusCode, body: &Html) -> Response {
    let mut h = Html::new();
    h.lit("<div class=\"refused\">").push(body).lit("</div>");
    html(status, layout::page(ctx, "Error", None, &h))
}

/// A database error as a page: 503 when Postgres cancelled a statement at the console's statement timeout (a
/// lock held elsewhere, or a query too slow), 500 otherwise. For pages that change nothing.
pub fn db_error<E: std::error::Error + 'static>(ctx: &Ctx, e: E) -> Response {
    tracing::error!(error = %e, "console query failed");
    let mut h = Html::new();
    let status = if timed_out(&e) {
        h.lit("<span id=\"timeout\">The database did not answer in time</span>: a query of this page ran longer than \
               the console's statement timeout (<code>--statement-timeout-secs</code>) and Postgres cancelled it — it \
               waited on a lock held elsewhere, or the database is overloaded. Nothing was changed. Try again; a \
               long transaction shows in <code>outbox status</code> (Database). ")
            .lit("<span class=\"muted\">(")
            .text(&e)
            .lit(")</span>");
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        h.lit("Database error: ").text(&e);
        StatusCode::INTERNAL_SERVER_ERROR
    };
    error_page(ctx, status, &h)
}

/// Whether `e`, or an error it wraps, is Postgres cancelling a statement (`57014`: the statement timeout, or an
/// operator's `pg_cancel_backend`).
pub fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(err) = next {
        if let Some(sqlx::Error::Database(d)) = err.downcast_ref::<sqlx::Error>()
            && d.code().as_deref() == Some("57014")
        {
            return true;
        }
        next = err.source();
    }
    false
}

/// A state-changing form post: its parameters once the CSRF token matched and the console is not read-only;
/// otherwise the refusal (403).
pub fn action_form(ctx: &Ctx, body: &Bytes) -> Result<Params, Box<Response>> {
    if ctx.read_only {
        let mut h = Html::new();
        h.lit(
            "This console is read-only (<code>--read-only</code>): redrive, purge and pausing or resuming a tenant are refused.",
        );
        return Err(Box::new(error_page(ctx, StatusCode::FORBIDDEN, &h)));
    }
    let params = Params::parse(body);
    checked_csrf(ctx, params)
}

/// `params` when their `csrf` field is the session's CSRF token; otherwise the refusal (403).
pub fn checked_csrf(ctx: &Ctx, params: Params) -> Result<Params, Box<Response>> {
    use subtle::ConstantTimeEq;
    // The session's MAC under this process's key, compared in constant time.
    let ok = params
        .get("csrf")
        .is_some_and(|t| bool::from(ctx.csrf.as_bytes().ct_eq(t.as_bytes())));
    if ok {
        Ok(params)
    } else {
        let mut h = Html::new();
        h.lit(
            "The form's CSRF token is missing or does not belong to your session (the console restarted, or the \
             form came from another page). Nothing was done: reload the page and try again.",
        );
        Err(Box::new(error_page(ctx, StatusCode::FORBIDDEN, &h)))
    }
}
