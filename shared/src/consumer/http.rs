//! The consumer's HTTP handler and the outcome → status mapping (see the table in the parent module).

use std::time::Duration;

use chrono::Utc;
use http::{HeaderValue, Method, StatusCode};
use lambda_http::{Body, Request, Response};
use serde_json::json;
use tracing::field::Empty;

use super::delivery::{Delivery, current_delivery, legacy_delivery};
use super::registry::{EventMeta, HandlerError};
use super::{ConsumerState, ReceiverState};
use crate::contract::{self, Contract};
use crate::metrics::{EmfRecord, Unit};
use crate::once::{Once, OnceError, handle_once};
use crate::ordering::{SequenceCheck, check_consumer_sequence};
use crate::receiver::http::{
    NONRETRYABLE_HEADER, RequestOutcome, json_response, nonretryable_status, request_path, respond,
};
use crate::receiver::{VerifyError, verify_request};

/// How a request ended. [`Outcome::into_response`] is the single place that maps outcomes to HTTP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Applied now (200).
    Processed { outbox_id: i64 },
    /// Applied before (200).
    Duplicate { outbox_id: i64 },
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

/// The topic of `/events/{topic}` (the last `/events/` segment, so a path prefix in front is allowed).
fn topic_of(path: &str) -> Option<&str> {
    let (_, topic) = path.rsplit_once(contract::EVENTS_PATH)?;
    crate::producer::validate_topic(topic).ok()?;
    Some(topic)
}

/// The consumer function: `POST /events/{topic}` from QStash. Never fails: every error is an HTTP status
/// (see [`Outcome`]). Logs one line and prints one EMF record per request.
pub async fn handle_event(state: &ConsumerState, req: Request) -> Response<Body> {
    let span = tracing::info_span!(
        "consumer",
        outbox_id = Empty,
        message_id = Empty,
        topic = Empty,
        key = Empty,
        seq = Empty,
        retried = Empty,
        correlation_id = Empty,
        traceparent = Empty,
    );
    respond(span, state.receiver.emit_metrics, async {
        let (outcome, meta) = process(state, &req).await;
        Handled { outcome, meta }
    })
    .await
}

/// A finished request: its outcome and, once it was known, the event it was about.
struct Handled {
    outcome: Outcome,
    meta: Option<EventMeta>,
}

impl RequestOutcome for Handled {
    fn log(&self, elapsed: Duration) {
        let outcome = &self.outcome;
        // `answered`: the status this function answers QStash (the callback function's lines, for the same attempt,
        // name it `consumer_status`).
        let answered = outcome.status().as_u16();
        match outcome {
            Outcome::Processed { .. } | Outcome::Duplicate { .. } => {
                tracing::info!(
                    answered,
                    outcome = outcome.metric(),
                    latency_ms = elapsed.as_secs_f64() * 1e3,
                    "event handled"
                )
            }
            Outcome::Unauthorized(e) => {
                tracing::warn!(answered, check = e.check(), error = %e, "signature rejected")
            }
            Outcome::Tampered(e) => {
                tracing::warn!(answered, check = "header_mismatch", error = %e, "altered request refused")
            }
            Outcome::Permanent(e) => {
                tracing::error!(answered, error = %e, "event refused permanently (QStash dead-letters it)")
            }
            Outcome::TooLarge { size, max } => {
                tracing::warn!(answered, size, max, "body over the size cap")
            }
            Outcome::Transient { message, .. } => {
                tracing::warn!(answered, error = %message, "transient failure (QStash retries)")
            }
        }
    }

    fn metrics(&self, elapsed: Duration) -> EmfRecord {
        let outcome = &self.outcome;
        let mut rec = EmfRecord::new("consumer");
        for name in [
            "Applied",
            "Duplicates",
            "RejectedSignatures",
            "PermanentFailures",
            "TransientFailures",
        ] {
            let v = if outcome.metric() == name { 1.0 } else { 0.0 };
            rec = rec.metric(name, Unit::Count, v);
        }
        rec = rec
            .metric(
                "HandlerLatency",
                Unit::Milliseconds,
                elapsed.as_secs_f64() * 1e3,
            )
            .property("answered", outcome.status().as_u16());
        if let Some(m) = &self.meta {
            rec = rec
                .property("outbox_id", m.outbox_id)
                .property("topic", m.topic.clone());
            if let Some(id) = &m.message_id {
                rec = rec.property("message_id", id.clone());
            }
            if let (Outcome::Processed { .. }, Some(created)) = (outcome, m.created_at) {
                let ms = (Utc::now() - created).num_milliseconds().max(0) as f64;
                rec = rec.metric("CommitToApplied", Unit::Milliseconds, ms);
            }
        }
        rec
    }

    fn into_response(self) -> Response<Body> {
        self.outcome.into_response()
    }
}

