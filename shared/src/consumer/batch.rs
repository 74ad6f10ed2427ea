//! Applying the events of one delivery — one event, or a batch (decision record 0027) — in **one** transaction,
//! each event inside a savepoint ([`crate::once::handle_once_in`]): dedupe row, sequence check (ordered topics),
//! the typed handler. What happened to each event is an [`EventResult`]; the message's [`Outcome`] (and so the
//! HTTP status QStash acts on) follows from them:
//!
//! | events | transaction | outcome |
//! |---|---|---|
//! | every one applied or a duplicate | commit (with the consumer-side delivery evidence, when asked) | 200 |
//! | event j transient (handler, database) | undo j, stop, commit the events before j | 503: QStash retries the whole message; the committed ones are then duplicates |
//! | event j permanent, ordered key | undo j, stop (later events `not_attempted`: they wait behind the dead head), commit | 489 + `Upstash-NonRetryable-Error` |
//! | event j permanent, unordered | undo j, go on with the next events, commit | 489 + `Upstash-NonRetryable-Error` |
//!
//! The consumer-side delivery evidence (`"evidence":"consumer"`) of the applied and duplicate events is recorded
//! in the same transaction, in one statement ([`crate::ordering::record_delivery_batch`]), and only when no event
//! failed: a message that fails keeps its key gated, as a single event's failure always did, so the relay does
//! not republish the failing event while QStash still retries it or calls the failure callback (which then
//! records the applied ones as delivered).

use std::time::Duration;

use serde_json::{Value, json};

use super::delivery::Delivery;
use super::http::Outcome;
use super::registry::{HandlerError, Prepared, Route};
use crate::once::{Once, OnceError, handle_once_in};
use crate::ordering::{SequenceCheck, check_consumer_sequence};
use crate::receiver::ReceiverState;

/// What happened to one event of a delivery (the `events` list of the response body).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventResult {
    /// Applied now (committed with its dedupe row).
    Processed,
    /// Applied before: nothing ran.
    Duplicate,
    /// Refused permanently (undone alone); the message is answered 489.
    Failed(String),
    /// Not tried: an earlier event of the ordered key failed, or an earlier event was transient.
    NotAttempted,
    /// A transient failure (undone alone, or the whole transaction failed); QStash retries the message.
    Retry {
        /// What failed.
        message: String,
        /// When to retry, if known.
        retry_after: Option<Duration>,
    },
}

impl EventResult {
    /// The wire name of the outcome.
    pub fn as_str(&self) -> &'static str {
        match self {
            EventResult::Processed => "processed",
            EventResult::Duplicate => "duplicate",
            EventResult::Failed(_) => "failed",
            EventResult::NotAttempted => "not_attempted",
            EventResult::Retry { .. } => "retry",
        }
    }

    /// `{"id":41,"outcome":"failed","error":"…"}`.
    pub fn to_json(&self, id: i64) -> Value {
        match self {
            EventResult::Failed(e) | EventResult::Retry { message: e, .. } => {
                json!({"id": id, "outcome": self.as_str(), "error": e})
            }
            _ => json!({"id": id, "outcome": self.as_str()}),
        }
    }

    /// Committed in this request (or before it).
    pub fn committed(&self) -> bool {
        matches!(self, EventResult::Processed | EventResult::Duplicate)
    }
}

fn retry(message: String) -> EventResult {
    EventResult::Retry {
        message,
        retry_after: None,
    }
}

fn from_handler(e: HandlerError) -> EventResult {
    match e {
        HandlerError::Permanent(m) => EventResult::Failed(m),
        HandlerError::Transient {
            message,
            retry_after,
        } => EventResult::Retry {
            message,
            retry_after,
        },
    }
}

