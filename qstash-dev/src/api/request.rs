//! What the handlers read from a request: the shared state ([`S`]), the query's pairs, the body within the
//! configured limit.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use bytes::Bytes;

use crate::error::ApiError;
use crate::state::Shared;

/// The handlers' state extractor.
pub(super) type S = State<Arc<Shared>>;

pub(super) fn query_pairs(query: Option<&str>) -> Vec<(String, String)> {
    query
        .map(|q| {
            url::form_urlencoded::parse(q.as_bytes())
                .into_owned()
                .collect()
        })
        .unwrap_or_default()
}

pub(super) async fn read_body(s: &Shared, body: Body) -> Result<Bytes, ApiError> {
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
