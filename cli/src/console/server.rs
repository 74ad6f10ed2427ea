//! The HTTP side: the router, the checks every request passes (Host and Origin, then the session), the
//! request context handlers get ([`Ctx`]), parameters, form posts with their CSRF check, and responses.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use sqlx::PgPool;
use tokio::net::TcpListener;

use super::auth::{self, HostCheck, Keys, Session, Token};
use super::html::Html;
use super::{dead_letters, layout, overview, pages, subscribers};

/// What every handler shares.
pub struct App {
    pub pool: PgPool,
    pub keys: Keys,
    /// Empty: a loopback console without tokens (everyone on this machine is `local`).
    pub tokens: Vec<Token>,
    pub hosts: HostCheck,
    pub read_only: bool,
    /// The reconciler's horizon (`outbox status` counts in-flight events older than it as unaccounted).
    pub horizon: Duration,
    /// Dedupe namespaces (`CONSUMER_NAME`s) the event page looks in.
    pub consumers: Vec<String>,
    /// The overview reloads itself this often (0: never).
    pub refresh_secs: u32,
}

/// Shared state.
pub type S = State<Arc<App>>;

/// The request's context: who, their CSRF token, whether actions are allowed.
#[derive(Debug, Clone)]
pub struct Ctx {
    pub session: Session,
    pub csrf: String,
    pub read_only: bool,
    /// Logged in with a token (a log-out button is shown).
    pub logged_in: bool,
}

/// The address a connection arrived on (what counts for `Host` when bound to 0.0.0.0 or ::).
#[derive(Debug, Clone, Copy)]
pub struct ConnInfo {
    pub local: Option<SocketAddr>,
}

impl Connected<axum::serve::IncomingStream<'_, TcpListener>> for ConnInfo {
    fn connect_info(stream: axum::serve::IncomingStream<'_, TcpListener>) -> Self {
        ConnInfo {
            local: stream.io().local_addr().ok(),
        }
    }
}

/// The router with every check in front.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/", get(overview::overview))
        .route("/topics", get(pages::topics))
        .route("/keys", get(pages::keys))
        .route("/events", get(pages::event_search))
        .route("/events/{id}", get(pages::event))
        .route("/actions", get(pages::actions))
        .route("/subscribers", get(subscribers::subscribers))
        .route("/dead-letters", get(dead_letters::list))
        .route("/dead-letters/confirm", get(dead_letters::confirm))
        .route("/dead-letters/bulk", post(dead_letters::bulk))
        .route("/dead-letters/{id}", get(dead_letters::show))
        .route(
            "/dead-letters/{id}/redrive",
            post(dead_letters::redrive_one),
        )
        .route("/login", get(pages::login_form).post(pages::login))
        .route("/logout", post(pages::logout))
        .route("/console.css", get(css))
        .fallback(not_found)
        .layer(from_fn_with_state(app.clone(), session))
        // Outermost: nothing runs for a request that names another host or comes from another site's page.
        .layer(from_fn_with_state(app.clone(), check_host))
        .with_state(app)
}

/// Serves `app` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    app: Arc<App>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(
        listener,
        router(app).into_make_service_with_connect_info::<ConnInfo>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}

async fn css() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        layout::CSS,
    )
        .into_response()
}

async fn not_found() -> Response {
    plain(StatusCode::NOT_FOUND, "not found")
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

/// Security headers on every answer: no script at all, styles from this origin, no framing, no caching, no
/// referrer to other sites.
fn harden(headers: &mut HeaderMap) {
    let set = |h: &mut HeaderMap, name: header::HeaderName, value: &'static str| {
        h.insert(name, HeaderValue::from_static(value));
    };
    set(
        headers,
        header::CONTENT_SECURITY_POLICY,
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; \
         base-uri 'none'",
    );
    set(headers, header::X_CONTENT_TYPE_OPTIONS, "nosniff");
    set(headers, header::X_FRAME_OPTIONS, "DENY");
    // Not `no-referrer`: with it, browsers send `Origin: null` on this console's own form posts.
    set(headers, header::REFERRER_POLICY, "same-origin");
    if !headers.contains_key(header::CACHE_CONTROL) {
        set(headers, header::CACHE_CONTROL, "no-store");
    }
}

