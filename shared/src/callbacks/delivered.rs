//! Delivery callbacks (`/delivered`, after every delivery attempt of an ordered event or, with callback
//! evidence, an unordered one): a 2xx is the delivery evidence ([`crate::ordering::record_delivery`], for a
//! batched message all its events at once), another status is noted on the event as a failed attempt.

use lambda_http::Request;

use crate::contract;
use crate::ids::OutboxId;
use crate::ordering::{record_delivery, record_delivery_batch, record_failed_attempt};
use crate::receiver::ReceiverState;

use super::outcome::CallbackOutcome;
use super::parse::{
    CallbackBody, SourceEvent, lossy_truncated, parse_callback, source_event, source_events,
};
use super::{ATTEMPT_BODY_CHARS, check_id_copy, check_ids_copy};

pub(super) async fn delivered(state: &ReceiverState, req: &Request, raw: &[u8]) -> CallbackOutcome {
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
    let ids: Vec<OutboxId> = events.iter().filter_map(|e| e.outbox_id).collect();
    if let Err(refused) = super::trust::check_subscriber(state, callback, &ids).await {
        return refused;
    }
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
    span.record("outbox_id", outbox_id.get());
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
    let ids: Vec<OutboxId> = events.iter().filter_map(|e| e.outbox_id).collect();
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
