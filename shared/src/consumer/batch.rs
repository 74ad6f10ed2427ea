//! Applying the events of one delivery — one event, or a batch (decision record 0027) — in **one** transaction:
//! the dedupe rows of all its events at once, then each event inside a savepoint: sequence check (ordered topics),
//! the typed handler ([`apply`] says how the steps are arranged). What happened to each event is an [`EventResult`]; the message's [`Outcome`] (and so the
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

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{Value, json};

use super::delivery::Delivery;
use super::outcome::Outcome;
use super::registry::{EventMeta, HandlerError, Prepared, Route};
use crate::db::Statements;
use crate::ids::{OutboxId, PartitionKey, TopicName};
use crate::ordering::{SequenceCheck, advance_consumer_sequence, check_consumer_sequence};
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
    pub fn to_json(&self, id: OutboxId) -> Value {
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

/// The savepoint each event of a batch runs in. One name, reused: a `SAVEPOINT` whose name is in use shadows the
/// older one, so the release of the previous event's savepoint and the next event's savepoint go to the database
/// together, in one round trip ([`NEXT_SAVEPOINT`]).
const SAVEPOINT: &str = "SAVEPOINT outbox_event";
/// Releases the previous event's savepoint and sets the next one's.
const NEXT_SAVEPOINT: &str = "RELEASE SAVEPOINT outbox_event; SAVEPOINT outbox_event";
/// Undoes the current event alone.
const UNDO_EVENT: &str = "ROLLBACK TO SAVEPOINT outbox_event";

/// Per key of an ordered topic, once its `consumer_sequences` row is locked in this transaction: the last sequence
/// applied, and whether it moved past what the row holds.
type Sequences<'a> = HashMap<(&'a TopicName, &'a PartitionKey), (i64, bool)>;

/// Applies `events` (envelope order) in one transaction, as the module table says. Returns one result per event.
///
/// The steps of [`crate::once`], arranged so a batch costs about one round trip per event besides the handler's
/// own statements: every dedupe row in one statement ([`crate::once::claim_all`]); per event a savepoint (with the
/// previous one's release), for its key's first event the sequence check that locks the key's row
/// ([`check_consumer_sequence`]; the following events are compared with it in memory), the handler; then, before
/// the commit, the dedupe rows of the events that were not applied are removed, the keys' sequences moved to the
/// last event applied, and the delivery evidence recorded. A single event runs without a savepoint: when it fails,
/// the transaction is rolled back. Any database error outside a handler rolls everything back (all `retry`).
// Each nested `async fn` deepens the handler future that callers of `handle_event` lay out, which is close to the
// compiler's default query depth (see `testkit`'s `recursion_limit`): `apply` awaits `attempt` and `finish` itself
// and keeps its other steps in plain functions (`Applying::note`, `out_of_order`).
pub(super) async fn apply(
    receiver: &ReceiverState,
    route: &dyn Route,
    events: &[Delivery<'_>],
) -> Vec<EventResult> {
    let statements = receiver.db.statements();
    let consumer = receiver.config.name.as_str();
    // Decoding the typed payloads needs no database; a payload that does not decode is that event's permanent
    // failure.
    let prepared: Vec<Result<Box<dyn Prepared>, HandlerError>> = events
        .iter()
        .map(|d| route.prepare(d.meta.clone(), d.payload, statements))
        .collect();
    // A database error outside a handler: every event `retry` (nothing of the message is known to be committed).
    let all_retry = |e: sqlx::Error| vec![retry(format!("database error: {e}")); events.len()];

    // Nothing to apply when the first event already decides (a single event that does not decode).
    if let [Err(e)] = prepared.as_slice() {
        return vec![from_handler(e.clone())];
    }
    let mut tx = match receiver.db.pool().begin().await {
        Ok(tx) => tx,
        Err(e) => return all_retry(e),
    };
    let keys: Vec<crate::once::DedupeKey> = events
        .iter()
        .map(|d| crate::once::DedupeKey {
            event: d.meta.event_id,
            copy: d.meta.outbox_id,
        })
        .collect();
    let fresh = match crate::once::claim_all(&mut tx, consumer, &keys, statements).await {
        Ok(f) => f,
        Err(e) => return all_retry(e),
    };
    let mut run = Applying::new(consumer, statements, events);
    for (i, (d, p)) in events.iter().zip(&prepared).enumerate() {
        let result = match p {
            _ if run.stopped => EventResult::NotAttempted,
            Err(e) => from_handler(e.clone()),
            Ok(_) if !fresh[i] => EventResult::Duplicate,
            Ok(p) => match run.attempt(&mut tx, &d.meta, p.as_ref()).await {
                Ok(r) => r,
                Err(e) => return all_retry(e),
            },
        };
        run.note(d, result, fresh[i].then_some(d.meta.event_id));
    }
    let failed = run.results.iter().any(|r| !r.committed());
    if failed && !run.savepoints {
        // One event, and it failed: nothing to keep.
        if let Err(e) = tx.rollback().await {
            tracing::warn!(error = %e, "rollback after a failed event did not complete");
        }
        return run.results;
    }
    if let Err(e) = finish(&mut tx, &run, failed).await {
        let _ = tx.rollback().await;
        return all_retry(e);
    }
    if let Err(e) = tx.commit().await {
        // Ambiguous (it may have committed): the redelivery finds the dedupe rows and answers "duplicate".
        return all_retry(e);
    }
    run.results
}

/// One delivery's events being applied in its transaction, and what that leaves to do before the commit.
struct Applying<'a> {
    consumer: &'a str,
    statements: Statements,
    /// The events are of an ordered topic: a permanent failure stops the rest.
    ordered: bool,
    /// Each event in a savepoint of its own (more than one event).
    savepoints: bool,
    /// A savepoint is set: the next one releases it.
    savepoint_open: bool,
    sequences: Sequences<'a>,
    /// An event failed so that the ones after it are not attempted.
    stopped: bool,
    /// One per event so far.
    results: Vec<EventResult>,
    /// Outbox ids whose delivery evidence the consumer records.
    evidence: Vec<OutboxId>,
    /// Events whose dedupe rows were claimed in this transaction but that were not applied.
    undo: Vec<OutboxId>,
}

impl<'a> Applying<'a> {
    fn new(consumer: &'a str, statements: Statements, events: &[Delivery<'_>]) -> Self {
        Applying {
            consumer,
            statements,
            ordered: events.first().is_some_and(|d| d.meta.seq.is_some()),
            savepoints: events.len() > 1,
            savepoint_open: false,
            sequences: HashMap::new(),
            stopped: false,
            results: Vec::with_capacity(events.len()),
            evidence: Vec::new(),
            undo: Vec::new(),
        }
    }

    /// Records one event's result: its evidence (applied or duplicate), whether the rest stop (the module table),
    /// and, for `claimed` (its event, whose dedupe row was claimed in this transaction) when it was not applied, the
    /// dedupe row to remove.
    fn note(&mut self, d: &Delivery<'_>, result: EventResult, claimed: Option<OutboxId>) {
        match &result {
            EventResult::Processed | EventResult::Duplicate => {
                if d.record_evidence {
                    self.evidence.push(d.meta.outbox_id);
                }
            }
            EventResult::Failed(_) => self.stopped = self.ordered,
            EventResult::Retry { .. } => self.stopped = true,
            EventResult::NotAttempted => {}
        }
        if let Some(id) = claimed
            && !result.committed()
        {
            self.undo.push(id);
        }
        self.results.push(result);
    }

    /// One fresh event, in its savepoint when there are several: the sequence check (ordered topics), then the
    /// handler; a refusal undoes the event alone and is its result. `Err`: a statement of ours failed, the
    /// transaction is lost.
    async fn attempt(
        &mut self,
        conn: &mut sqlx::PgConnection,
        m: &'a EventMeta,
        p: &dyn Prepared,
    ) -> Result<EventResult, sqlx::Error> {
        if self.savepoints {
            let sql = if self.savepoint_open {
                NEXT_SAVEPOINT
            } else {
                SAVEPOINT
            };
            sqlx::raw_sql(sql).execute(&mut *conn).await?;
            self.savepoint_open = true;
        }
        let key = match (m.seq, m.key.as_ref()) {
            (Some(seq), Some(key)) => Some((seq, (&m.topic, key))),
            _ => None,
        };
        // The key's first event in this transaction records its sequence and locks the key's row (undone with the
        // event if it fails); the following ones are compared with the last applied, then recorded once in `finish`.
        let mut first_of_key = false;
        let mut refused = None;
        if let Some((seq, k)) = key {
            match self.sequences.get(&k) {
                Some(&(last, _)) if seq <= last => refused = Some(out_of_order(m, last)),
                Some(_) => {}
                None => {
                    let check = check_consumer_sequence(
                        conn,
                        self.consumer,
                        k.0,
                        k.1,
                        seq,
                        self.statements,
                    );
                    match check.await? {
                        SequenceCheck::InOrder => first_of_key = true,
                        SequenceCheck::Late { last_applied } => {
                            refused = Some(out_of_order(m, last_applied));
                        }
                    }
                }
            }
        }
        let refused = match refused {
            Some(e) => e,
            None => match p.apply(conn).await {
                Ok(()) => {
                    if let Some((seq, k)) = key {
                        // The first event's check already wrote `seq`; a later one's is written in `finish`.
                        self.sequences.insert(k, (seq, !first_of_key));
                    }
                    return Ok(EventResult::Processed);
                }
                Err(e) => e,
            },
        };
        if self.savepoints {
            sqlx::raw_sql(UNDO_EVENT).execute(&mut *conn).await?;
        }
        Ok(from_handler(refused))
    }
}

