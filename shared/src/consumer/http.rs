//! The consumer's HTTP handler: the steps of the table in the parent module, ending in an [`Outcome`].

use std::time::Duration;

use chrono::Utc;
use http::Method;
use lambda_http::{Body, Request, Response};
use serde_json::json;
use tracing::field::Empty;

use super::ConsumerState;
use super::batch::{self, EventResult};
use super::delivery::{Delivery, check_own_key, current_delivery, legacy_delivery};
use super::outcome::Outcome;
use super::registry::{EventMeta, Route};
use crate::contract::{self, Contract};
use crate::ids::OutboxId;
use crate::metrics::{EmfRecord, Unit};
use crate::receiver::ReceiverState;
use crate::receiver::http::{RequestOutcome, log_signature_rejected, request_path, respond};
use crate::receiver::verify_request;
use crate::telemetry::spans;
use opentelemetry::Context;
use opentelemetry::context::FutureExt as _;

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
        batch_size = Empty,
    );
    let response = respond(span, state.receiver.emit_metrics, async {
        let (outcome, events) = process(state, &req).await;
        Handled { outcome, events }
    })
    .await;
    // The request's spans (export on only) leave before it returns: the environment may freeze after.
    crate::telemetry::flush().await;
    response
}

/// A finished request: its outcome and, once they were known, its events and what happened to each.
struct Handled {
    outcome: Outcome,
    events: Vec<(EventMeta, EventResult)>,
}

