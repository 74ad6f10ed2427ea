//! What both receivers share on the HTTP side: the skeleton of a request ([`respond`]: one span, one log line, one
//! EMF record, one response), the quiet log of a rejected signature ([`log_signature_rejected`]), JSON responses,
//! QStash's "do not retry" status, the request's raw path.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
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

/// The longest a process stays silent (above debug) about requests refused by signature verification.
pub(crate) const REJECTION_SUMMARY_INTERVAL: Duration = Duration::from_secs(60);

/// Requests refused by signature verification since the last summary line, and when that line was written: one
/// per process (a Lambda environment), shared by both receivers.
struct RejectionSummary {
    since_last: AtomicU64,
    last: Mutex<Option<Instant>>,
}

static REJECTIONS: RejectionSummary = RejectionSummary {
    since_last: AtomicU64::new(0),
    last: Mutex::new(None),
};

impl RejectionSummary {
    /// Counts one rejection; returns how many to report when a summary is due (the first rejection of a process,
    /// then at most one per [`REJECTION_SUMMARY_INTERVAL`]).
    fn count(&self) -> Option<u64> {
        self.since_last.fetch_add(1, Ordering::Relaxed);
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|t| t.elapsed() < REJECTION_SUMMARY_INTERVAL) {
            return None;
        }
        *last = Some(Instant::now());
        Some(self.since_last.swap(0, Ordering::Relaxed))
    }
}

/// Logs a request refused by signature verification (missing, malformed, expired, wrong key, wrong URL or body).
/// Anyone can send those, as fast as they like: each one is logged at DEBUG only, and a WARN summary line — how many
/// since the last one, and the latest failed check — is written at most once per [`REJECTION_SUMMARY_INTERVAL`]
/// per process, so a flood costs no log line per request. Every rejection is still counted exactly, in the
/// request's EMF record (`RejectedSignatures`, which the `SignatureRejections` alarm reads). A misconfiguration
/// that refuses every genuine delivery (the proxy pitfall: `check = "sub"`) still shows within a minute.
pub(crate) fn log_signature_rejected(answered: u16, e: &crate::receiver::VerifyError) {
    tracing::debug!(answered, check = e.check(), error = %e, "signature rejected");
    if let Some(rejected) = REJECTIONS.count() {
        tracing::warn!(
            answered,
            rejected,
            check = e.check(),
            error = %e,
            "signature rejections: {rejected} since the last summary, latest shown (at most one such line per \
             minute; the RejectedSignatures metric counts every one)"
        );
    }
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