/// Applies `events` (envelope order) in one transaction, as the module table says. Returns one result per event.
pub(super) async fn apply(
    receiver: &ReceiverState,
    route: &dyn Route,
    events: &[Delivery<'_>],
) -> Vec<EventResult> {
    let ordered = events.first().is_some_and(|d| d.meta.seq.is_some());
    let persistent = receiver.persistent;
    let consumer = receiver.config.name.as_str();
    // Decoding the typed payloads needs no database; a payload that does not decode is that event's permanent
    // failure.
    let prepared: Vec<Result<Box<dyn Prepared>, HandlerError>> = events
        .iter()
        .map(|d| route.prepare(d.meta.clone(), d.payload, persistent))
        .collect();
    let mut results: Vec<EventResult> = Vec::with_capacity(events.len());
    let all_retry = |message: String, n: usize| vec![retry(message); n];

    // Nothing to apply when the first event already decides (a single event that does not decode).
    if let [Err(e)] = prepared.as_slice() {
        return vec![from_handler(e.clone())];
    }
    let mut tx = match receiver.pool.begin().await {
        Ok(tx) => tx,
        Err(e) => return all_retry(format!("database error: {e}"), events.len()),
    };
    let mut stopped = false;
    let mut evidence: Vec<i64> = Vec::new();
    for (d, p) in events.iter().zip(&prepared) {
        if stopped {
            results.push(EventResult::NotAttempted);
            continue;
        }
        let m = &d.meta;
        let result = match p {
            Err(e) => from_handler(e.clone()),
            Ok(p) => {
                let r = handle_once_in(
                    &mut tx,
                    consumer,
                    &m.outbox_id.to_string(),
                    persistent,
                    async |conn: &mut sqlx::PgConnection| -> Result<(), HandlerError> {
                        if let (Some(seq), Some(key)) = (m.seq, m.key.as_deref()) {
                            match check_consumer_sequence(
                                conn, consumer, &m.topic, key, seq, persistent,
                            )
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
                        p.apply(conn).await
                    },
                )
                .await;
                match r {
                    Ok(Once::Applied(())) => EventResult::Processed,
                    Ok(Once::Duplicate) => EventResult::Duplicate,
                    Err(OnceError::Work(e)) => from_handler(e),
                    Err(OnceError::Database(e)) => retry(format!("database error: {e}")),
                }
            }
        };
        match &result {
            EventResult::Processed | EventResult::Duplicate => {
                if d.record_evidence {
                    evidence.push(m.outbox_id);
                }
            }
            EventResult::Failed(_) => stopped = ordered,
            EventResult::Retry { .. } => stopped = true,
            EventResult::NotAttempted => {}
        }
        results.push(result);
    }
    let failed = results.iter().any(|r| !r.committed());
    // The relay asked for the evidence here (decision record 0007): last statement before commit, so the key's row
    // is locked only briefly; one statement for every event, so the key moves once.
    if !failed
        && !evidence.is_empty()
        && let Err(e) = crate::ordering::record_delivery_batch(&mut tx, &evidence, persistent).await
    {
        let _ = tx.rollback().await;
        return all_retry(
            format!("database error while recording delivery evidence: {e}"),
            events.len(),
        );
    }
    if let Err(e) = tx.commit().await {
        // Ambiguous (it may have committed): the redelivery finds the dedupe rows and answers "duplicate".
        return all_retry(format!("database error: {e}"), events.len());
    }
    results
}

/// The message's outcome from its events' results: any transient → 503 (the first transient's message); else any
/// permanent → 489 (the first failure's message); else 200. `ids` are the events' outbox ids, in order. A batch's
/// messages name the event.
pub(super) fn outcome_of(ids: &[i64], results: &[EventResult]) -> Outcome {
    let batch = ids.len() > 1;
    let name = |id: i64, m: &str| {
        if batch {
            format!("event {id}: {m}")
        } else {
            m.to_owned()
        }
    };
    let first = ids.first().copied().unwrap_or_default();
    if let Some((
        id,
        EventResult::Retry {
            message,
            retry_after,
        },
    )) = ids
        .iter()
        .zip(results)
        .find(|(_, r)| matches!(r, EventResult::Retry { .. }))
    {
        return Outcome::Transient {
            message: name(*id, message),
            retry_after: *retry_after,
        };
    }
    if let Some((id, EventResult::Failed(m))) = ids
        .iter()
        .zip(results)
        .find(|(_, r)| matches!(r, EventResult::Failed(_)))
    {
        return Outcome::Permanent(name(*id, m));
    }
    if results.iter().all(|r| *r == EventResult::Duplicate) {
        Outcome::Duplicate { outbox_id: first }
    } else {
        Outcome::Processed { outbox_id: first }
    }
}
