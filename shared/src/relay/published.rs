//! What step 2 ([`super::publish`]) answers: one [`PublishedEvent`] per claimed event, gathered in a
//! [`Published`], and what a `/v2/batch` request got back ([`Sent`]).

use std::time::Duration;

use crate::qstash::PublishOutcome;

use super::forming::Formed;

/// What became of one claimed event in [`Relay::publish_classified`].
#[derive(Debug, Clone, PartialEq)]
pub struct PublishedEvent {
    /// QStash's verdict on the event's message; for an event not sent, a transient "waits behind its key's
    /// message".
    pub outcome: PublishOutcome,
    /// Whether `outcome` is about the event.
    pub reach: Reach,
}

/// How far an event's publish got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// QStash answered the request that carried the event's message: the outcome is about the message.
    Answered,
    /// That request failed at request level: the outcome says nothing about the event, which is given back.
    RequestFailed,
    /// Claimed but in no message this cycle (an ordered key's events that did not fit its message): given back.
    NotSent,
}

impl PublishedEvent {
    /// The outcome says nothing about the event: it goes back, its attempt unspent.
    pub fn given_back(&self) -> bool {
        self.reach != Reach::Answered
    }
}

/// What [`Relay::publish_classified`] found.
#[derive(Debug, Clone, Default)]
pub struct Published {
    /// One result per event, in claim order.
    pub events: Vec<PublishedEvent>,
    /// Requests answered.
    pub requests_ok: u64,
    /// Requests failed at request level.
    pub requests_failed: u64,
    /// Duration of each `/v2/batch` request.
    pub latencies: Vec<Duration>,
    /// The events (indexes) of each message published, in message order.
    pub messages: Vec<Vec<usize>>,
}

/// QStash's answer about one message.
#[derive(Debug, Clone)]
pub(super) struct MessageResult {
    pub(super) outcome: PublishOutcome,
    /// Its request failed at request level.
    pub(super) request_level: bool,
}

/// What [`Relay::send`] got back: one result per message, in order.
#[derive(Debug, Default)]
pub(super) struct Sent {
    pub(super) results: Vec<MessageResult>,
    pub(super) requests_ok: u64,
    pub(super) requests_failed: u64,
    pub(super) latencies: Vec<Duration>,
}

impl Sent {
    pub(super) fn absorb(&mut self, other: Sent) {
        self.results.extend(other.results);
        self.requests_ok += other.requests_ok;
        self.requests_failed += other.requests_failed;
        self.latencies.extend(other.latencies);
    }
}

impl Published {
    /// Every request failed at request level (and there was at least one): an outage.
    pub fn is_outage(&self) -> bool {
        self.requests_failed > 0 && self.requests_ok == 0
    }

    /// The first request-level error, for the outage record.
    pub fn first_request_error(&self) -> Option<String> {
        self.events
            .iter()
            .find(|e| e.reach == Reach::RequestFailed)
            .map(|e| match &e.outcome {
                PublishOutcome::Transient { error, .. } => error.clone(),
                other => format!("{other:?}"),
            })
    }

    /// The outcome of each event, in claim order (what [`Relay::decide`] takes).
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // `internals::RelaySteps`
    pub fn outcomes(&self) -> Vec<PublishOutcome> {
        self.events.iter().map(|e| e.outcome.clone()).collect()
    }

    /// Per event: the result of the message that carried it, or [`Reach::NotSent`].
    pub(super) fn assemble(n_events: usize, formed: &Formed, sent: Sent) -> Published {
        let not_sent = PublishedEvent {
            outcome: PublishOutcome::Transient {
                status: None,
                retry_after: None,
                error: "not published this cycle: it waits behind its key's message".into(),
                config_problem: false,
            },
            reach: Reach::NotSent,
        };
        let mut events = vec![not_sent; n_events];
        let mut messages: Vec<Vec<usize>> = Vec::with_capacity(formed.messages.len());
        for (out, result) in formed.messages.iter().zip(&sent.results) {
            if out.events.is_empty() {
                continue;
            }
            for &i in &out.events {
                events[i] = PublishedEvent {
                    outcome: result.outcome.clone(),
                    reach: if result.request_level {
                        Reach::RequestFailed
                    } else {
                        Reach::Answered
                    },
                };
            }
            messages.push(out.events.clone());
        }
        Published {
            events,
            requests_ok: sent.requests_ok,
            requests_failed: sent.requests_failed,
            latencies: sent.latencies,
            messages,
        }
    }
}
