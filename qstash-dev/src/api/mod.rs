//! The QStash HTTP API (`/v2/...`).
//!
//! [`router`] lists the routes; their handlers live in one file per section (`publish`, `messages`, `dlq`,
//! `queues`, `flow`, `keys`). [`guarded`] puts routes behind the gate of `guard.rs` (Host/Origin check, token).
//! The server merges the inspection routes in before guarding them; this module uses neither the server nor
//! `inspect`.

mod dlq;
mod flow;
mod guard;
mod keys;
mod messages;
mod publish;
mod queues;

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use bytes::Bytes;
use serde_json::Value;

use crate::error::ApiError;
use crate::state::Shared;

pub(crate) use self::guard::guarded;

type S = State<Arc<Shared>>;

/// The QStash API's routes, to be put behind the gate ([`guarded`]).
pub(crate) fn router() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v2/publish/{*destination}", post(publish::publish))
        .route("/v2/enqueue/{queue}/{*destination}", post(publish::enqueue))
        .route("/v2/batch", post(publish::batch))
        .route("/v2/messages", delete(messages::cancel_messages))
        .route(
            "/v2/messages/{id}",
            get(messages::get_message).delete(messages::cancel_message),
        )
        .route("/v2/dlq", get(dlq::list_dlq).delete(dlq::delete_dlq_bulk))
        .route("/v2/dlq/retry", post(dlq::retry_dlq_bulk))
        .route("/v2/dlq/retry/{id}", post(dlq::retry_dlq_one))
        .route(
            "/v2/dlq/{id}",
            get(dlq::get_dlq).delete(dlq::delete_dlq_one),
        )
        .route(
            "/v2/queues",
            post(queues::upsert_queue).get(queues::list_queues),
        )
        .route(
            "/v2/queues/{name}",
            get(queues::get_queue).delete(queues::delete_queue),
        )
        .route("/v2/queues/{name}/pause", post(queues::pause_queue))
        .route("/v2/queues/{name}/resume", post(queues::resume_queue))
        .route("/v2/flowControl", get(flow::list_flows))
        .route("/v2/flowControl/{key}", get(flow::get_flow))
        .route("/v2/flowControl/{key}/{action}", post(flow::flow_action))
        .route("/v2/globalParallelism", get(flow::global_parallelism))
        .route("/v2/keys", get(keys::get_keys))
        .route("/v2/keys/rotate", post(keys::rotate_keys))
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

fn ok_json(v: Value) -> Response {
    json_response(StatusCode::OK, &v)
}

fn empty_ok() -> Response {
    StatusCode::OK.into_response()
}

fn query_pairs(query: Option<&str>) -> Vec<(String, String)> {
    query
        .map(|q| {
            url::form_urlencoded::parse(q.as_bytes())
                .into_owned()
                .collect()
        })
        .unwrap_or_default()
}

async fn read_body(s: &Shared, body: Body) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, s.cfg.max_request_bytes)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "request body too large (limit {} bytes)",
                    s.cfg.max_request_bytes
                ),
            )
        })
}