async fn process(state: &ConsumerState, req: &Request) -> (Outcome, Option<EventMeta>) {
    let receiver: &ReceiverState = &state.receiver;
    let span = tracing::Span::current();

    // 1. Cap the body before doing any work on it.
    let size = req.body().len();
    if size > receiver.config.max_body_bytes {
        return (
            Outcome::TooLarge {
                size,
                max: receiver.config.max_body_bytes,
            },
            None,
        );
    }

    // 2. Verify the signature on the raw bytes. Nothing is read or written before this.
    if let Some(id) = req
        .headers()
        .get("upstash-message-id")
        .and_then(|v| v.to_str().ok())
    {
        span.record("message_id", id);
    }
    if let Err(e) = verify_request(
        &receiver.keys,
        req,
        receiver.url_source(),
        receiver.verify_options(),
    )
    .await
    {
        return (Outcome::Unauthorized(e), None);
    }

    // 3. Route.
    if req.method() != Method::POST {
        return (
            Outcome::Permanent(format!(
                "method {} is not accepted: events are POSTed",
                req.method()
            )),
            None,
        );
    }
    let path = request_path(req);
    let Some(topic) = topic_of(path) else {
        return (
            Outcome::Permanent(format!(
                "no route for path {:?}: events go to /events/{{topic}}",
                path.chars().take(200).collect::<String>()
            )),
            None,
        );
    };
    span.record("topic", topic);
    let Some(route) = state.registry.get(topic) else {
        return (
            Outcome::Permanent(format!("unknown topic {topic:?}: no handler registered")),
            None,
        );
    };
    let delivery = match contract::contract_of_query(req.uri().query()) {
        Ok(Contract::Current) => current_delivery(req, topic),
        Ok(Contract::Legacy) => legacy_delivery(receiver, req, topic).await,
        Ok(Contract::Newer(v)) => Err(Outcome::Transient {
            message: format!(
                "delivery in wire contract {v}, newer than this consumer's {}: retry after the consumer is \
                 upgraded",
                contract::CONTRACT_VERSION
            ),
            retry_after: Some(Duration::from_secs(60)),
        }),
        Err(e) => Err(Outcome::Permanent(e)),
    };
    let Delivery {
        meta,
        payload,
        record_evidence,
    } = match delivery {
        Ok(d) => d,
        Err(o) => return (o, None),
    };
    span.record("outbox_id", meta.outbox_id);
    span.record("retried", meta.retried);
    if let Some(k) = &meta.key {
        span.record("key", k.as_str());
    }
    if let Some(s) = meta.seq {
        span.record("seq", s);
    }
    if let Some(c) = &meta.correlation_id {
        span.record("correlation_id", c.as_str());
    }
    if let Some(t) = &meta.traceparent {
        span.record("traceparent", t.as_str());
    }

    // 4. Decode the typed payload (errors are permanent).
    let prepared = match route.prepare(meta.clone(), payload, receiver.persistent) {
        Ok(p) => p,
        Err(e) => return (handler_outcome(e), Some(meta)),
    };

    // 5. Dedupe row, sequence check (ordered topics), the handler — one transaction.
    let consumer = receiver.config.name.as_str();
    let persistent = receiver.persistent;
    let m = &meta;
    // The relay may ask for the ordered event's delivery evidence to be recorded here, in the transaction that
    // applies it (decision record 0007): last statement before commit, so the key's row is locked only briefly.
    let result = handle_once(
        &receiver.pool,
        consumer,
        &meta.outbox_id.to_string(),
        persistent,
        async |conn: &mut sqlx::PgConnection| -> Result<(), HandlerError> {
            if let (Some(seq), Some(key)) = (m.seq, m.key.as_deref()) {
                match check_consumer_sequence(conn, consumer, &m.topic, key, seq, persistent)
                    .await?
                {
                    SequenceCheck::InOrder => {}
                    SequenceCheck::Late { last_applied } => {
                        return Err(HandlerError::permanent(format!(
                            "out of order: event {} has sequence {seq} for key {key:?} of topic {:?}, \
                             but sequence {last_applied} was already applied",
                            m.outbox_id, m.topic
                        )));
                    }
                }
            }
            prepared.apply(conn).await?;
            if record_evidence {
                crate::ordering::record_delivery(conn, m.outbox_id, persistent).await?;
            }
            Ok(())
        },
    )
    .await;
    let outcome = match result {
        Ok(Once::Applied(())) => Outcome::Processed {
            outbox_id: meta.outbox_id,
        },
        Ok(Once::Duplicate) if record_evidence => {
            // Applied before: the dedupe row is evidence too. Recording it again is idempotent and frees a key
            // whose evidence was never written (an event applied before the relay asked for it here).
            match receiver.pool.acquire().await {
                Ok(mut conn) => {
                    match crate::ordering::record_delivery(&mut conn, meta.outbox_id, persistent)
                        .await
                    {
                        Ok(_) => Outcome::Duplicate {
                            outbox_id: meta.outbox_id,
                        },
                        Err(e) => Outcome::Transient {
                            message: format!(
                                "database error while recording delivery evidence: {e}"
                            ),
                            retry_after: None,
                        },
                    }
                }
                Err(e) => Outcome::Transient {
                    message: format!("database error while recording delivery evidence: {e}"),
                    retry_after: None,
                },
            }
        }
        Ok(Once::Duplicate) => Outcome::Duplicate {
            outbox_id: meta.outbox_id,
        },
        Err(OnceError::Work(e)) => handler_outcome(e),
        Err(OnceError::Database(e)) => Outcome::Transient {
            message: format!("database error: {e}"),
            retry_after: None,
        },
    };
    (outcome, Some(meta))
}

fn handler_outcome(e: HandlerError) -> Outcome {
    match e {
        HandlerError::Permanent(m) => Outcome::Permanent(m),
        HandlerError::Transient {
            message,
            retry_after,
        } => Outcome::Transient {
            message,
            retry_after,
        },
    }
}
