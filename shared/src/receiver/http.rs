//! What both receivers answer with: JSON responses, QStash's "do not retry" status, the request's raw path.

use http::{HeaderValue, StatusCode};
use lambda_http::{Body, Request, RequestExt, Response};
use serde_json::Value;

/// QStash's status for "do not retry": the message goes to the DLQ at once (with [`NONRETRYABLE_HEADER`]).
pub const STATUS_NONRETRYABLE: u16 = 489;
/// The header that must accompany [`STATUS_NONRETRYABLE`].
pub const NONRETRYABLE_HEADER: &str = "upstash-nonretryable-error";

/// [`STATUS_NONRETRYABLE`] as a status code.
pub(crate) fn nonretryable_status() -> StatusCode {
    StatusCode::from_u16(STATUS_NONRETRYABLE).unwrap_or(StatusCode::UNPROCESSABLE_ENTITY)
}

/// A JSON response.
pub(crate) fn json_response(status: StatusCode, body: &Value) -> Response<Body> {
    let mut r = Response::new(Body::Text(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// The raw path of a request (function URL `rawPath`, else the URI path).
pub(crate) fn request_path(req: &Request) -> &str {
    let raw = req.raw_http_path();
    if raw.is_empty() {
        req.uri().path()
    } else {
        raw
    }
}
