//! The consumer's HTTP handler and the outcome → status mapping (see the table in the parent module).

use std::time::Duration;

use chrono::{DateTime, Utc};
use http::{HeaderValue, Method, StatusCode};
use lambda_http::{Body, Request, Response};
use serde_json::json;
use tracing::field::Empty;

use sqlx::Row;

use super::registry::{DEFAULT_SCHEMA_VERSION, EventMeta, HandlerError};
use super::{ConsumerState, ReceiverState};
use crate::config::LegacyDeliveries;
use crate::contract::{self, Contract, legacy};
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
    /// A valid signature, but a header copy or a legacy header disagrees with the signed data: the request was
    /// altered after QStash signed it (401, counted as a rejected signature); nothing was written.
    Tampered(String),
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

/// What a delivery says about its event: from signed data only (or, for a delivery in the previous format,
/// checked against the outbox row).
struct Delivery<'b> {
    meta: EventMeta,
    /// The payload bytes the handler decodes.
    payload: &'b [u8],
    /// Record the delivery evidence of this ordered event in the applying transaction (and on a duplicate).
    record_evidence: bool,
}

/// QStash's own informational headers (never used to decide a write).
fn qstash_info(req: &Request) -> (Option<String>, u32) {
    let message_id = header(req, "upstash-message-id")
        .ok()
        .flatten()
        .map(str::to_owned);
    let retried = header(req, "upstash-retried")
        .ok()
        .flatten()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    (message_id, retried)
}

/// A header copy that disagrees with the signed value: the request was altered after QStash signed it.
fn check_copy(
    req: &Request,
    name: &'static str,
    signed: Option<&str>,
    same: impl Fn(&str, &str) -> bool,
) -> Result<(), Outcome> {
    let Some(copy) = header(req, name).map_err(Outcome::Tampered)? else {
        return Ok(());
    };
    match signed {
        Some(s) if same(copy, s) => Ok(()),
        _ => Err(Outcome::Tampered(format!(
            "header {name} is {:?} but the signed delivery says {:?}: the request was altered after QStash \
             signed it",
            copy.chars().take(100).collect::<String>(),
            signed.map(|s| s.chars().take(100).collect::<String>())
        ))),
    }
}

/// A current (contract 2) delivery: everything from the signed envelope; header copies must agree with it.
fn current_delivery<'b>(req: &'b Request, topic: &str) -> Result<Delivery<'b>, Outcome> {
    let env = contract::parse_envelope(req.body().as_ref()).map_err(Outcome::Permanent)?;
    if env.topic != topic {
        return Err(Outcome::Permanent(format!(
            "the envelope's topic {:?} differs from the URL's topic {topic:?}",
            env.topic.chars().take(100).collect::<String>()
        )));
    }
    let [ev] = env.events.as_slice() else {
        return Err(Outcome::Permanent(format!(
            "the envelope holds {} events; this consumer applies one per delivery",
            env.events.len()
        )));
    };
    let schema_version = ev.schema_version.unwrap_or(DEFAULT_SCHEMA_VERSION);
    let evidence = env.evidence.map(contract::Evidence::as_str);
    let eq = |a: &str, b: &str| a == b;
    check_copy(req, legacy::OUTBOX_ID, Some(&ev.id.to_string()), eq)?;
    check_copy(req, legacy::OUTBOX_TOPIC, Some(topic), eq)?;
    check_copy(req, legacy::OUTBOX_KEY, Some(&ev.key), |copy, key| {
        contract::decode_key(copy).as_deref() == Some(key)
    })?;
    check_copy(
        req,
        legacy::OUTBOX_SEQ,
        ev.seq.map(|s| s.to_string()).as_deref(),
        eq,
    )?;
    check_copy(req, legacy::OUTBOX_EVIDENCE, evidence, eq)?;
    check_copy(
        req,
        legacy::SCHEMA_VERSION,
        Some(&schema_version.to_string()),
        eq,
    )?;
    let (message_id, retried) = qstash_info(req);
    Ok(Delivery {
        meta: EventMeta {
            outbox_id: ev.id,
            topic: topic.to_owned(),
            key: Some(ev.key.clone()),
            seq: ev.seq,
            schema_version,
            created_at: ev.created_at,
            traceparent: ev.headers.get(contract::TRACEPARENT).cloned(),
            correlation_id: ev.headers.get(contract::CORRELATION_ID).cloned(),
            message_id,
            retried,
        },
        payload: ev.payload.get().as_bytes(),
        record_evidence: ev.seq.is_some() && env.evidence == Some(contract::Evidence::Consumer),
    })
}

