//! The inspection / control API under `/__dev/`, behind the same bearer token as the QStash API (`api::guarded`).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::config::Faults;
use crate::error::ApiError;
use crate::state::Shared;
use crate::types::AttemptKind;
use crate::view::message_json;

type S = State<Arc<Shared>>;

pub(crate) fn router() -> Router<Arc<Shared>> {
    Router::new()
        .route("/__dev/attempts", get(attempts).delete(clear_attempts))
        .route("/__dev/stats", get(stats))
        .route("/__dev/faults", get(get_faults).put(put_faults))
        .route("/__dev/reset", post(reset))
        .route("/__dev/dlq", get(dlq))
        .route("/__dev/lost", get(lost))
        .route("/__dev/messages", get(messages))
        .route("/__dev/wait-idle", post(wait_idle))
        .route("/__dev/config", get(config))
}

fn json_ok<T: serde::Serialize>(v: &T) -> Response {
    match serde_json::to_string(v) {
        Ok(s) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            s,
        )
            .into_response(),
        Err(e) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct AttemptQuery {
    message_id: Option<String>,
    kind: Option<AttemptKind>,
    url: Option<String>,
    after_seq: Option<u64>,
}

async fn attempts(State(s): S, Query(q): Query<AttemptQuery>) -> Response {
    let list: Vec<_> = s
        .attempts()
        .into_iter()
        .filter(|a| q.message_id.as_deref().is_none_or(|m| a.message_id == m))
        .filter(|a| q.kind.is_none_or(|k| a.kind == k))
        .filter(|a| q.url.as_deref().is_none_or(|u| a.url == u))
        .filter(|a| q.after_seq.is_none_or(|n| a.seq > n))
        .collect();
    json_ok(&list)
}

async fn clear_attempts(State(s): S) -> Response {
    s.clear_attempts();
    json_ok(&json!({"cleared": true}))
}

async fn stats(State(s): S) -> Response {
    json_ok(&s.stats())
}

async fn get_faults(State(s): S) -> Response {
    json_ok(&s.faults())
}

async fn put_faults(State(s): S, body: Bytes) -> Response {
    let f: Faults = match serde_json::from_slice(&body) {
        Ok(f) => f,
        Err(e) => return ApiError::bad_request(format!("invalid faults: {e}")).into_response(),
    };
    match s.set_faults(f) {
        Ok(()) => json_ok(&s.faults()),
        Err(e) => ApiError::bad_request(e).into_response(),
    }
}

async fn reset(State(s): S) -> Response {
    s.reset();
    json_ok(&json!({"reset": true}))
}

/// The ids of the messages lost on purpose (`message_loss_rate`), oldest first.
async fn lost(State(s): S) -> Response {
    let ids: Vec<String> = s.lost_messages().iter().map(|i| i.to_string()).collect();
    json_ok(&json!({ "message_ids": ids }))
}

async fn dlq(State(s): S) -> Response {
    json_ok(&s.dlq_entries())
}

async fn messages(State(s): S) -> Response {
    let core = s.core();
    let list: Vec<Value> = core
        .msgs
        .values()
        .map(|m| {
            let mut o = message_json(&m.data);
            o.insert("retried".into(), json!(m.retried));
            o.insert("state".into(), json!(format!("{:?}", m.state)));
            Value::Object(o)
        })
        .collect();
    json_ok(&list)
}

#[derive(Deserialize)]
struct WaitQuery {
    timeout_ms: Option<u64>,
}

async fn wait_idle(State(s): S, Query(q): Query<WaitQuery>) -> Response {
    let timeout = Duration::from_millis(q.timeout_ms.unwrap_or(30_000));
    match s.wait_idle(timeout).await {
        Ok(()) => json_ok(&json!({"idle": true, "stats": s.stats()})),
        Err(e) => ApiError::new(StatusCode::REQUEST_TIMEOUT, e.to_string()).into_response(),
    }
}

async fn config(State(s): S) -> Response {
    let c = &s.cfg;
    let keys = s.signing_keys();
    json_ok(&json!({
        "url": s.base_url,
        "token": c.token,
        "current_signing_key": keys.current,
        "next_signing_key": keys.next,
        "time_scale": c.time_scale,
        "dedup_window_ms": c.dedup_window.as_millis() as u64,
        "default_retries": c.default_retries,
        "waitlist_order": c.waitlist_order,
        "seed": c.seed,
        "deliver": c.deliver,
        "max_concurrency": c.max_concurrency,
        "max_timeout_ms": c.max_timeout.as_millis() as u64,
        "nbf": c.nbf,
        "non_retryable": c.non_retryable,
        "retry_after_consumes_retry": c.retry_after_consumes_retry,
        "region": c.region,
        "callback_timestamps": c.callback_timestamps,
        "attempt_log_capacity": c.attempt_log_capacity,
    }))
}
