//! The callback function (`functions/failure-callback`): QStash calls it
//!
//! * at `{CALLBACK_URL}/failure` once it gives up on a message (retries exhausted, or the consumer answered 489):
//!   the body describes the message; it becomes a row in `dead_letters` ([`crate::dead_letters`]), linked to the
//!   outbox event named in the signed body ([`source_event`]) — **guarantee 4, nothing fails silently**;
//! * at `{CALLBACK_URL}/delivered` after every delivery attempt of an ordered event (`Upstash-Callback`): a 2xx
//!   status is the delivery evidence that lets the relay publish the key's next event
//!   ([`crate::ordering::record_delivery`]); another status is noted on the event
//!   ([`crate::ordering::record_failed_attempt`]).
//!
//! Both are signed like any delivery (`sub` = the callback URL) and verified first. Any other path is 404.
//!
//! The body is parsed leniently ([`parse_callback`]): `body`/`sourceBody` are standard base64 (missing padding
//! and the URL-safe alphabet tolerated), `header`/`sourceHeader` are maps of string arrays **or** strings,
//! `notBefore`/`createdAt`/`status`/`retried`/`maxRetries` are numbers **or** numeric strings, and any field may
//! be missing. `parse.rs` reads the body ([`parse_callback`], [`source_event`]); this file is the handler.
//!
//! | case | status |
//! |---|---|
//! | failure callback recorded (or already recorded: idempotent on `dlqId`) | 200 |
//! | failure callback of a batched message: applied events delivered, one dead letter per failed event (`<dlqId>/<outbox id>`), unordered leftovers due again ([`crate::dead_letters::record_qstash_batch_failure`], decision record 0027) | 200 |
//! | delivery callback of a batched message: evidence for all its events in one statement ([`crate::ordering::record_delivery_batch`]) | 200 |
//! | failure callback whose body cannot be parsed | 200 — stored raw with the parse error, never dropped |
//! | delivery evidence / failed attempt recorded (or the event is unknown) | 200 |
//! | delivery callback whose body cannot be parsed, or without status / an outbox id in its signed body | 489 + `Upstash-NonRetryable-Error` (safe: the relay republishes the head after `RELAY_EVIDENCE_TIMEOUT_SECS`) |
//! | bad or missing signature | 401 |
//! | an `x-outbox-id` header that disagrees with the signed body (the request was altered) | 401 |
//! | body over `CALLBACK_MAX_BODY_BYTES` | 413 |
//! | unknown path | 404 |
//! | database error | 503 (QStash retries the callback) |

mod parse;

use std::collections::BTreeMap;
use std::time::Duration;

use http::{Method, StatusCode};
use lambda_http::{Body, Request, Response};
use serde_json::{Map, Value, json};
use tracing::field::Empty;

use crate::config::DeadHeadPolicy;
use crate::contract;
use crate::db::{Db, Statements};
use crate::dead_letters::{
    BatchFailureRecorded, BatchMember, FailureRecorded, QstashFailure, record_qstash_batch_failure,
    record_qstash_failure,
};
use crate::metrics::{EmfRecord, Unit};
use crate::ordering::{
    BatchDeliveryRecorded, DeliveryRecorded, record_delivery, record_delivery_batch,
    record_failed_attempt,
};
use crate::receiver::ReceiverState;
use crate::receiver::http::{
    NONRETRYABLE_HEADER, RequestOutcome, json_response, log_signature_rejected,
    nonretryable_status, request_path, respond,
};
use crate::receiver::verify_request;

pub use parse::{
    CallbackBody, ParsedCallback, SourceEvent, consumer_verdicts, parse_callback, source_event,
    source_events, source_header,
};

/// Longest response body kept in a dead letter or an attempt description.
pub const MAX_RESPONSE_BODY_CHARS: usize = 65_536;
/// How much of the response body goes into a failed attempt's description.
pub const ATTEMPT_BODY_CHARS: usize = 500;

