//! How a callback request ended ([`CallbackOutcome`], one variant a row of the module table) and what that means
//! for QStash (the status and body), the log line and the EMF record.

use std::time::Duration;

use http::StatusCode;
use lambda_http::{Body, Response};
use serde_json::{Value, json};

use crate::dead_letters::{BatchFailureRecorded, FailureRecorded};
use crate::ids::OutboxId;
use crate::metrics::{EmfRecord, Unit};
use crate::ordering::{BatchDeliveryRecorded, DeliveryRecorded};
use crate::receiver::http::{
    NONRETRYABLE_HEADER, RequestOutcome, json_response, log_signature_rejected, nonretryable_status,
};

/// How a callback request ended (the module table: one variant a row).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CallbackOutcome {
    /// A failure callback, recorded as a dead letter (or recorded before).
    DeadLetter { recorded: FailureRecorded },
    /// A delivery callback with a 2xx status: the event's delivery evidence.
    Delivered {
        outbox_id: OutboxId,
        result: DeliveryRecorded,
    },
    /// A delivery callback with another status, noted on the event.
    AttemptFailed { outbox_id: OutboxId, recorded: bool },
    /// A failure callback for a batched message: per event, delivered, dead-lettered, due again or left alone.
    BatchDeadLetters(BatchFailureRecorded),
    /// A delivery callback with a 2xx status for a batched message: evidence for all its events, in one statement.
    BatchDelivered {
        outbox_ids: Vec<OutboxId>,
        result: BatchDeliveryRecorded,
    },
    /// A delivery callback with another status for a batched message, noted on each of its events.
    BatchAttemptFailed {
        outbox_ids: Vec<OutboxId>,
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

impl CallbackOutcome {
    /// The JSON body of the response.
    fn into_body(self) -> Value {
        match self {
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
        }
    }
}

fn log_dead_letter(answered: u16, recorded: &FailureRecorded) {
    match recorded {
        FailureRecorded::Recorded { dead_letter_id, .. } => tracing::error!(
            answered,
            dead_letter_id = dead_letter_id.get(),
            "QStash gave up on an event: dead letter recorded"
        ),
        FailureRecorded::Merged { dead_letter_id, .. } => tracing::error!(
            answered,
            dead_letter_id = dead_letter_id.get(),
            "QStash gave up on another message of an event: merged into its dead letter"
        ),
        FailureRecorded::Duplicate => {
            tracing::info!(answered, "failure callback already recorded")
        }
    }
}

fn log_batch_dead_letters(answered: u16, r: &BatchFailureRecorded) {
    for (dead_letter_id, outbox_id) in &r.dead_letters {
        tracing::error!(
            answered,
            dead_letter_id = dead_letter_id.get(),
            outbox_id = outbox_id.get(),
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

impl RequestOutcome for CallbackOutcome {
    fn log(&self, _elapsed: Duration) {
        // `answered`: the status this function answers QStash. The span's `consumer_status` is another party's:
        // the consumer's answer to the delivery attempt, as QStash reports it.
        let answered = self.status().as_u16();
        match self {
            CallbackOutcome::DeadLetter { recorded } => log_dead_letter(answered, recorded),
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
            CallbackOutcome::BatchDeadLetters(r) => log_batch_dead_letters(answered, r),
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
        let body = self.into_body();
        let unusable = status == nonretryable_status();
        let mut r = json_response(status, &body);
        if unusable {
            r.headers_mut()
                .insert(NONRETRYABLE_HEADER, http::HeaderValue::from_static("true"));
        }
        r
    }
}
