//! The messaging spans (OpenTelemetry's semantic conventions for messaging, decision record 0074): the producer's
//! `create` span per event, the relay's `send` span per QStash request linking every event it carries, and the
//! consumer's `process` span per delivery, a child of the producer's span on an event's first delivery and linked
//! otherwise (a retry, a redrive, a republish or a replay) and for every event of a batch.
//!
//! Spans go to the global tracer provider: the one [`super::export`] installs, or the application's own. With
//! neither, nothing here is created: the producer starts its spans only when export is on or the caller's context
//! holds a sampled span, and the relay and the consumer only when export is on.

use opentelemetry::trace::{
    Link, Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _,
};
use opentelemetry::{Context, KeyValue, global};

use super::export;

/// The messaging system named in every span.
pub(crate) const SYSTEM: &str = "qstash";
/// The instrumentation scope's name.
const SCOPE: &str = "outbox";

/// Attribute names (OpenTelemetry's messaging conventions; the delivery attempt under the system's own prefix,
/// as the conventions do for other systems).
pub(crate) mod attr {
    pub(crate) const SYSTEM: &str = "messaging.system";
    pub(crate) const OPERATION_TYPE: &str = "messaging.operation.type";
    pub(crate) const OPERATION_NAME: &str = "messaging.operation.name";
    pub(crate) const DESTINATION: &str = "messaging.destination.name";
    pub(crate) const SUBSCRIPTION: &str = "messaging.destination.subscription.name";
    pub(crate) const MESSAGE_ID: &str = "messaging.message.id";
    pub(crate) const BATCH_COUNT: &str = "messaging.batch.message_count";
    pub(crate) const DELIVERY_ATTEMPT: &str = "messaging.qstash.message.delivery_attempt";
    pub(crate) const QSTASH_MESSAGE_ID: &str = "messaging.qstash.message.qstash_id";
}

/// A started span; ends when dropped.
pub(crate) type MessagingSpan = global::BoxedSpan;

/// Whether the relay and the consumer make spans (export is on in this process).
pub(crate) fn enabled() -> bool {
    export::enabled()
}

/// `00-<trace id>-<span id>-<flags>` of a span context.
pub(crate) fn traceparent_of(cx: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        cx.trace_id(),
        cx.span_id(),
        cx.trace_flags().to_u8()
    )
}

/// `00-<trace id>-<parent id>-<flags>`, lower-case hex, non-zero ids.
pub(crate) fn is_traceparent(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    let hex = |p: &str, n: usize| {
        p.len() == n
            && p.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    parts.len() == 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && hex(parts[1], 32)
        && parts[1].bytes().any(|b| b != b'0')
        && hex(parts[2], 16)
        && parts[2].bytes().any(|b| b != b'0')
        && hex(parts[3], 2)
}

/// The span context a W3C `traceparent` names (remote), if it is well formed and not all zeros.
pub(crate) fn parse_traceparent(s: &str) -> Option<SpanContext> {
    let mut parts = s.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version != "00" || parts.next().is_some() || trace.len() != 32 || span.len() != 16 {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    let span_id = SpanId::from_hex(span).ok()?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    let cx = SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    );
    cx.is_valid().then_some(cx)
}

/// One producer `create` span per event of an enqueue, children of the caller's context (or of an event's own
/// `traceparent` when the caller set one). Empty when no span is to be made.
pub(crate) struct Creating {
    spans: Vec<MessagingSpan>,
}

impl Creating {
    /// Starts the spans for events of `topics` (with the `traceparent`s their callers set), under `caller`.
    pub(crate) fn start<'a>(
        caller: &Context,
        events: impl ExactSizeIterator<Item = (&'a str, Option<&'a str>)>,
    ) -> Creating {
        if !enabled() && !caller.span().span_context().is_sampled() {
            return Creating { spans: Vec::new() };
        }
        let tracer = global::tracer(SCOPE);
        let spans = events
            .map(|(topic, given)| {
                let parent = given
                    .and_then(parse_traceparent)
                    .map(|sc| caller.with_remote_span_context(sc));
                tracer
                    .span_builder(format!("create {topic}"))
                    .with_kind(SpanKind::Producer)
                    .with_attributes([
                        KeyValue::new(attr::SYSTEM, SYSTEM),
                        KeyValue::new(attr::OPERATION_TYPE, "create"),
                        KeyValue::new(attr::OPERATION_NAME, "enqueue"),
                        KeyValue::new(attr::DESTINATION, topic.to_owned()),
                    ])
                    .start_with_context(&tracer, parent.as_ref().unwrap_or(caller))
            })
            .collect();
        Creating { spans }
    }

    /// The `traceparent` to store with event `i`: its span's, when that span is recorded.
    pub(crate) fn traceparent(&self, i: usize) -> Option<String> {
        let cx = self.spans.get(i)?.span_context();
        (cx.is_valid() && cx.is_sampled()).then(|| traceparent_of(cx))
    }

    /// Ends the spans with the events' ids (in input order), or with the error that refused the enqueue.
    pub(crate) fn end(mut self, ids: Result<&[i64], &dyn std::fmt::Display>) {
        for (i, span) in self.spans.iter_mut().enumerate() {
            match ids {
                Ok(ids) => {
                    if let Some(id) = ids.get(i) {
                        span.set_attribute(KeyValue::new(attr::MESSAGE_ID, id.to_string()));
                    }
                }
                Err(e) => span.set_status(Status::error(e.to_string())),
            }
        }
    }
}