/// A delivery in the previous format (no `contract` in its URL; published before the upgrade, QStash may still
/// hold it for days). Its identity is in unsigned headers, so it is applied only when the outbox row named by
/// `x-outbox-id` has the delivery's (signed) topic and payload and is marked dispatched; key, sequence and
/// metadata then come from the row, never from the headers. Ordered events record their evidence here (the row is in this database).
async fn legacy_delivery<'b>(
    receiver: &ReceiverState,
    req: &'b Request,
    topic: &str,
) -> Result<Delivery<'b>, Outcome> {
    if receiver.config.legacy_deliveries == LegacyDeliveries::Refuse {
        return Err(Outcome::Permanent(
            "delivery in the previous wire format (no contract version in its URL, identity in unsigned headers) \
             refused: LEGACY_DELIVERIES=refuse"
                .into(),
        ));
    }
    let id_text = header(req, legacy::OUTBOX_ID)
        .map_err(Outcome::Permanent)?
        .ok_or_else(|| {
            Outcome::Permanent(
                "delivery without a contract version in its URL and without x-outbox-id: not an outbox event"
                    .into(),
            )
        })?;
    let outbox_id: i64 = id_text.parse().ok().filter(|id| *id > 0).ok_or_else(|| {
        Outcome::Permanent(format!(
            "x-outbox-id {:?} is not a positive integer",
            id_text.chars().take(40).collect::<String>()
        ))
    })?;
    let body = req.body().as_ref();
    if serde_json::from_slice::<serde::de::IgnoredAny>(body).is_err() {
        return Err(Outcome::Permanent(
            "delivery in the previous wire format whose body is not JSON: it cannot be an outbox payload".into(),
        ));
    }
    let row = sqlx::query(
        "SELECT topic, partition_key, seq, headers, created_at, payload = $2::jsonb AS same_payload, \
                dispatched_at IS NOT NULL AS dispatched \
         FROM outbox WHERE id = $1",
    )
    .persistent(receiver.persistent)
    .bind(outbox_id)
    .bind(std::str::from_utf8(body).unwrap_or_default())
    .fetch_optional(&receiver.pool)
    .await
    .map_err(|e| match e.as_database_error().and_then(|d| d.code()) {
        Some(code) if code.starts_with("22") => Outcome::Permanent(format!(
            "delivery in the previous wire format whose body Postgres refuses as jsonb ({e}): it cannot be an \
             outbox payload"
        )),
        Some(code) if code == "42P01" => Outcome::Permanent(
            "a delivery in the previous wire format can only be verified against the outbox table, which is not \
             in this consumer's database"
                .into(),
        ),
        _ => Outcome::Transient {
            message: format!("database error while verifying a legacy delivery: {e}"),
            retry_after: None,
        },
    })?;
    let Some(row) = row else {
        return Err(Outcome::Permanent(format!(
            "delivery in the previous wire format names outbox id {outbox_id}, which is not in the outbox (pruned, \
             or the header was altered): refused"
        )));
    };
    let db = |e: sqlx::Error| Outcome::Transient {
        message: format!("database error while verifying a legacy delivery: {e}"),
        retry_after: None,
    };
    let row_topic: String = row.try_get("topic").map_err(db)?;
    let same_payload: bool = row.try_get("same_payload").map_err(db)?;
    if row_topic != topic || !same_payload {
        return Err(Outcome::Tampered(format!(
            "x-outbox-id {outbox_id} names an event whose topic or payload differs from this signed delivery: \
             the header was altered after QStash signed it"
        )));
    }
    // The previous relay marked an event dispatched once QStash accepted it, and published an ordered key's next
    // event only after its predecessor was delivered. An event not yet dispatched therefore has no genuine
    // old-format delivery in flight (or its relay died between publish and settle): a forged id naming another
    // event with the same topic and payload would apply it out of turn. Retry later instead of deciding now.
    let dispatched: bool = row.try_get("dispatched").map_err(db)?;
    if !dispatched {
        return Err(Outcome::Transient {
            message: format!(
                "delivery in the previous wire format for outbox id {outbox_id}, which the outbox does not show as \
                 dispatched yet: retry later"
            ),
            retry_after: Some(Duration::from_secs(60)),
        });
    }
    let key: String = row.try_get("partition_key").map_err(db)?;
    let seq: Option<i64> = row.try_get("seq").map_err(db)?;
    let headers: Option<sqlx::types::Json<crate::producer::EventHeaders>> =
        row.try_get("headers").ok();
    let headers = headers.map(|h| h.0).unwrap_or_default();
    let created_at: DateTime<Utc> = row.try_get("created_at").map_err(db)?;
    let schema_version = headers.schema_version.unwrap_or(DEFAULT_SCHEMA_VERSION);
    let eq = |a: &str, b: &str| a == b;
    check_copy(req, legacy::OUTBOX_TOPIC, Some(topic), eq)?;
    check_copy(req, legacy::OUTBOX_KEY, Some(&key), |copy, key| {
        contract::decode_key(copy).as_deref() == Some(key)
    })?;
    check_copy(
        req,
        legacy::OUTBOX_SEQ,
        seq.map(|s| s.to_string()).as_deref(),
        eq,
    )?;
    check_copy(
        req,
        legacy::SCHEMA_VERSION,
        Some(&schema_version.to_string()),
        eq,
    )?;
    tracing::info!(
        outbox_id,
        "delivery in the previous wire format verified against the outbox row"
    );
    let (message_id, retried) = qstash_info(req);
    Ok(Delivery {
        meta: EventMeta {
            outbox_id,
            topic: topic.to_owned(),
            key: Some(key),
            seq,
            schema_version,
            created_at: Some(created_at),
            traceparent: headers.traceparent,
            correlation_id: headers.correlation_id,
            message_id,
            retried,
        },
        payload: body,
        record_evidence: seq.is_some(),
    })
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
        let status = outcome.status().as_u16();
        match outcome {
            Outcome::Processed { .. } | Outcome::Duplicate { .. } => {
                tracing::info!(
                    status,
                    outcome = outcome.metric(),
                    latency_ms = elapsed.as_secs_f64() * 1e3,
                    "event handled"
                )
            }
            Outcome::Unauthorized(e) => {
                tracing::warn!(status, check = e.check(), error = %e, "signature rejected")
            }
            Outcome::Tampered(e) => {
                tracing::warn!(status, check = "header_mismatch", error = %e, "altered request refused")
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
            .property("status", outcome.status().as_u16());
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
