//! Failure callbacks (`/failure`): QStash gave up on a message, which becomes dead letters — one for a message of
//! one event ([`failure_from_callback`]), one per failed event of a batched message (decision record 0027). The
//! relay's reconciler ([`crate::accounting`]) records what it finds in QStash's DLQ through the same
//! [`FailureRecorder`].

use std::collections::BTreeMap;

use lambda_http::Request;
use serde_json::{Map, Value};

use crate::config::DeadHeadPolicy;
use crate::contract;
use crate::db::Db;
use crate::dead_letters::{
    BatchMember, QstashFailure, record_qstash_batch_failure, record_qstash_failure,
};
use crate::ids::OutboxId;
use crate::receiver::ReceiverState;

use super::outcome::CallbackOutcome;
use super::parse::{
    CallbackBody, SourceEvent, consumer_verdicts, lossy_truncated, parse_callback, source_event,
    source_events,
};
use super::{MAX_RESPONSE_BODY_CHARS, check_id_copy, check_ids_copy};

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
                subscriber: source.subscriber,
                event_id: source.event_id,
                url: callback.url.clone(),
                raw_callback: keep_raw.then(|| raw.to_vec()),
                parse_error,
                ..Default::default()
            }
        }
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

pub(super) async fn failure(state: &ReceiverState, req: &Request, raw: &[u8]) -> CallbackOutcome {
    if let Ok(parsed) = parse_callback(raw) {
        let ids: Vec<OutboxId> = source_events(&parsed.body)
            .iter()
            .filter_map(|e| e.outbox_id)
            .collect();
        if let Err(refused) = super::trust::check_subscriber(state, &parsed.body, &ids).await {
            return refused;
        }
    }
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
        span.record("outbox_id", id.get());
    }
    if let Some(t) = &failure.topic {
        span.record("topic", t.as_str());
    }
    if let Some(k) = &failure.partition_key {
        span.record("key", k.as_str());
    }
    record_message(
        &span,
        failure.source_message_id.as_deref(),
        failure.dlq_id.as_deref(),
        failure.status,
    );
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

/// Records on the callback's span what QStash says of the message as a whole, for a single event and a batch
/// alike: its message id, its DLQ id and the consumer's last status.
fn record_message(
    span: &tracing::Span,
    message_id: Option<&str>,
    dlq_id: Option<&str>,
    status: Option<i32>,
) {
    if let Some(m) = message_id {
        span.record("message_id", m);
    }
    if let Some(d) = dlq_id {
        span.record("dlq_id", d);
    }
    if let Some(s) = status {
        span.record("consumer_status", s);
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

/// Records QStash's failure of a batched message (decision record 0027): its `x-outbox-id` copy checked, one
/// [`BatchMember`] per event, the dead head picked from the dedupe rows when an ordered message has no readable
/// verdict, then [`record_qstash_batch_failure`].
async fn batch_failure(
    rec: &FailureRecorder<'_>,
    req: Option<&Request>,
    raw: &[u8],
    callback: &CallbackBody,
    events: Vec<SourceEvent>,
) -> CallbackOutcome {
    let span = tracing::Span::current();
    let ids: Vec<OutboxId> = events.iter().filter_map(|e| e.outbox_id).collect();
    if let Some(req) = req
        && let Err(e) = check_ids_copy(req, &ids)
    {
        return CallbackOutcome::Tampered(e);
    }
    record_batch_on_span(&span, callback, &events, &ids);
    let ordered = events.first().is_some_and(|e| e.seq.is_some());
    let verdict_readable = consumer_verdicts(callback).is_some();
    let mut members = batch_members(raw, callback, events);
    let mut conn = match rec.db.pool().acquire().await {
        Ok(c) => c,
        Err(e) => return CallbackOutcome::Database(format!("database unavailable: {e}")),
    };
    if ordered && !verdict_readable {
        let applied = match crate::dead_letters::applied_ids(
            &mut conn,
            rec.consumer,
            &ids,
            rec.db.statements(),
        )
        .await
        {
            Ok(a) => a,
            Err(e) => {
                return CallbackOutcome::Database(format!("could not read the dedupe rows: {e}"));
            }
        };
        mark_dead_head(&mut members, &applied);
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

/// Records on the callback's span the batch's outbox ids, its topic and what QStash says of the message.
fn record_batch_on_span(
    span: &tracing::Span,
    callback: &CallbackBody,
    events: &[SourceEvent],
    ids: &[OutboxId],
) {
    span.record("outbox_id", contract::id_copy(ids.iter().copied()));
    if let Some(t) = events.first().and_then(|e| e.topic.as_deref()) {
        span.record("topic", t);
    }
    record_message(
        span,
        callback.source_message_id.as_deref(),
        callback.dlq_id.as_deref(),
        callback.status,
    );
}

/// One [`BatchMember`] per event of the message: its own failure (the message's, with the event's identity,
/// payload and headers and the consumer's word on it), whether it is ordered, whether it dies ([`dead_members`]).
fn batch_members(
    raw: &[u8],
    callback: &CallbackBody,
    events: Vec<SourceEvent>,
) -> Vec<BatchMember> {
    let dead = dead_members(callback, &events);
    // The message as a whole (status, attempts, response body, URL): shared by every event's dead letter.
    let base = failure_from_callback(raw);
    events
        .into_iter()
        .zip(dead)
        .map(|(e, (dead, event_error))| BatchMember {
            failure: QstashFailure {
                outbox_id: e.outbox_id,
                topic: e.topic,
                partition_key: e.partition_key,
                source_body: e.payload,
                source_headers: with_event_headers(callback.source_header.clone(), &e.headers),
                subscriber: e.subscriber,
                event_id: e.event_id,
                batch_member: true,
                event_error,
                ..base.clone()
            },
            ordered: e.seq.is_some(),
            dead,
        })
        .collect()
}

/// An ordered message without a readable verdict: the first event the consumer has not applied is the dead
/// head; the rest wait behind it.
fn mark_dead_head(members: &mut [BatchMember], applied: &[OutboxId]) {
    let mut found = false;
    for m in members {
        let is_applied = m.failure.outbox_id.is_some_and(|id| applied.contains(&id));
        m.dead = !found && !is_applied;
        found |= m.dead;
    }
}