/// What a link of the relay's or the consumer's span says about one event.
pub(crate) struct Linked<'a> {
    pub(crate) traceparent: Option<&'a str>,
    pub(crate) message_id: i64,
    pub(crate) subscriber: &'a str,
}

fn link_of(e: &Linked<'_>) -> Option<Link> {
    let cx = parse_traceparent(e.traceparent?)?;
    let mut attrs = vec![KeyValue::new(attr::MESSAGE_ID, e.message_id.to_string())];
    if !e.subscriber.is_empty() {
        attrs.push(KeyValue::new(attr::SUBSCRIPTION, e.subscriber.to_owned()));
    }
    Some(Link::new(cx, attrs, 0))
}

/// The relay's `send` span of one QStash request: a link to each event of each of its messages. `None` when
/// export is off.
pub(crate) fn send<'a>(
    topic: Option<&str>,
    messages: usize,
    events: impl Iterator<Item = Linked<'a>>,
) -> Option<MessagingSpan> {
    if !enabled() {
        return None;
    }
    let links: Vec<Link> = events.filter_map(|e| link_of(&e)).collect();
    let tracer = global::tracer(SCOPE);
    let mut attrs = vec![
        KeyValue::new(attr::SYSTEM, SYSTEM),
        KeyValue::new(attr::OPERATION_TYPE, "send"),
        KeyValue::new(attr::OPERATION_NAME, "publish"),
        KeyValue::new(attr::BATCH_COUNT, messages as i64),
    ];
    if let Some(t) = topic {
        attrs.push(KeyValue::new(attr::DESTINATION, t.to_owned()));
    }
    let name = topic.map_or_else(|| "send".to_owned(), |t| format!("send {t}"));
    Some(
        tracer
            .span_builder(name)
            .with_kind(SpanKind::Client)
            .with_attributes(attrs)
            .with_links(links)
            .start_with_context(&tracer, &Context::new()),
    )
}

/// One event of a delivery, as the consumer's span sees it.
pub(crate) struct Delivered<'a> {
    pub(crate) event: Linked<'a>,
    /// QStash's retry count (`Upstash-Retried`).
    pub(crate) retried: u32,
    /// Sent again on purpose (a redrive, a republish, a replay): the envelope's `resent`.
    pub(crate) resent: bool,
}

/// The consumer's `process` span of one delivery: for one event on its first delivery, a child of the
/// producer's span; otherwise (a retry, a copy sent again, a batch) a root linking each event. Returns the context
/// holding it (the parent of what the handlers trace; end it with [`end`]); `None` when export is off.
pub(crate) fn process(
    topic: &str,
    subscriber: &str,
    qstash_message_id: Option<&str>,
    events: &[Delivered<'_>],
) -> Option<Context> {
    if !enabled() || events.is_empty() {
        return None;
    }
    let first = &events[0];
    let parent = match events {
        [one] if one.retried == 0 && !one.resent => one
            .event
            .traceparent
            .and_then(parse_traceparent)
            .map(|sc| Context::new().with_remote_span_context(sc)),
        _ => None,
    };
    let links: Vec<Link> = if parent.is_some() {
        Vec::new()
    } else {
        events.iter().filter_map(|e| link_of(&e.event)).collect()
    };
    let mut attrs = vec![
        KeyValue::new(attr::SYSTEM, SYSTEM),
        KeyValue::new(attr::OPERATION_TYPE, "process"),
        KeyValue::new(attr::OPERATION_NAME, "process"),
        KeyValue::new(attr::DESTINATION, topic.to_owned()),
        KeyValue::new(attr::SUBSCRIPTION, subscriber.to_owned()),
        KeyValue::new(attr::DELIVERY_ATTEMPT, i64::from(first.retried) + 1),
    ];
    if events.len() > 1 {
        attrs.push(KeyValue::new(attr::BATCH_COUNT, events.len() as i64));
    } else {
        attrs.push(KeyValue::new(
            attr::MESSAGE_ID,
            first.event.message_id.to_string(),
        ));
    }
    if let Some(id) = qstash_message_id {
        attrs.push(KeyValue::new(attr::QSTASH_MESSAGE_ID, id.to_owned()));
    }
    let tracer = global::tracer(SCOPE);
    let span = tracer
        .span_builder(format!("process {topic}"))
        .with_kind(SpanKind::Consumer)
        .with_attributes(attrs)
        .with_links(links)
        .start_with_context(&tracer, parent.as_ref().unwrap_or(&Context::new()));
    Some(Context::new().with_span(span))
}

/// Ends the span of `cx` ([`process`]'s), failed with `error` if there is one.
pub(crate) fn end(cx: &Context, error: Option<String>) {
    let span = cx.span();
    if let Some(why) = error {
        span.set_status(Status::error(why));
    }
    span.end();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_round_trips_and_refuses_junk() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = parse_traceparent(tp).unwrap();
        assert!(cx.is_remote() && cx.is_sampled());
        assert_eq!(traceparent_of(&cx), tp);
        for bad in [
            "",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e47-00f067aa0ba902b7-01",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad}");
        }
    }
}
