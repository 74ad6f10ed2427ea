//! [`Outcome`]: how a consumer request ended, and the single place it becomes an HTTP status and body (see the
//! table in the parent module). Its own file because the handler (`http.rs`), the batch (`batch.rs`) and the
//! delivery checks (`delivery.rs`) all produce it.

use std::time::Duration;

use http::{HeaderValue, StatusCode};
use lambda_http::{Body, Response};
use serde_json::json;

use crate::ids::OutboxId;
use crate::receiver::VerifyError;
use crate::receiver::http::{NONRETRYABLE_HEADER, json_response, nonretryable_status};

/// How a request ended. [`Outcome::into_response`] is the single place that maps outcomes to HTTP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Applied now (200).
    Processed { outbox_id: OutboxId },
    /// Applied before (200).
    Duplicate { outbox_id: OutboxId },
    /// Missing or invalid signature (401); nothing was read or written.
    Unauthorized(VerifyError),
    /// A valid signature, but a header copy or a legacy header disagrees with the signed data: the request was
    /// altered after QStash signed it (401, counted as a rejected signature); nothing was written.
    Tampered(String),
    /// Body over the cap (413), refused before verification.
    TooLarge { size: usize, max: usize },
    /// Retrying cannot help (489 + `Upstash-NonRetryable-Error: true`).
    Permanent(String),
    /// Retrying may help (503, `Retry-After` when known).
    Transient {
        /// What failed.
        message: String,
        retry_after: Option<Duration>,
    },
}

impl Outcome {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Outcome::Processed { .. } | Outcome::Duplicate { .. } => StatusCode::OK,
            Outcome::Unauthorized(_) | Outcome::Tampered(_) => StatusCode::UNAUTHORIZED,
            Outcome::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Outcome::Permanent(_) => nonretryable_status(),
            Outcome::Transient { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The metric this outcome counts in.
    pub fn metric(&self) -> &'static str {
        match self {
            Outcome::Processed { .. } => "Applied",
            Outcome::Duplicate { .. } => "Duplicates",
            Outcome::Unauthorized(_) | Outcome::Tampered(_) => "RejectedSignatures",
            Outcome::TooLarge { .. } | Outcome::Permanent(_) => "PermanentFailures",
            Outcome::Transient { .. } => "TransientFailures",
        }
    }

    /// The response: JSON `{"status":…}` on success, `{"error":…}` otherwise.
    pub fn into_response(self) -> Response<Body> {
        let status = self.status();
        match self {
            Outcome::Processed { outbox_id } => json_response(
                status,
                &json!({"status": "processed", "outbox_id": outbox_id}),
            ),
            Outcome::Duplicate { outbox_id } => json_response(
                status,
                &json!({"status": "duplicate", "outbox_id": outbox_id}),
            ),
            Outcome::Unauthorized(e) => json_response(
                status,
                &json!({"error": format!("signature rejected: {e}"), "check": e.check()}),
            ),
            Outcome::Tampered(message) => json_response(
                status,
                &json!({"error": format!("request refused: {message}"), "check": "header_mismatch"}),
            ),
            Outcome::TooLarge { size, max } => json_response(
                status,
                &json!({"error": format!("body is {size} bytes; the limit is {max} (MAX_BODY_BYTES)")}),
            ),
            Outcome::Permanent(message) => {
                let mut r = json_response(status, &json!({"error": message}));
                r.headers_mut()
                    .insert(NONRETRYABLE_HEADER, HeaderValue::from_static("true"));
                r
            }
            Outcome::Transient {
                message,
                retry_after,
            } => {
                let mut r = json_response(status, &json!({"error": message}));
                if let Some(after) = retry_after {
                    // Whole seconds, rounded up (QStash ignores values above one day).
                    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
                    r.headers_mut()
                        .insert(http::header::RETRY_AFTER, HeaderValue::from(secs));
                }
                r
            }
        }
    }
}
