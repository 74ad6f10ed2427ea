//! What every request passes first: the `Host`/`Origin` check against DNS rebinding and cross-site pages
//! (0113), the token check, and the answers for unknown paths and methods.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};

use super::request::{S, query_pairs};
use crate::core::Counters;
use crate::error::ApiError;
use crate::state::{ConnCtx, Shared};

/// Puts `routes` behind the gate: the token check on every route, JSON answers for unknown paths and methods,
/// and the Host/Origin check outermost.
pub(crate) fn guarded(routes: Router<Arc<Shared>>, shared: Arc<Shared>) -> Router {
    routes
        .route_layer(from_fn_with_state(shared.clone(), auth))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Outermost, so it also covers unknown paths and runs before the token check.
        .layer(from_fn_with_state(shared.clone(), check_host))
        .with_state(shared)
}

async fn not_found() -> ApiError {
    ApiError::not_found("not found")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
}

async fn auth(State(s): S, req: Request, next: Next) -> Response {
    let token = &s.cfg.token;
    let bearer_ok = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .is_some_and(|t| t.trim() == token);
    let ok = bearer_ok
        || query_pairs(req.uri().query())
            .iter()
            .any(|(k, v)| k == "qstash_token" && v == token);
    if ok {
        let path = req.uri().path();
        let publishes = ["/v2/publish/", "/v2/enqueue/", "/v2/batch"]
            .iter()
            .any(|p| path.starts_with(p));
        if path.starts_with("/v2/") && !publishes {
            Counters::inc(&s.counters.api_requests);
        }
        next.run(req).await
    } else {
        ApiError::unauthorized().into_response()
    }
}

/// Refuses requests whose `Host` (or absolute request target) does not name this server: a DNS-rebinding page
/// (0113). No `Host` at all (HTTP/1.0) passes.
async fn check_host(State(s): S, req: Request, next: Next) -> Response {
    let local = req
        .extensions()
        .get::<ConnCtx>()
        .map_or(s.bound, |c| c.local);
    let ok = |h: &str| crate::host::allowed(h, s.bound, local);
    let bad = req
        .headers()
        .get_all(header::HOST)
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .chain(req.uri().authority().map(|a| a.as_str().to_owned()))
        .find(|h| !ok(h));
    // A browser page may also *send* to the right Host (a fire-and-forget cross-site POST to
    // http://127.0.0.1:8080/__dev/reset?qstash_token=<the public dev token>): browsers name the page in `Origin`,
    // SDKs and curl send none. Any Origin that is not this server is refused.
    let bad_origin = req
        .headers()
        .get_all(header::ORIGIN)
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .find(|o| {
            !o.split_once("://")
                .is_some_and(|(_, authority)| ok(authority.trim_end_matches('/')))
        });
    if let Some(o) = bad_origin {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            format!(
                "Origin {o:?} is a web page that is not this server: qstash-dev refuses cross-site requests from \
                 browsers"
            ),
        )
        .into_response();
    }
    match bad {
        None => next.run(req).await,
        Some(h) => ApiError::new(
            StatusCode::MISDIRECTED_REQUEST,
            format!(
                "Host {h:?} does not name this server: qstash-dev answers only to localhost, 127.0.0.1, [::1] \
                 and the address it listens on ({}), to refuse DNS-rebinding requests from web pages",
                s.bound
            ),
        )
        .into_response(),
    }
}
