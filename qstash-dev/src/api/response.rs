//! The handlers' answers: JSON with a status, `200 OK` with JSON, an empty `200 OK`.

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

pub(super) fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

pub(super) fn ok_json(v: Value) -> Response {
    json_response(StatusCode::OK, &v)
}

pub(super) fn empty_ok() -> Response {
    StatusCode::OK.into_response()
}