impl RequestOutcome for Handled {
    fn log(&self, elapsed: Duration) {
        let outcome = &self.outcome;
        // `answered`: the status this function answers QStash (the callback function's lines, for the same attempt,
        // name it `consumer_status`).
        let answered = outcome.status().as_u16();
        if self.events.len() > 1 {
            // One line per event of a batch, then the message's line.
            for (m, r) in &self.events {
                let span = tracing::info_span!(
                    "event",
                    outbox_id = m.outbox_id.get(),
                    key = m.key.as_deref(),
                    seq = m.seq,
                    correlation_id = m.correlation_id.as_deref()
                );
                let _e = span.enter();
                match r {
                    EventResult::Failed(e) => {
                        tracing::error!(outcome = r.as_str(), error = %e, "event of the batch refused permanently")
                    }
                    EventResult::Retry { message, .. } => {
                        tracing::warn!(outcome = r.as_str(), error = %message, "event of the batch failed transiently")
                    }
                    _ => tracing::info!(outcome = r.as_str(), "event of the batch"),
                }
            }
        }
        match outcome {
            Outcome::Processed { .. } | Outcome::Duplicate { .. } => {
                tracing::info!(
                    answered,
                    outcome = outcome.metric(),
                    latency_ms = elapsed.as_secs_f64() * 1e3,
                    "event handled"
                )
            }
            Outcome::Unauthorized(e) => log_signature_rejected(answered, e),
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
        // Counted per event (a batch counts each of its events once); a request refused before its events were
        // known counts once, by its outcome.
        let per_event =
            |f: fn(&EventResult) -> bool| self.events.iter().filter(|(_, r)| f(r)).count() as f64;
        for name in [
            "Applied",
            "Duplicates",
            "RejectedSignatures",
            "PermanentFailures",
            "TransientFailures",
        ] {
            let v = if self.events.is_empty() {
                if outcome.metric() == name { 1.0 } else { 0.0 }
            } else {
                match name {
                    "Applied" => per_event(|r| *r == EventResult::Processed),
                    "Duplicates" => per_event(|r| *r == EventResult::Duplicate),
                    "PermanentFailures" => per_event(|r| matches!(r, EventResult::Failed(_))),
                    "TransientFailures" => per_event(|r| matches!(r, EventResult::Retry { .. })),
                    _ => 0.0,
                }
            };
            rec = rec.metric(name, Unit::Count, v);
        }
        if !self.events.is_empty() {
            rec = rec.metric("BatchSize", Unit::Count, self.events.len() as f64);
        }
        rec = rec
            .metric(
                "HandlerLatency",
                Unit::Milliseconds,
                elapsed.as_secs_f64() * 1e3,
            )
            .property("answered", outcome.status().as_u16());
        if let Some((m, _)) = self.events.first() {
            rec = rec
                .property("outbox_id", m.outbox_id.get())
                .property("topic", m.topic.as_str());
            if self.events.len() > 1 {
                let ids: Vec<i64> = self.events.iter().map(|(m, _)| m.outbox_id.get()).collect();
                rec = rec.property("outbox_ids", ids);
            }
            if let Some(id) = &m.message_id {
                rec = rec.property("message_id", id.clone());
            }
        }
        // The oldest applied event's commit-to-applied time (the batch's worst).
        let oldest = self
            .events
            .iter()
            .filter(|(_, r)| *r == EventResult::Processed)
            .filter_map(|(m, _)| m.created_at)
            .min();
        if let Some(created) = oldest {
            let ms = (Utc::now() - created).num_milliseconds().max(0) as f64;
            rec = rec.metric("CommitToApplied", Unit::Milliseconds, ms);
        }
        rec
    }

    fn into_response(self) -> Response<Body> {
        let Handled { outcome, events } = self;
        if events.is_empty() {
            return outcome.into_response();
        }
        let transient = matches!(outcome, Outcome::Transient { .. });
        let mut r = outcome.into_response();
        // Today's top-level fields stay; `events` says what happened to each event (k = 1 too). A batch has no
        // single `outbox_id`; its `status` says `partial` when some events committed and others did not.
        let mut body: serde_json::Value =
            serde_json::from_slice(r.body().as_ref()).unwrap_or_else(|_| json!({}));
        if let Some(obj) = body.as_object_mut() {
            if events.len() > 1 {
                obj.remove("outbox_id");
                let committed = events.iter().filter(|(_, r)| r.committed()).count();
                if !obj.contains_key("status") {
                    let status = match (transient, committed) {
                        (_, c) if c > 0 => "partial",
                        (true, _) => "retry",
                        (false, _) => "failed",
                    };
                    obj.insert("status".into(), json!(status));
                }
            }
            obj.insert(
                "events".into(),
                events.iter().map(|(m, r)| r.to_json(m.outbox_id)).collect(),
            );
        }
        *r.body_mut() = Body::Text(body.to_string());
        r
    }
}

// The steps are functions of their own only where no `.await` moves with them: each nested `async fn` deepens the
// handler future that callers of `handle_event` lay out, which is close to the compiler's default query depth (see
// `testkit`'s `recursion_limit`).
async fn process(state: &ConsumerState, req: &Request) -> (Outcome, Vec<(EventMeta, EventResult)>) {
    let receiver: &ReceiverState = &state.receiver;
    let span = tracing::Span::current();

    // 1. Cap the body before doing any work on it.
    let size = req.body().len();
    if size > receiver.config.max_body_bytes {
        let max = receiver.config.max_body_bytes;
        return (Outcome::TooLarge { size, max }, Vec::new());
    }

    // 2. Verify the signature on the raw bytes. Nothing is read or written before this.
    if let Some(id) = req
        .headers()
        .get("upstash-message-id")
        .and_then(|v| v.to_str().ok())
    {
        span.record("message_id", id);
    }
    let (keys, urls, options) = (
        &receiver.keys,
        receiver.url_source(),
        receiver.verify_options(),
    );
    if let Err(e) = verify_request(keys, req, urls, options).await {
        return (Outcome::Unauthorized(e), Vec::new());
    }

    // 3. Route, and read what the delivery says about its events by the wire contract its (signed) URL names.
    let (topic, route) = match route(state, req) {
        Ok(r) => r,
        Err(o) => return (o, Vec::new()),
    };
    let delivery = match contract::contract_of_query(req.uri().query()) {
        Ok(Contract::Current) => check_own_key(receiver, req)
            .and_then(|()| current_delivery(req, topic, &receiver.config.name)),
        Ok(Contract::Legacy) => legacy_delivery(receiver, req, topic).await.map(|d| vec![d]),
        Ok(Contract::Newer(v)) => Err(newer_contract(v)),
        Err(e) => Err(Outcome::Permanent(e)),
    };
    let deliveries = match delivery {
        Ok(d) => d,
        Err(o) => return (o, Vec::new()),
    };
    record_first_event(&span, &deliveries);

    // 4.–5. Decode the typed payloads; per event, in one transaction: dedupe row, sequence check, the handler.
    // Traced as the messaging `process` span (when export is on), the parent of what the handlers trace.
    let traced = process_span(topic, &receiver.config.name, &deliveries);
    let applying = batch::apply(receiver, route, &deliveries);
    let results = match &traced {
        Some(cx) => applying.with_context(cx.clone()).await,
        None => applying.await,
    };
    let ids: Vec<OutboxId> = deliveries.iter().map(|d| d.meta.outbox_id).collect();
    let outcome = batch::outcome_of(&ids, &results);
    if let Some(cx) = &traced {
        spans::end(cx, outcome_error(&outcome));
    }
    let events = deliveries
        .into_iter()
        .map(|d| d.meta)
        .zip(results)
        .collect();
    (outcome, events)
}

/// The `process` span of a delivery's events ([`spans::process`]).
fn process_span(topic: &str, subscriber: &str, deliveries: &[Delivery<'_>]) -> Option<Context> {
    if !spans::enabled() {
        return None;
    }
    let events: Vec<spans::Delivered<'_>> = deliveries
        .iter()
        .map(|d| spans::Delivered {
            event: spans::Linked {
                traceparent: d.meta.traceparent.as_deref(),
                message_id: d.meta.event_id.get(),
                subscriber,
            },
            retried: d.meta.retried,
            resent: d.resent,
        })
        .collect();
    let qstash_id = deliveries
        .first()
        .and_then(|d| d.meta.message_id.as_deref());
    spans::process(topic, subscriber, qstash_id, &events)
}

/// The error a `process` span ends with: none when every event was applied or was a duplicate.
fn outcome_error(outcome: &Outcome) -> Option<String> {
    match outcome {
        Outcome::Processed { .. } | Outcome::Duplicate { .. } => None,
        other => Some(other.metric().to_owned()),
    }
}

/// Step 3: the topic of a POST to `/events/{topic}`, and its registered route.
fn route<'s, 'r>(
    state: &'s ConsumerState,
    req: &'r Request,
) -> Result<(&'r str, &'s dyn Route), Outcome> {
    if req.method() != Method::POST {
        return Err(Outcome::Permanent(format!(
            "method {} is not accepted: events are POSTed",
            req.method()
        )));
    }
    let path = request_path(req);
    let Some(topic) = topic_of(path) else {
        return Err(Outcome::Permanent(format!(
            "no route for path {:?}: events go to /events/{{topic}}",
            path.chars().take(200).collect::<String>()
        )));
    };
    tracing::Span::current().record("topic", topic);
    let Some(route) = state.registry.get(topic) else {
        return Err(Outcome::Permanent(format!(
            "unknown topic {topic:?}: no handler registered"
        )));
    };
    Ok((topic, route.as_ref()))
}

/// A delivery in a wire contract newer than this consumer's: retried until the consumer is upgraded.
fn newer_contract(v: u32) -> Outcome {
    Outcome::Transient {
        message: format!(
            "delivery in wire contract {v}, newer than this consumer's {}: retry after the consumer is \
             upgraded",
            contract::CONTRACT_VERSION
        ),
        retry_after: Some(Duration::from_secs(60)),
    }
}

/// The span names the first event (for a batch, `batch_size` says how many follow; each has its own line).
fn record_first_event(span: &tracing::Span, deliveries: &[Delivery<'_>]) {
    if let Some(meta) = deliveries.first().map(|d| &d.meta) {
        span.record("outbox_id", meta.outbox_id.get());
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
    }
    if deliveries.len() > 1 {
        span.record("batch_size", deliveries.len());
    }
}