/// The original message's headers (`{name: [values]}`) plus the envelope's event headers (names not already
/// there).
fn with_event_headers(source: Option<Value>, event: &BTreeMap<String, String>) -> Option<Value> {
    if event.is_empty() {
        return source;
    }
    let mut map = match source {
        Some(Value::Object(m)) => m,
        _ => Map::new(),
    };
    for (k, v) in event {
        if !map.keys().any(|e| e.eq_ignore_ascii_case(k)) {
            map.insert(k.clone(), Value::Array(vec![Value::String(v.clone())]));
        }
    }
    Some(Value::Object(map))
}

/// Refuses a callback request whose `x-outbox-id` header (relays before the signed contract forwarded one)
/// disagrees with the outbox id of its signed body. When the signed body names no event (a garbage or truncated
/// failure callback) the header is ignored, never used: the callback is still stored, unlinked.
fn check_id_copy(req: &Request, signed: Option<i64>) -> Result<(), String> {
    check_ids_copy(req, &signed.into_iter().collect::<Vec<_>>())
}

/// [`check_id_copy`] for a message of several events: the copy is their ids joined by `,` (decision record 0027).
fn check_ids_copy(req: &Request, signed: &[i64]) -> Result<(), String> {
    let Some(copy) = req.headers().get(contract::OUTBOX_ID) else {
        return Ok(());
    };
    if signed.is_empty() {
        return Ok(());
    }
    let copy = copy.to_str().unwrap_or("(not visible ASCII)").trim();
    let signed = contract::id_copy(signed.iter().copied());
    if signed == copy {
        Ok(())
    } else {
        Err(format!(
            "header x-outbox-id is {:?} but the signed callback body names event(s) {signed}: the request was \
             altered after QStash signed it",
            copy.chars().take(40).collect::<String>(),
        ))
    }
}

fn lossy_truncated(bytes: &[u8], max_chars: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    if text.chars().count() <= max_chars {
        text.into_owned()
    } else {
        let mut s: String = text.chars().take(max_chars).collect();
        s.push_str("…(truncated)");
        s
    }
}

/// The dead letter for a failure callback. A body that cannot be parsed (or only in part, or without a `dlqId`)
/// keeps the raw bytes (and the natural id then derives from them, so a retried callback stays idempotent). The
/// event's identity comes from the signed body only ([`source_event`]).
pub fn failure_from_callback(raw: &[u8]) -> QstashFailure {
    match parse_callback(raw) {
        Err(e) => QstashFailure {
            raw_callback: Some(raw.to_vec()),
            parse_error: Some(e),
            ..Default::default()
        },
        Ok(parsed) => {
            let callback = &parsed.body;
            let parse_error = (!parsed.problems.is_empty()).then(|| parsed.problems.join("; "));
            let keep_raw = parse_error.is_some() || callback.dlq_id.is_none();
            let source = source_event(callback);
            QstashFailure {
                dlq_id: callback.dlq_id.clone(),
                outbox_id: source.outbox_id,
                topic: source.topic,
                partition_key: source.partition_key,
                source_message_id: callback.source_message_id.clone(),
                status: callback.status,
                response_body: callback
                    .body
                    .as_deref()
                    .map(|r| lossy_truncated(r, MAX_RESPONSE_BODY_CHARS)),
                attempts: callback.retried.map(|r| r.saturating_add(1)),
                source_body: source.payload,
                source_headers: with_event_headers(callback.source_header.clone(), &source.headers),
                url: callback.url.clone(),
                raw_callback: keep_raw.then(|| raw.to_vec()),
                parse_error,
                ..Default::default()
            }
        }
    }
}

/// How a callback request ended (the module table: one variant a row).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CallbackOutcome {
    /// A failure callback, recorded as a dead letter (or recorded before).
    DeadLetter { recorded: FailureRecorded },
    /// A delivery callback with a 2xx status: the event's delivery evidence.
    Delivered {
        outbox_id: i64,
        result: DeliveryRecorded,
    },
    /// A delivery callback with another status, noted on the event.
    AttemptFailed { outbox_id: i64, recorded: bool },
    /// A failure callback for a batched message: per event, delivered, dead-lettered, due again or left alone.
    BatchDeadLetters(BatchFailureRecorded),
    /// A delivery callback with a 2xx status for a batched message: evidence for all its events, in one statement.
    BatchDelivered {
        outbox_ids: Vec<i64>,
        result: BatchDeliveryRecorded,
    },
    /// A delivery callback with another status for a batched message, noted on each of its events.
    BatchAttemptFailed {
        outbox_ids: Vec<i64>,
        recorded: usize,
    },
    /// Missing or invalid signature.
    Unauthorized(crate::receiver::VerifyError),
    /// An `x-outbox-id` header that disagrees with the signed body.
    Tampered(String),
    /// Body over `CALLBACK_MAX_BODY_BYTES`.
    TooLarge { size: usize, max: usize },
    /// Not `POST /failure` or `POST /delivered`.
    NotFound(String),
    /// A delivery callback that names no event or status: the evidence is lost.
    Unusable(String),
    /// The database failed; QStash retries the callback.
    Database(String),
}

