//! The consumer's HTTP handler and the outcome → status mapping (see the table in the parent module).

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use http::{HeaderValue, Method, StatusCode};
use lambda_http::{Body, Request, RequestExt, Response};
use serde_json::{Value, json};
use tracing::Instrument;
use tracing::field::Empty;

use super::registry::{DEFAULT_SCHEMA_VERSION, EventMeta, HandlerError};
use super::{ConsumerState, ReceiverState};
use crate::contract;
use crate::metrics::{EmfRecord, Unit};
use crate::once::{Once, OnceError, handle_once};
use crate::ordering::{SequenceCheck, check_consumer_sequence};
use crate::receiver::{VerifyError, verify_request};

/// QStash's status for "do not retry": the message goes to the DLQ at once (with [`NONRETRYABLE_HEADER`]).
pub const STATUS_NONRETRYABLE: u16 = 489;
/// The header that must accompany [`STATUS_NONRETRYABLE`].
pub const NONRETRYABLE_HEADER: &str = "upstash-nonretryable-error";

/// How a request ended. [`Outcome::into_response`] is the single place that maps outcomes to HTTP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Applied now (200).
    Processed {
        /// The event.
        outbox_id: i64,
    },
    /// Applied before (200).
    Duplicate {
        /// The event.
        outbox_id: i64,
    },
    /// Missing or invalid signature (401); nothing was read or written.
    Unauthorized(VerifyError),
    /// Body over the cap (413), refused before verification.
    TooLarge {
        /// The body size.
        size: usize,
        /// The cap.
        max: usize,
    },
    /// Retrying cannot help (489 + `Upstash-NonRetryable-Error: true`).
    Permanent(String),
    /// Retrying may help (503, `Retry-After` when known).
    Transient {
        /// What failed.
        message: String,
        /// When to retry.
        retry_after: Option<Duration>,
    },
}

impl Outcome {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Outcome::Processed { .. } | Outcome::Duplicate { .. } => StatusCode::OK,
            Outcome::Unauthorized(_) => StatusCode::UNAUTHORIZED,
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
            Outcome::Unauthorized(_) => "RejectedSignatures",
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

fn header<'r>(req: &'r Request, name: &'static str) -> Result<Option<&'r str>, String> {
    match req.headers().get(name) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(|s| Some(s.trim()).filter(|s| !s.is_empty()))
            .map_err(|_| format!("header {name} is not visible ASCII")),
    }
}

/// The topic of `/events/{topic}` (the last `/events/` segment, so a path prefix in front is allowed).
fn topic_of(path: &str) -> Option<&str> {
    let (_, topic) = path.rsplit_once(contract::EVENTS_PATH)?;
    crate::producer::validate_topic(topic).ok()?;
    Some(topic)
}

/// Reads the event's metadata from the forwarded headers. Errors are permanent (the relay always sends them).
fn event_meta(req: &Request, topic: &str) -> Result<EventMeta, String> {
    let id_text =
        header(req, contract::OUTBOX_ID)?.ok_or("missing x-outbox-id header (the dedupe key)")?;
    let outbox_id: i64 = id_text
        .parse()
        .ok()
        .filter(|id| *id > 0)
        .ok_or_else(|| format!("x-outbox-id {id_text:?} is not a positive integer"))?;
    if let Some(t) = header(req, contract::OUTBOX_TOPIC)?
        && t != topic
    {
        return Err(format!(
            "x-outbox-topic {t:?} does not match the path's topic {topic:?}"
        ));
    }
    let key = match header(req, contract::OUTBOX_KEY)? {
        None => None,
        Some(k) => Some(
            contract::decode_key(k)
                .ok_or_else(|| format!("x-outbox-key {k:?} is not valid percent-encoded UTF-8"))?,
        ),
    };
    let seq = match header(req, contract::OUTBOX_SEQ)? {
        None => None,
        Some(s) => Some(
            s.parse::<i64>()
                .ok()
                .filter(|s| *s > 0)
                .ok_or_else(|| format!("x-outbox-seq {s:?} is not a positive integer"))?,
        ),
    };
    if seq.is_some() && key.is_none() {
        return Err("x-outbox-seq without x-outbox-key".into());
    }
    let schema_version = match header(req, contract::SCHEMA_VERSION)? {
        None => DEFAULT_SCHEMA_VERSION,
        Some(v) => v
            .parse::<u32>()
            .ok()
            .filter(|v| *v > 0)
            .ok_or_else(|| format!("x-schema-version {v:?} is not a positive integer"))?,
    };
    // Informational headers: a bad value is ignored, never fatal.
    let created_at = header(req, contract::OUTBOX_CREATED_AT)
        .ok()
        .flatten()
        .and_then(|s| DateTime::parse_from_rfc3339(s).ok())
        .map(|d| d.with_timezone(&Utc));
    let text = |name| header(req, name).ok().flatten().map(str::to_owned);
    Ok(EventMeta {
        outbox_id,
        topic: topic.to_owned(),
        key,
        seq,
        schema_version,
        created_at,
        traceparent: text(contract::TRACEPARENT),
        correlation_id: text(contract::CORRELATION_ID),
        message_id: text("upstash-message-id"),
        retried: header(req, "upstash-retried")
            .ok()
            .flatten()
            .and_then(|r| r.parse().ok())
            .unwrap_or(0),
    })
}

