//! What both receivers share on the HTTP side: the skeleton of a request ([`respond`]: one span, one log line, one
//! EMF record, one response), JSON responses, QStash's "do not retry" status, the request's raw path.

use std::time::{Duration, Instant};

use http::{HeaderValue, StatusCode};
use lambda_http::{Body, Request, RequestExt, Response};
use serde_json::Value;
use tracing::{Instrument, Span};

use crate::metrics::EmfRecord;

/// How a receiver's request ended: each receiver's outcome type says how it is logged, counted and answered.
pub(crate) trait RequestOutcome {
    /// The request's one log line, at the level this outcome deserves.
    fn log(&self, elapsed: Duration);
    /// The request's one EMF record.
    fn metrics(&self, elapsed: Duration) -> EmfRecord;
    /// The response QStash acts on.
    fn into_response(self) -> Response<Body>;
}

/// The skeleton of every receiver request: runs `work` inside `span`, then logs one line, prints one EMF record
/// (unless `emit_metrics` is off) and answers. The receivers' handlers are `respond(span, …, process(…))`.
pub(crate) async fn respond<O: RequestOutcome>(
    span: Span,
    emit_metrics: bool,
    work: impl Future<Output = O>,
) -> Response<Body> {
    let started = Instant::now();
    async move {
        let outcome = work.await;
        let elapsed = started.elapsed();
        outcome.log(elapsed);
        if emit_metrics {
            outcome.metrics(elapsed).emit();
        }
        outcome.into_response()
    }
    .instrument(span)
    .await
}

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