impl CallbackOutcome {
    fn status(&self) -> StatusCode {
        match self {
            CallbackOutcome::DeadLetter { .. }
            | CallbackOutcome::Delivered { .. }
            | CallbackOutcome::AttemptFailed { .. }
            | CallbackOutcome::BatchDeadLetters(_)
            | CallbackOutcome::BatchDelivered { .. }
            | CallbackOutcome::BatchAttemptFailed { .. } => StatusCode::OK,
            CallbackOutcome::Unauthorized(_) | CallbackOutcome::Tampered(_) => {
                StatusCode::UNAUTHORIZED
            }
            CallbackOutcome::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            CallbackOutcome::NotFound(_) => StatusCode::NOT_FOUND,
            CallbackOutcome::Unusable(_) => nonretryable_status(),
            CallbackOutcome::Database(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

impl RequestOutcome for CallbackOutcome {
    fn log(&self, _elapsed: Duration) {
        // `answered`: the status this function answers QStash. The span's `consumer_status` is another party's:
        // the consumer's answer to the delivery attempt, as QStash reports it.
        let answered = self.status().as_u16();
        match self {
            CallbackOutcome::DeadLetter { recorded } => match recorded {
                FailureRecorded::Recorded { dead_letter_id, .. } => tracing::error!(
                    answered,
                    dead_letter_id,
                    "QStash gave up on an event: dead letter recorded"
                ),
                FailureRecorded::Merged { dead_letter_id, .. } => tracing::error!(
                    answered,
                    dead_letter_id,
                    "QStash gave up on another message of an event: merged into its dead letter"
                ),
                FailureRecorded::Duplicate => {
                    tracing::info!(answered, "failure callback already recorded")
                }
            },
            CallbackOutcome::Delivered { result, .. } => {
                tracing::info!(answered, result = ?result, "delivery evidence recorded")
            }
            CallbackOutcome::AttemptFailed { recorded, .. } => {
                tracing::warn!(
                    answered,
                    recorded,
                    "QStash reported a failed delivery attempt: noted on the event"
                )
            }
            CallbackOutcome::BatchDeadLetters(r) => {
                for (dead_letter_id, outbox_id) in &r.dead_letters {
                    tracing::error!(
                        answered,
                        dead_letter_id,
                        outbox_id,
                        "QStash gave up on a batched message: dead letter recorded for this event"
                    )
                }
                tracing::info!(
                    answered,
                    merged = ?r.merged,
                    delivered = ?r.delivered,
                    requeued = ?r.requeued,
                    left = ?r.left,
                    duplicates = ?r.duplicates,
                    "failure callback of a batched message recorded"
                )
            }
            CallbackOutcome::BatchDelivered { outbox_ids, result } => {
                tracing::info!(answered, outbox_ids = ?outbox_ids, result = ?result, "delivery evidence recorded for a batch")
            }
            CallbackOutcome::BatchAttemptFailed {
                outbox_ids,
                recorded,
            } => {
                tracing::warn!(
                    answered,
                    outbox_ids = ?outbox_ids,
                    recorded,
                    "QStash reported a failed delivery attempt of a batch: noted on its events"
                )
            }
            CallbackOutcome::Unauthorized(e) => log_signature_rejected(answered, e),
            CallbackOutcome::Tampered(e) => {
                tracing::warn!(answered, check = "header_mismatch", error = %e, "altered request refused")
            }
            CallbackOutcome::TooLarge { size, max } => {
                tracing::error!(answered, size, max, "callback body over the size cap")
            }
            CallbackOutcome::NotFound(m) => {
                tracing::warn!(answered, error = %m, "unknown path")
            }
            CallbackOutcome::Unusable(m) => {
                tracing::error!(answered, error = %m, "delivery callback unusable: evidence lost (the relay republishes after its evidence timeout)")
            }
            CallbackOutcome::Database(m) => {
                tracing::warn!(answered, error = %m, "database error (QStash retries the callback)")
            }
        }
    }

    fn metrics(&self, elapsed: Duration) -> EmfRecord {
        let outcome = self;
        let one = |b: bool| if b { 1.0 } else { 0.0 };
        EmfRecord::new("failure-callback")
            .metric(
                "DeadLettersRecorded",
                Unit::Count,
                match outcome {
                    CallbackOutcome::DeadLetter {
                        recorded: FailureRecorded::Recorded { .. },
                    } => 1.0,
                    CallbackOutcome::BatchDeadLetters(r) => r.dead_letters.len() as f64,
                    _ => 0.0,
                },
            )
            .metric(
                "DeliveryEvidence",
                Unit::Count,
                match outcome {
                    CallbackOutcome::Delivered {
                        result: DeliveryRecorded::Recorded { .. },
                        ..
                    } => 1.0,
                    CallbackOutcome::BatchDelivered { result, .. } => result.found.len() as f64,
                    _ => 0.0,
                },
            )
            .metric(
                "RejectedSignatures",
                Unit::Count,
                one(matches!(
                    outcome,
                    CallbackOutcome::Unauthorized(_) | CallbackOutcome::Tampered(_)
                )),
            )
            .metric(
                "PermanentFailures",
                Unit::Count,
                one(matches!(
                    outcome,
                    CallbackOutcome::Unusable(_)
                        | CallbackOutcome::TooLarge { .. }
                        | CallbackOutcome::NotFound(_)
                )),
            )
            .metric(
                "TransientFailures",
                Unit::Count,
                one(matches!(outcome, CallbackOutcome::Database(_))),
            )
            .metric(
                "HandlerLatency",
                Unit::Milliseconds,
                elapsed.as_secs_f64() * 1e3,
            )
            .property("answered", outcome.status().as_u16())
    }

    fn into_response(self) -> Response<Body> {
        let status = self.status();
        let body = match self {
            CallbackOutcome::DeadLetter {
                recorded:
                    FailureRecorded::Recorded {
                        dead_letter_id,
                        outbox_id,
                    },
            } => {
                json!({"status": "recorded", "dead_letter_id": dead_letter_id, "outbox_id": outbox_id})
            }
            CallbackOutcome::DeadLetter {
                recorded:
                    FailureRecorded::Merged {
                        dead_letter_id,
                        outbox_id,
                    },
            } => {
                json!({"status": "merged", "dead_letter_id": dead_letter_id, "outbox_id": outbox_id})
            }
            CallbackOutcome::DeadLetter {
                recorded: FailureRecorded::Duplicate,
            } => json!({"status": "duplicate"}),
            CallbackOutcome::Delivered {
                outbox_id,
                result: DeliveryRecorded::Recorded { key_advanced },
            } => {
                json!({"status": "delivered", "outbox_id": outbox_id, "key_advanced": key_advanced})
            }
            CallbackOutcome::Delivered {
                outbox_id,
                result: DeliveryRecorded::UnknownEvent,
            } => json!({"status": "unknown_event", "outbox_id": outbox_id}),
            CallbackOutcome::AttemptFailed {
                outbox_id,
                recorded,
            } => json!({"status": "attempt_failed", "outbox_id": outbox_id, "recorded": recorded}),
            CallbackOutcome::BatchDeadLetters(r) => json!({
                "status": "recorded",
                "dead_letters": r.dead_letters.iter().map(|(d, o)| json!({"dead_letter_id": d, "outbox_id": o})).collect::<Vec<_>>(),
                "duplicates": r.duplicates,
                "merged": r.merged.iter().map(|(d, o)| json!({"dead_letter_id": d, "outbox_id": o})).collect::<Vec<_>>(),
                "delivered": r.delivered,
                "requeued": r.requeued,
                "left": r.left,
            }),
            CallbackOutcome::BatchDelivered { outbox_ids, result } => json!({
                "status": "delivered",
                "outbox_ids": outbox_ids,
                "unknown": result.unknown,
                "keys_advanced": result.keys_advanced,
            }),
            CallbackOutcome::BatchAttemptFailed {
                outbox_ids,
                recorded,
            } => {
                json!({"status": "attempt_failed", "outbox_ids": outbox_ids, "recorded": recorded})
            }
            CallbackOutcome::Unauthorized(e) => {
                json!({"error": format!("signature rejected: {e}"), "check": e.check()})
            }
            CallbackOutcome::Tampered(m) => {
                json!({"error": format!("request refused: {m}"), "check": "header_mismatch"})
            }
            CallbackOutcome::TooLarge { size, max } => {
                json!({"error": format!("body is {size} bytes; the limit is {max} (CALLBACK_MAX_BODY_BYTES)")})
            }
            CallbackOutcome::NotFound(m)
            | CallbackOutcome::Unusable(m)
            | CallbackOutcome::Database(m) => {
                json!({"error": m})
            }
        };
        let unusable = status == nonretryable_status();
        let mut r = json_response(status, &body);
        if unusable {
            r.headers_mut()
                .insert(NONRETRYABLE_HEADER, http::HeaderValue::from_static("true"));
        }
        r
    }
}

/// Which callback a path is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallbackKind {
    /// `/failure`.
    Failure,
    /// `/delivered`.
    Delivered,
}

/// The callback kind of a path (a prefix in front is allowed), `None` for any other path.
pub fn callback_kind(path: &str) -> Option<CallbackKind> {
    let path = path.trim_end_matches('/');
    if path.ends_with(contract::FAILURE_PATH) {
        Some(CallbackKind::Failure)
    } else if path.ends_with(contract::DELIVERED_PATH) {
        Some(CallbackKind::Delivered)
    } else {
        None
    }
}

/// The callback function: `POST /failure` and `POST /delivered` from QStash. Never fails: every error is an
/// HTTP status (see the module table). Logs one line and prints one EMF record per request.
pub async fn handle_callback(state: &ReceiverState, req: Request) -> Response<Body> {
    let span = tracing::info_span!(
        "callback",
        kind = Empty,
        outbox_id = Empty,
        topic = Empty,
        key = Empty,
        message_id = Empty,
        dlq_id = Empty,
        consumer_status = Empty,
        retried = Empty,
    );
    respond(span, state.emit_metrics, process(state, &req)).await
}

async fn process(state: &ReceiverState, req: &Request) -> CallbackOutcome {
    let span = tracing::Span::current();
    let raw: &[u8] = req.body().as_ref();
    if raw.len() > state.config.callback_max_body_bytes {
        return CallbackOutcome::TooLarge {
            size: raw.len(),
            max: state.config.callback_max_body_bytes,
        };
    }
    if let Err(e) =
        verify_request(&state.keys, req, state.url_source(), state.verify_options()).await
    {
        return CallbackOutcome::Unauthorized(e);
    }
    let path = request_path(req);
    let kind = match (req.method(), callback_kind(path)) {
        (&Method::POST, Some(kind)) => kind,
        _ => {
            return CallbackOutcome::NotFound(format!(
                "no route for {} {:?}: callbacks are POST /failure and POST /delivered",
                req.method(),
                path.chars().take(200).collect::<String>()
            ));
        }
    };
    span.record("kind", format!("{kind:?}").to_ascii_lowercase());
    match kind {
        CallbackKind::Failure => failure(state, req, raw).await,
        CallbackKind::Delivered => delivered(state, req, raw).await,
    }
}

/// Where a failure is recorded, and with which settings: what the failure callback and the relay's reconciler
/// ([`crate::accounting`]) share, so a dead letter found in QStash's DLQ is recorded exactly as its callback
/// would have been.
pub struct FailureRecorder<'a> {
    /// The outbox's database.
    pub db: &'a Db,
    /// `CONSUMER_NAME`: whose dedupe rows show an event applied after all.
    pub consumer: &'a str,
    /// The dead-head policy of an ordered topic.
    pub policy: &'a (dyn Fn(&str) -> DeadHeadPolicy + Sync),
}

async fn failure(state: &ReceiverState, req: &Request, raw: &[u8]) -> CallbackOutcome {
    let policy = |topic: &str| state.config.dead_head_policy(topic);
    let recorder = FailureRecorder {
        db: &state.db,
        consumer: &state.config.name,
        policy: &policy,
    };
    record_failure(&recorder, Some(req), raw).await
}

/// Records a failure-callback body (one event's message or a batch's) as dead letters. `req`: the callback request,
/// whose `x-outbox-id` copy must agree with the signed body; `None` for a body the relay rebuilt from QStash's DLQ.
pub(crate) async fn record_failure(
    rec: &FailureRecorder<'_>,
    req: Option<&Request>,
    raw: &[u8],
) -> CallbackOutcome {
    let span = tracing::Span::current();
    if let Ok(parsed) = parse_callback(raw)
        && parsed.problems.is_empty()
    {
        let events = source_events(&parsed.body);
        if events.len() > 1 {
            return batch_failure(rec, req, raw, &parsed.body, events).await;
        }
    }
    let failure = failure_from_callback(raw);
    if let Some(req) = req
        && let Err(e) = check_id_copy(req, failure.outbox_id)
    {
        return CallbackOutcome::Tampered(e);
    }
    if let Some(id) = failure.outbox_id {
        span.record("outbox_id", id);
    }
    if let Some(t) = &failure.topic {
        span.record("topic", t.as_str());
    }
    if let Some(k) = &failure.partition_key {
        span.record("key", k.as_str());
    }
    if let Some(m) = &failure.source_message_id {
        span.record("message_id", m.as_str());
    }
    if let Some(d) = &failure.dlq_id {
        span.record("dlq_id", d.as_str());
    }
    if let Some(s) = failure.status {
        span.record("consumer_status", s);
    }
    if let Some(a) = failure.attempts {
        span.record("retried", a - 1);
    }
    if let Some(e) = &failure.parse_error {
        tracing::error!(parse_error = %e, "failure callback body not fully parsed: stored raw");
    }
    let mut conn = match rec.db.pool().acquire().await {
        Ok(c) => c,
        Err(e) => return CallbackOutcome::Database(format!("database unavailable: {e}")),
    };
    match record_qstash_failure(
        &mut conn,
        &failure,
        |topic| (rec.policy)(topic),
        rec.consumer,
        rec.db.statements(),
    )
    .await
    {
        Ok(recorded) => CallbackOutcome::DeadLetter { recorded },
        Err(e) => CallbackOutcome::Database(format!("could not record the dead letter: {e}")),
    }
}

/// Which events of a batched message QStash gave up on die (decision record 0027): those the consumer's last
/// response names `failed` or `retry` (the one it kept asking QStash to retry); without a readable verdict, the first event on an ordered key, every event on an
/// unordered topic (events the consumer applied are set apart later, from its dedupe rows).
fn dead_members(callback: &CallbackBody, events: &[SourceEvent]) -> Vec<(bool, Option<String>)> {
    match consumer_verdicts(callback) {
        Some(verdicts) => events
            .iter()
            .map(|e| {
                let v = verdicts.iter().find(|(id, _, _)| Some(*id) == e.outbox_id);
                match v {
                    // `retry`: the event the consumer kept answering 503 for until QStash gave up. It is the
                    // failing one, as a single event would be: a dead letter of its own, not a silent requeue.
                    Some((_, outcome, error)) => {
                        (outcome == "failed" || outcome == "retry", error.clone())
                    }
                    None => (false, None),
                }
            })
            .collect(),
        // No verdict: every unapplied event of an unordered topic dies; for an ordered key only the first
        // unapplied one, which [`batch_failure`] picks from the dedupe rows.
        None => events.iter().map(|_| (true, None)).collect(),
    }
}

async fn batch_failure(
    rec: &FailureRecorder<'_>,
    req: Option<&Request>,
    raw: &[u8],
    callback: &CallbackBody,
    events: Vec<SourceEvent>,
) -> CallbackOutcome {
    let span = tracing::Span::current();
    let ids: Vec<i64> = events.iter().filter_map(|e| e.outbox_id).collect();
    if let Some(req) = req
        && let Err(e) = check_ids_copy(req, &ids)
    {
        return CallbackOutcome::Tampered(e);
    }
    span.record("outbox_id", contract::id_copy(ids.iter().copied()));
    if let Some(t) = events.first().and_then(|e| e.topic.as_deref()) {
        span.record("topic", t);
    }
    if let Some(m) = &callback.source_message_id {
        span.record("message_id", m.as_str());
    }
    if let Some(d) = &callback.dlq_id {
        span.record("dlq_id", d.as_str());
    }
    if let Some(s) = callback.status {
        span.record("consumer_status", s);
    }
    let ordered = events.first().is_some_and(|e| e.seq.is_some());
    let verdict_readable = consumer_verdicts(callback).is_some();
    let dead = dead_members(callback, &events);
    // The message as a whole (status, attempts, response body, URL): shared by every event's dead letter.
    let base = failure_from_callback(raw);
    let mut members: Vec<BatchMember> = events
        .into_iter()
        .zip(dead)
        .map(|(e, (dead, event_error))| BatchMember {
            failure: QstashFailure {
                outbox_id: e.outbox_id,
                topic: e.topic,
                partition_key: e.partition_key,
                source_body: e.payload,
                source_headers: with_event_headers(callback.source_header.clone(), &e.headers),
                batch_member: true,
                event_error,
                ..base.clone()
            },
            ordered: e.seq.is_some(),
            dead,
        })
        .collect();
    let mut conn = match rec.db.pool().acquire().await {
        Ok(c) => c,
        Err(e) => return CallbackOutcome::Database(format!("database unavailable: {e}")),
    };
    if ordered && !verdict_readable {
        // The first event the consumer has not applied is the dead head; the rest wait behind it.
        let applied = match applied_ids(&mut conn, rec.consumer, &ids, rec.db.statements()).await {
            Ok(a) => a,
            Err(e) => {
                return CallbackOutcome::Database(format!("could not read the dedupe rows: {e}"));
            }
        };
        let mut found = false;
        for m in &mut members {
            let is_applied = m.failure.outbox_id.is_some_and(|id| applied.contains(&id));
            m.dead = !found && !is_applied;
            found |= m.dead;
        }
    }
    match record_qstash_batch_failure(
        &mut conn,
        &members,
        |topic| (rec.policy)(topic),
        rec.consumer,
        rec.db.statements(),
    )
    .await
    {
        Ok(r) => CallbackOutcome::BatchDeadLetters(r),
        Err(e) => CallbackOutcome::Database(format!("could not record the dead letters: {e}")),
    }
}

async fn applied_ids(
    conn: &mut sqlx::PgConnection,
    consumer: &str,
    ids: &[i64],
    statements: Statements,
) -> Result<Vec<i64>, sqlx::Error> {
    let texts: Vec<String> = ids.iter().map(i64::to_string).collect();
    let q = statements
        .query_scalar(crate::schema::q(
            "SELECT message_id FROM {schema}.processed_messages WHERE consumer = $1 AND message_id = ANY ($2::text[])",
        ))
        .bind(consumer)
        .bind(&texts);
    let applied: Vec<String> = statements.run(conn, async |c| q.fetch_all(c).await).await?;
    Ok(applied.iter().filter_map(|s| s.parse().ok()).collect())
}

async fn delivered(state: &ReceiverState, req: &Request, raw: &[u8]) -> CallbackOutcome {
    let span = tracing::Span::current();
    let parsed = match parse_callback(raw) {
        Ok(p) => p,
        Err(e) => return CallbackOutcome::Unusable(format!("delivery callback unusable: {e}")),
    };
    let callback = &parsed.body;
    if let Some(m) = &callback.source_message_id {
        span.record("message_id", m.as_str());
    }
    if let Some(r) = callback.retried {
        span.record("retried", r);
    }
    let Some(status) = callback.status else {
        let why = if parsed.problems.is_empty() {
            "no status".to_owned()
        } else {
            parsed.problems.join("; ")
        };
        return CallbackOutcome::Unusable(format!("delivery callback unusable: {why}"));
    };
    span.record("consumer_status", status);
    let events = source_events(callback);
    if events.len() > 1 {
        return batch_delivered(state, req, callback, status, &events).await;
    }
    let source = source_event(callback);
    if let Err(e) = check_id_copy(req, source.outbox_id) {
        return CallbackOutcome::Tampered(e);
    }
    let Some(outbox_id) = source.outbox_id else {
        return CallbackOutcome::Unusable(
            "delivery callback unusable: its signed body names no outbox event (no envelope in sourceBody, no \
             x-outbox-id in sourceHeader)"
                .into(),
        );
    };
    span.record("outbox_id", outbox_id);
    let mut conn = match state.db.pool().acquire().await {
        Ok(c) => c,
        Err(e) => return CallbackOutcome::Database(format!("database unavailable: {e}")),
    };
    if (200..300).contains(&status) {
        match record_delivery(&mut conn, outbox_id, state.db.statements()).await {
            Ok(result) => CallbackOutcome::Delivered { outbox_id, result },
            Err(e) => CallbackOutcome::Database(format!("could not record delivery evidence: {e}")),
        }
    } else {
        let description = attempt_description(callback, status);
        match record_failed_attempt(&mut conn, outbox_id, &description, state.db.statements()).await
        {
            Ok(recorded) => CallbackOutcome::AttemptFailed {
                outbox_id,
                recorded,
            },
            Err(e) => {
                CallbackOutcome::Database(format!("could not record the failed attempt: {e}"))
            }
        }
    }
}

/// The delivery callback of a batched message: a 2xx is the evidence of all its events, recorded in one statement
/// (one at a time, the key would look free after the first and the relay would republish the next ones); another
/// status is noted on each event.
async fn batch_delivered(
    state: &ReceiverState,
    req: &Request,
    callback: &CallbackBody,
    status: i32,
    events: &[SourceEvent],
) -> CallbackOutcome {
    let ids: Vec<i64> = events.iter().filter_map(|e| e.outbox_id).collect();
    if let Err(e) = check_ids_copy(req, &ids) {
        return CallbackOutcome::Tampered(e);
    }
    tracing::Span::current().record("outbox_id", contract::id_copy(ids.iter().copied()));
    let mut conn = match state.db.pool().acquire().await {
        Ok(c) => c,
        Err(e) => return CallbackOutcome::Database(format!("database unavailable: {e}")),
    };
    if (200..300).contains(&status) {
        match record_delivery_batch(&mut conn, &ids, state.db.statements()).await {
            Ok(result) => CallbackOutcome::BatchDelivered {
                outbox_ids: ids,
                result,
            },
            Err(e) => CallbackOutcome::Database(format!("could not record delivery evidence: {e}")),
        }
    } else {
        let description = attempt_description(callback, status);
        let mut recorded = 0;
        for id in &ids {
            match record_failed_attempt(&mut conn, *id, &description, state.db.statements()).await {
                Ok(r) => recorded += usize::from(r),
                Err(e) => {
                    return CallbackOutcome::Database(format!(
                        "could not record the failed attempt: {e}"
                    ));
                }
            }
        }
        CallbackOutcome::BatchAttemptFailed {
            outbox_ids: ids,
            recorded,
        }
    }
}

/// `delivery attempt 2 of 6 failed with status 503: <body>` (the attempt number is `retried + 1`, the total
/// `maxRetries + 1`).
pub fn attempt_description(callback: &CallbackBody, status: i32) -> String {
    let n = |v: Option<i32>| {
        v.map(|v| v.saturating_add(1).to_string())
            .unwrap_or_else(|| "?".into())
    };
    let last = matches!((callback.retried, callback.max_retries), (Some(r), Some(m)) if r >= m);
    let body = callback
        .body
        .as_deref()
        .map(|r| lossy_truncated(r, ATTEMPT_BODY_CHARS))
        .unwrap_or_default();
    format!(
        "delivery attempt {} of {} failed with status {status}{}: {body}",
        n(callback.retried),
        n(callback.max_retries),
        if last {
            " (last attempt; QStash gives up)"
        } else {
            ""
        },
    )
}
