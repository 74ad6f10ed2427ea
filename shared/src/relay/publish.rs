//! Step 2 of a cycle: the formed messages ([`super::forming`]) go to QStash through `/v2/batch` requests of
//! `QSTASH_BATCH_SIZE` messages, run concurrently, outside any transaction. The answer is one
//! [`PublishedEvent`] per claimed event.
//!
//! Two kinds of failure say nothing about the events, and are not held against them:
//!
//! - a request that failed at request level ([`request_level_failure`]: QStash down, unreachable, refusing the
//!   token or URL, rate-limiting the account): its events are given back with their attempt unspent, and when
//!   every request failed so the cycle is an outage ([`Published::is_outage`], decision record 0012);
//! - a permanent refusal of more than the culprit: a whole multi-message request refused alike (e.g. 413, the
//!   request is too large) is asked again one message per request, and a refused message of several events is
//!   published again one event per message in the same cycle (an ordered run: its head alone, the rest waits),
//!   so only the culprits become dead letters.

use std::time::{Duration, Instant};

use crate::qstash::{Message, PublishOutcome, request_level_failure};

use crate::telemetry::spans::{self, Linked, MessagingSpan};

use super::claim::ClaimedEvent;
use super::cycle::Relay;
use super::forming::{Formed, Outgoing};
use super::published::{MessageResult, Published, Sent};

impl Relay {
    /// Step 2: publishes events through `/v2/batch` (requests of `QSTASH_BATCH_SIZE` messages run
    /// concurrently). Returns one outcome per event, in order, and the latency of each request.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // `internals::RelaySteps`
    pub(crate) async fn publish(
        &self,
        events: &[ClaimedEvent],
    ) -> (Vec<PublishOutcome>, Vec<Duration>) {
        let p = self.publish_classified(events).await;
        (p.outcomes(), p.latencies)
    }

    /// [`Relay::publish`], also telling which events' requests failed at request level or were not sent, how
    /// many requests were answered or failed that way (the outage decision), and which events went out
    /// together.
    ///
    /// A message of several events that QStash refuses permanently is not the events' verdict: its events are
    /// published again one per message in the same cycle (an ordered run: its head alone, the rest waits) and
    /// each event gets its own outcome.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // `internals::RelaySteps`
    pub(crate) async fn publish_classified(&self, events: &[ClaimedEvent]) -> Published {
        let formed = self.messages_for(events);
        let sent = self.send(events, &formed.messages).await;
        self.with_single_fallback(events, formed, sent).await.1
    }

    /// After `sent`, QStash's answer about `formed`'s messages: sends each permanently refused message of several
    /// events again one event per message ([`Relay::refused_singly`]), then each event's result. Returns the
    /// messages as finally sent (the singles added) and the per-event results.
    pub(super) async fn with_single_fallback(
        &self,
        events: &[ClaimedEvent],
        mut formed: Formed,
        mut sent: Sent,
    ) -> (Formed, Published) {
        let singles = self.refused_singly(events, &mut formed, &sent);
        if !singles.is_empty() {
            sent.absorb(self.send(events, &singles).await);
            formed.messages.extend(singles);
        }
        let published = Published::assemble(events.len(), &formed, sent);
        (formed, published)
    }

    /// Permanent refusals of multi-event messages: the messages to send instead, one event each. The refused
    /// message keeps its place with no events (its results stay in line with `formed`); an ordered run's
    /// followers are left over.
    fn refused_singly(
        &self,
        events: &[ClaimedEvent],
        formed: &mut Formed,
        sent: &Sent,
    ) -> Vec<Outgoing> {
        let mut singles: Vec<usize> = Vec::new();
        for (out, result) in formed.messages.iter_mut().zip(&sent.results) {
            let PublishOutcome::Permanent { status, error } = &result.outcome else {
                continue;
            };
            if out.events.len() < 2 || result.request_level {
                continue;
            }
            let members = std::mem::take(&mut out.events);
            tracing::warn!(events = members.len(), status, error = %error,
                "QStash refused a message of several events: publishing them one by one");
            if events[members[0]].seq.is_some() {
                singles.push(members[0]);
                formed.left_over.extend_from_slice(&members[1..]);
            } else {
                singles.extend(members);
            }
        }
        let forming = self.forming();
        singles
            .iter()
            .map(|&i| forming.outgoing(events, vec![i]))
            .collect()
    }

