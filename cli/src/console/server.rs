//! The HTTP side: the router and the checks every request passes (Host and Origin, then the session, which puts
//! the request's [`Ctx`] in it), with the security headers on every answer.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tokio::net::TcpListener;

use super::auth;
use super::context::{App, Ctx, S};
use super::respond::{plain, redirect, session_cookie};
use super::{dead_letters, event, layout, overview, pages, subscribers, tenants};

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
        .route("/events", get(event::event_search))
        .route("/events/{id}", get(event::event))
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
        .route("/tenants/pause", post(tenants::pause))
        .route("/tenants/resume", post(tenants::resume))
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