/// Refuses a request whose `Host` does not name this console (421) or whose `Origin` is another site (403);
/// sets the security headers and `Server-Timing` on every answer.
async fn check_host(State(app): S, req: Request, next: Next) -> Response {
    let started = std::time::Instant::now();
    let local = req
        .extensions()
        .get::<ConnectInfo<ConnInfo>>()
        .and_then(|c| c.0.local)
        .unwrap_or(app.hosts.bound);
    let bad_host = req
        .headers()
        .get_all(header::HOST)
        .iter()
        .any(|v| !v.to_str().is_ok_and(|h| app.hosts.allows(h, local)))
        || req
            .uri()
            .authority()
            .is_some_and(|a| !app.hosts.allows(a.as_str(), local));
    let bad_origin = req
        .headers()
        .get_all(header::ORIGIN)
        .iter()
        .any(|v| !v.to_str().is_ok_and(|o| app.hosts.allows_origin(o, local)));
    let mut response = if bad_host {
        plain(
            StatusCode::MISDIRECTED_REQUEST,
            "this Host does not name the console: it answers to localhost, 127.0.0.1, [::1], the address it \
             listens on and --allow-host names (DNS-rebinding protection)",
        )
    } else if bad_origin {
        plain(
            StatusCode::FORBIDDEN,
            "a page of another site sent this request (Origin): refused",
        )
    } else {
        next.run(req).await
    };
    harden(response.headers_mut());
    // How long the console took (`outbox-dev bench console` reads it; so can a browser's developer tools).
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    if let Ok(v) = HeaderValue::from_str(&format!("app;dur={ms:.2}")) {
        response.headers_mut().insert("server-timing", v);
    }
    response
}

fn now_secs() -> i64 {
    chrono::Utc::now().timestamp()
}

/// Finds the request's session and puts its [`Ctx`] in the request. Without a valid session: with tokens,
/// pages redirect to the log-in form and posts are refused; a loopback console without tokens starts a session
/// on a GET (every local visitor is `local`), but a POST without one is refused — it cannot carry a matching
/// CSRF token.
async fn session(State(app): S, mut req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if path == "/console.css" || path == "/login" {
        return next.run(req).await;
    }
    let now = now_secs();
    let existing = req
        .headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(|h| auth::cookie(h, auth::COOKIE))
        .and_then(|v| app.keys.verify(v, now));
    let mut set_cookie = None;
    let session = match existing {
        Some(s) => s,
        None if !app.tokens.is_empty() => {
            return if req.method() == Method::GET {
                redirect("/login")
            } else {
                plain(StatusCode::UNAUTHORIZED, "log in first (/login)")
            };
        }
        None if req.method() != Method::GET => {
            return plain(
                StatusCode::FORBIDDEN,
                "no console session: load the page first (the form's CSRF token belongs to a session)",
            );
        }
        None => {
            let (s, value) = app.keys.issue(auth::LOCAL, now);
            set_cookie = Some(value);
            s
        }
    };
    let ctx = Ctx {
        csrf: app.keys.csrf(&session),
        logged_in: !app.tokens.is_empty(),
        read_only: app.read_only,
        session,
    };
    req.extensions_mut().insert(ctx);
    let mut response = next.run(req).await;
    if let Some(value) = set_cookie
        && let Ok(v) = HeaderValue::from_str(&session_cookie(&value))
    {
        response.headers_mut().append(header::SET_COOKIE, v);
    }
    response
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

/// Query or form parameters (`application/x-www-form-urlencoded`); the first of a repeated name counts.
#[derive(Debug, Clone, Default)]
pub struct Params(Vec<(String, String)>);

impl Params {
    /// Parses a query string or a form body.
    pub fn parse(raw: &[u8]) -> Params {
        Params(url::form_urlencoded::parse(raw).into_owned().collect())
    }

    /// A parameter's value, trimmed; `None` when missing or empty.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.trim())
            .filter(|v| !v.is_empty())
    }

    /// A parameter as a string.
    pub fn string(&self, name: &str) -> Option<String> {
        self.get(name).map(str::to_owned)
    }

    /// A checkbox or flag: present and not `0`/`false`.
    pub fn flag(&self, name: &str) -> bool {
        self.get(name).is_some_and(|v| v != "0" && v != "false")
    }
}

/// The query string of a request.
pub fn query(uri: &axum::http::Uri) -> Params {
    Params::parse(uri.query().unwrap_or("").as_bytes())
}

/// A state-changing form post: its parameters once the CSRF token matched and the console is not read-only;
/// otherwise the refusal (403).
pub fn action_form(ctx: &Ctx, body: &Bytes) -> Result<Params, Box<Response>> {
    if ctx.read_only {
        let mut h = Html::new();
        h.lit(
            "This console is read-only (<code>--read-only</code>): redrive and purge are refused.",
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