/// The consumer function: `POST /events/{topic}` from QStash. Never fails: every error is an HTTP status
/// (see [`Outcome`]). Logs one line and prints one EMF record per request.
pub async fn handle_event(state: &ConsumerState, req: Request) -> Response<Body> {
    let started = Instant::now();
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
    async move {
        let (outcome, meta) = process(state, &req).await;
        let elapsed = started.elapsed();
        let status = outcome.status().as_u16();
        match &outcome {
            Outcome::Processed { .. } | Outcome::Duplicate { .. } => {
                tracing::info!(status, outcome = outcome.metric(), latency_ms = elapsed.as_secs_f64() * 1e3, "event handled")
            }
            Outcome::Unauthorized(e) => {
                tracing::warn!(status, check = e.check(), error = %e, "signature rejected")
            }
            Outcome::Permanent(e) => {
                tracing::error!(status, error = %e, "event refused permanently (QStash dead-letters it)")
            }
            Outcome::TooLarge { size, max } => {
                tracing::warn!(status, size, max, "body over the size cap")
            }
            Outcome::Transient { message, .. } => {
                tracing::warn!(status, error = %message, "transient failure (QStash retries)")
            }
        }
        if state.receiver.emit_metrics {
            emit_metrics(&outcome, meta.as_ref(), elapsed);
        }
        outcome.into_response()
    }
    .instrument(span)
    .await
}

fn emit_metrics(outcome: &Outcome, meta: Option<&EventMeta>, elapsed: Duration) {
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
        .property("status", outcome.status().as_u16());
    if let Some(m) = meta {
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
    rec.emit();
}

async fn process(state: &ConsumerState, req: &Request) -> (Outcome, Option<EventMeta>) {
    let rs: &ReceiverState = &state.receiver;
    let span = tracing::Span::current();

    // 1. Cap the body before doing any work on it.
    let size = req.body().len();
    if size > rs.config.max_body_bytes {
        return (
            Outcome::TooLarge {
                size,
                max: rs.config.max_body_bytes,
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
        &rs.keys,
        req,
        rs.config.public_base_url.as_deref(),
        rs.verify_options(),
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
    let meta = match event_meta(req, topic) {
        Ok(m) => m,
        Err(e) => return (Outcome::Permanent(e), None),
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
    let prepared = match route.prepare(meta.clone(), req.body().as_ref(), rs.persistent) {
        Ok(p) => p,
        Err(e) => return (handler_outcome(e), Some(meta)),
    };

    // 5. Dedupe row, sequence check (ordered topics), the handler — one transaction.
    let consumer = rs.config.name.as_str();
    let persistent = rs.persistent;
    let m = &meta;
    // The relay may ask for the ordered event's delivery evidence to be recorded here, in the transaction that
    // applies it (decision record 0007): last statement before commit, so the key's row is locked only briefly.
    let evidence_here = m.seq.is_some()
        && header(req, contract::OUTBOX_EVIDENCE).ok().flatten()
            == Some(contract::EVIDENCE_BY_CONSUMER);
    let result = handle_once(
        &rs.pool,
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
            if evidence_here {
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