/// The refusal of an ordered event whose key already applied `last_applied`, a sequence at or after its own.
fn out_of_order(m: &EventMeta, last_applied: i64) -> HandlerError {
    HandlerError::permanent(format!(
        "out of order: event {} has sequence {} for key {:?} of topic {:?}, \
         but sequence {last_applied} was already applied",
        m.outbox_id,
        m.seq.unwrap_or_default(),
        m.key.as_deref().unwrap_or_default(),
        m.topic
    ))
}

/// Before the commit: remove the dedupe rows of the events that were not applied, move each key's sequence to
/// the last event applied, and (when no event failed) record the delivery evidence the relay asked for (decision
/// record 0007): last, so the key's row is locked only briefly; one statement for every event, so the key moves
/// once.
async fn finish(
    conn: &mut sqlx::PgConnection,
    run: &Applying<'_>,
    failed: bool,
) -> Result<(), sqlx::Error> {
    let (consumer, statements) = (run.consumer, run.statements);
    crate::once::forget(conn, consumer, &run.undo, statements).await?;
    for (&(topic, key), &(seq, moved)) in &run.sequences {
        if moved {
            advance_consumer_sequence(conn, consumer, topic, key, seq, statements).await?;
        }
    }
    if !failed && !run.evidence.is_empty() {
        crate::ordering::record_delivery_batch(conn, &run.evidence, statements).await?;
    }
    Ok(())
}

/// The message's outcome from its events' results: any transient → 503 (the first transient's message); else any
/// permanent → 489 (the first failure's message); else 200. `ids` are the events' outbox ids, in order. A batch's
/// messages name the event.
pub(super) fn outcome_of(ids: &[OutboxId], results: &[EventResult]) -> Outcome {
    let batch = ids.len() > 1;
    let name = |id: OutboxId, m: &str| {
        if batch {
            format!("event {id}: {m}")
        } else {
            m.to_owned()
        }
    };
    let first = ids.first().copied().unwrap_or(OutboxId(0));
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