    /// Sends messages through `/v2/batch` requests of `QSTASH_BATCH_SIZE`: one result per message.
    async fn send(&self, events: &[ClaimedEvent], messages: &[Outgoing]) -> Sent {
        let chunk = self.qstash.batch_size.max(1) as usize;
        let requests = messages.chunks(chunk).map(|c| self.send_request(events, c));
        let mut sent = Sent::default();
        for one in futures::future::join_all(requests).await {
            sent.absorb(one);
        }
        sent
    }

    /// One `/v2/batch` request. A permanent refusal of a whole multi-message request (e.g. 413: the batch is
    /// too large) says nothing about each message: they are asked again one by one so only the culprits are
    /// dead-lettered. Traced as one messaging `send` span linking the events it carries (when export is on).
    pub(super) async fn send_request(&self, events: &[ClaimedEvent], out: &[Outgoing]) -> Sent {
        let mut span = send_span(events, out);
        let messages: Vec<Message> = out.iter().map(|o| o.message.clone()).collect();
        let sent = self.send_messages(&messages).await;
        if let Some(span) = span.as_mut()
            && sent.requests_failed > 0
        {
            use opentelemetry::trace::Span as _;
            span.set_status(opentelemetry::trace::Status::error("QStash request failed"));
        }
        sent
    }

    async fn send_messages(&self, c: &[Message]) -> Sent {
        let t = Instant::now();
        let resp = self.client.batch_classified(c).await;
        let out = resp.outcomes;
        if c.len() > 1
            && out
                .first()
                .is_some_and(|o| matches!(o, PublishOutcome::Permanent { .. }))
            && all_equal(&out)
        {
            let out: Vec<PublishOutcome> =
                futures::future::join_all(c.iter().map(|m| self.client.publish(m))).await;
            // Each single publish is a request of its own: its failure is request-level or the message's.
            let results: Vec<MessageResult> = out
                .into_iter()
                .map(|outcome| MessageResult {
                    request_level: request_level_failure(&outcome),
                    outcome,
                })
                .collect();
            let failed = results.iter().filter(|r| r.request_level).count() as u64;
            return Sent {
                results,
                requests_ok: (c.len() as u64).saturating_sub(failed),
                requests_failed: failed,
                latencies: vec![t.elapsed()],
            };
        }
        let failed = u64::from(resp.request_failed);
        Sent {
            results: out
                .into_iter()
                .map(|outcome| MessageResult {
                    outcome,
                    request_level: resp.request_failed,
                })
                .collect(),
            requests_ok: 1 - failed,
            requests_failed: failed,
            latencies: vec![t.elapsed()],
        }
    }
}

/// The `send` span of a request of `out` ([`crate::telemetry::spans::send`]): named after the topic when all of its
/// messages share one.
fn send_span(events: &[ClaimedEvent], out: &[Outgoing]) -> Option<MessagingSpan> {
    if !spans::enabled() {
        return None;
    }
    let carried = || {
        out.iter()
            .flat_map(|o| o.events.iter().map(|&i| &events[i]))
    };
    let topic = carried().next().map(|e| e.topic.as_str());
    let one_topic = topic.filter(|t| carried().all(|e| e.topic.as_str() == *t));
    spans::send(
        one_topic,
        out.len(),
        carried().map(|e| Linked {
            traceparent: e.headers.traceparent.as_deref(),
            message_id: e.event_id.get(),
            subscriber: &e.subscriber,
        }),
    )
}

fn all_equal(v: &[PublishOutcome]) -> bool {
    v.windows(2).all(|w| w[0] == w[1])
}
