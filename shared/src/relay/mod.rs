//! Guarantee 1 in transit — **no event is lost between the outbox and QStash** — and the relay side of
//! per-key order.
//!
//! One cycle is three short steps, never a lock held across the network (publishing inside the claim's
//! transaction would keep row locks and an old snapshot open for a network round trip, and leave the transaction
//! idle when the Lambda times out):
//!
//! 1. **Claim** ([`claim`]) in one committed statement per kind of topic: due rows (unordered) or key heads
//!    (ordered, see [`crate::ordering`]) get a lease with a fencing token, and their attempt is counted.
//! 2. **Publish** outside any transaction, through `/v2/batch`. Claimed events are formed into messages
//!    ([`Relay::messages_for`], decision record 0014): up to `RELAY_DELIVERY_BATCH` events per message (per topic:
//!    `RELAY_DELIVERY_BATCH_TOPICS`) under `QSTASH_MAX_MESSAGE_BYTES` — an ordered key's claimed run in sequence
//!    order, or an unordered topic's events in id order; with the default of 1, one event per message as
//!    always. Each message carries its events' identity in the signed envelope ([`crate::contract`]), a
//!    deduplication id derived from its composition (`outbox-<id>` for one event), flow control (per key;
//!    per topic for an unordered message of several events), retries and the failure callback from config;
//!    ordered messages also carry the delivery callback that frees their key. A permanent refusal of a message
//!    of several events is retried one event per message in the same cycle.
//! 3. **Settle** ([`settle`]) in one statement, fenced on the lease token: every event of a message gets the
//!    message's outcome — dispatched, retry with full-jitter backoff ([`backoff`]), or dead letter (an ordered
//!    run's followers go back to pending behind their dead head). A relay whose lease was taken over changes
//!    nothing.
//!
//! Nothing is lost when a relay dies anywhere in between: an unsettled lease simply expires and the row is
//! claimed again; a publish whose response was lost is retried with the same deduplication id (QStash returns
//! the first message id inside its 10-minute window; after it, the consumer's dedupe absorbs the duplicate).
//! [`Relay::drain`] repeats cycles until the invocation's deadline; the retry budget ends in `dead_letters`.
//!
//! A cycle whose every publish request failed at request level (QStash down, unreachable, refusing the token
//! or URL, rate-limiting the account) is an outage, not each event's failure: the claim is given back without
//! spending an attempt and the relays wait for a shared probe ([`outage`], decision record 0012).
//!
//! *Lease*, *fencing token* and *dead letter* are defined in the repository's `docs/glossary.md`.

pub mod backoff;
pub mod claim;
mod drain;
pub mod handler;
pub mod housekeeping;
pub mod outage;
pub mod settle;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::db::Db;

use crate::config::{DeadHeadPolicy, EvidenceMode, OutcomeSource, QstashConfig, RelayConfig};
use crate::contract;
use crate::qstash::{
    FlowControl, Message, PublishOptions, PublishOutcome, QstashClient, flow_control_key,
    request_level_failure,
};
use backoff::Backoff;
use claim::{ClaimStatements, ClaimedEvent};
use drain::StopSignal;
pub use drain::{DrainSummary, StopHandle};
use settle::{SettleCounts, SettleItem, Settlement};

/// A relay failure that ends an invocation.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// A database statement failed.
    #[error("database error during {step}")]
    Database {
        /// Which step.
        step: &'static str,
        #[source]
        source: sqlx::Error,
    },
    /// The invocation cannot hold one lease plus the deadline margin, so it would claim nothing: refused rather
    /// than reported as an empty success ([`RelayConfig::check_invocation_budget`]).
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
}

fn db(step: &'static str) -> impl FnOnce(sqlx::Error) -> RelayError {
    move |source| RelayError::Database { step, source }
}

/// What one cycle did.
#[derive(Debug, Clone, Default)]
pub struct CycleReport {
    pub claimed: u64,
    /// Rows changed by the settle.
    pub settled: SettleCounts,
    /// Claimed rows the settle did not change: another relay took the lease over (fencing).
    pub fenced: u64,
    /// A claim came back full: more is probably waiting.
    pub full: bool,
    /// Duration of each `/v2/batch` request.
    pub publish_latencies: Vec<Duration>,
    /// Transient publish failures caused by configuration (token, base URL).
    pub config_problems: u64,
    /// Publish requests QStash answered (any 2xx, or a verdict on the message).
    pub requests_ok: u64,
    /// Publish requests that failed at request level ([`request_level_failure`]).
    pub requests_failed: u64,
    /// Every publish request failed at request level: QStash is out, the claim was released and the outage
    /// recorded; the drain stops publishing.
    pub outage: bool,
}

/// What [`Relay::publish_classified`] found.
#[derive(Debug, Clone, Default)]
pub struct Published {
    /// One outcome per event, in order.
    pub outcomes: Vec<PublishOutcome>,
    /// Per event: its request failed at request level, so the outcome says nothing about the event.
    pub request_level: Vec<bool>,
    /// Requests answered.
    pub requests_ok: u64,
    /// Requests failed at request level.
    pub requests_failed: u64,
    /// Duration of each `/v2/batch` request.
    pub latencies: Vec<Duration>,
    /// The events (indexes) of each message published, in message order.
    pub messages: Vec<Vec<usize>>,
    /// Per event: claimed but not published this cycle (an ordered key's events that did not fit its message);
    /// the relay gives them back.
    pub unsent: Vec<bool>,
}

/// Messages formed from a claim ([`Relay::messages_for`]).
#[derive(Debug, Clone, Default)]
pub struct Formed {
    /// The messages, each with the indexes of the events it carries.
    pub messages: Vec<Outgoing>,
    /// Claimed ordered events that are in no message this cycle.
    pub left_over: Vec<usize>,
}

/// One message and the events (indexes into the claim) it carries.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// The QStash message.
    pub message: Message,
    /// Indexes of its events, in envelope order.
    pub events: Vec<usize>,
}

/// How claimed events are grouped into messages: (ordered, topic, key or "", lease token or 0).
type GroupKey<'a> = (bool, &'a str, &'a str, i64);

#[derive(Debug, Default)]
struct Sent {
    outcomes: Vec<PublishOutcome>,
    request_level: Vec<bool>,
    requests_ok: u64,
    requests_failed: u64,
    latencies: Vec<Duration>,
}

fn wire_event<'a>(
    ev: &'a ClaimedEvent,
    headers: &'a [(&'a str, &'a str)],
) -> contract::WireEvent<'a> {
    contract::WireEvent {
        id: ev.id,
        key: &ev.partition_key,
        seq: ev.seq,
        created_at: ev.created_at,
        schema_version: ev.headers.schema_version,
        headers,
        payload: &ev.payload,
    }
}

impl Published {
    /// Every request failed at request level (and there was at least one): an outage.
    pub fn is_outage(&self) -> bool {
        self.requests_failed > 0 && self.requests_ok == 0
    }

    /// The first request-level error, for the outage record.
    pub fn first_request_error(&self) -> Option<String> {
        self.outcomes
            .iter()
            .zip(&self.request_level)
            .zip(&self.unsent)
            .filter(|(_, unsent)| !**unsent)
            .map(|(pair, _)| pair)
            .find(|(_, rl)| **rl)
            .map(|(o, _)| match o {
                PublishOutcome::Transient { error, .. } => error.clone(),
                other => format!("{other:?}"),
            })
    }
}

/// The relay: database handle, QStash client and settings, built once per process (cold start) and reused.
pub struct Relay {
    stop: Arc<StopSignal>,
    db: Db,
    client: QstashClient,
    cfg: RelayConfig,
    qstash: QstashConfig,
    claims: ClaimStatements,
    probe_claims: ClaimStatements,
    backoff: Backoff,
    probe_backoff: outage::ProbeBackoff,
    /// This process has seen an outage recorded that it has not seen cleared: a successful cycle clears the row
    /// (without the hint, successful cycles skip that statement).
    outage_hint: AtomicBool,
}

impl Relay {
    /// Builds a relay.
    pub fn new(db: Db, client: QstashClient, cfg: RelayConfig, qstash: QstashConfig) -> Self {
        let statements = db.statements();
        Relay {
            stop: Arc::new(StopSignal::default()),
            claims: ClaimStatements::new(cfg.batch_size, statements)
                .with_delivery_batching(&cfg.batching),
            probe_claims: ClaimStatements::new(1, statements).with_delivery_batching(&cfg.batching),
            backoff: Backoff {
                base: cfg.backoff_base,
                cap: cfg.backoff_cap,
            },
            probe_backoff: outage::ProbeBackoff {
                base: cfg.outage_probe_base,
                cap: cfg.outage_probe_cap,
            },
            outage_hint: AtomicBool::new(false),
            db,
            client,
            cfg,
            qstash,
        }
    }

    /// A handle that asks running drains to stop after their current cycle (every claim is still settled).
    /// Used by the local pipeline's Ctrl-C; Lambda invocations simply end at their deadline.
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle(self.stop.clone())
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        self.db.pool()
    }

    /// The database handle.
    pub fn db(&self) -> &Db {
        &self.db
    }

    /// The relay settings.
    pub fn config(&self) -> &RelayConfig {
        &self.cfg
    }

    /// One accounting pass ([`crate::accounting::run`]): marks in-flight events their dedupe rows show applied,
    /// then looks events in flight past the horizon up at QStash with this relay's client, within `budget`.
    pub async fn account(
        &self,
        budget: Duration,
    ) -> Result<crate::accounting::AccountingReport, RelayError> {
        let policy = |topic: &str| self.cfg.dead_head_policy(topic);
        let rec = crate::accounting::Reconciler {
            db: &self.db,
            client: &self.client,
            cfg: &self.cfg.accounting,
            processed_ttl: self.cfg.processed_ttl,
            policy: &policy,
        };
        crate::accounting::run(&rec, budget)
            .await
            .map_err(db("accounting"))
    }

    /// The claim statements (for plan inspection in tests and benchmarks).
    pub fn claim_statements(&self) -> &ClaimStatements {
        &self.claims
    }

    /// Step 1: claims unordered events and ordered key heads (each up to the batch size).
    pub async fn claim(&self) -> Result<Vec<ClaimedEvent>, RelayError> {
        self.claim_with(&self.claims).await
    }

    async fn claim_with(&self, claims: &ClaimStatements) -> Result<Vec<ClaimedEvent>, RelayError> {
        let mut conn = self.pool().acquire().await.map_err(db("acquire"))?;
        let lease = self.cfg.lease.as_secs_f64();
        let mut events = claims
            .claim_unordered(&mut conn, lease)
            .await
            .map_err(db("claim"))?;
        let ordered = claims
            .claim_ordered(&mut conn, lease)
            .await
            .map_err(db("claim ordered keys"))?;
        events.extend(ordered);
        Ok(events)
    }

    /// The QStash message for one claimed event (a message of one event; [`Relay::messages_for`] forms the
    /// messages of a claim).
    pub fn message_for(&self, ev: &ClaimedEvent) -> Message {
        self.message_of(&[ev])
    }

    /// The QStash message carrying `events` (the relay half of [`crate::contract`]; decision record 0014): all
    /// of one topic, and for an ordered topic consecutive events of one key in sequence order. Everything that
    /// decides a write is in the signed envelope body and the signed destination URL; `x-outbox-id` (the ids,
    /// comma-joined) and `traceparent` (the first event's) are informational header copies. The application's
    /// own headers travel in the envelope only (decision record 0026).
    fn message_of(&self, events: &[&ClaimedEvent]) -> Message {
        let first = events[0];
        let header_lists: Vec<Vec<(&str, &str)>> = events
            .iter()
            .map(|ev| {
                let mut headers: Vec<(&str, &str)> = Vec::with_capacity(2 + ev.headers.user.len());
                if let Some(tp) = &ev.headers.traceparent {
                    headers.push((contract::TRACEPARENT, tp));
                }
                if let Some(c) = &ev.headers.correlation_id {
                    headers.push((contract::CORRELATION_ID, c));
                }
                // The producer refused reserved names; a row written by hand could still hold one, and it must
                // not shadow the pipeline's own entries in the envelope.
                headers.extend(
                    ev.headers
                        .user
                        .iter()
                        .filter(|(name, _)| !crate::headers::is_reserved(name))
                        .map(|(n, v)| (n.as_str(), v.as_str())),
                );
                headers
            })
            .collect();
        let cb = &self.qstash.callback_url;
        let ordered = first.seq.is_some();
        let evidence = self.evidence_for(ordered);
        let by_consumer = evidence == Some(contract::Evidence::Consumer);
        let wire: Vec<contract::WireEvent<'_>> = events
            .iter()
            .zip(&header_lists)
            .map(|(ev, headers)| wire_event(ev, headers))
            .collect();
        let body = contract::write_envelope(&first.topic, evidence, &wire);
        let ids: Vec<i64> = events.iter().map(|e| e.id).collect();
        let mut forward: Vec<(crate::qstash::HeaderName, String)> = Vec::with_capacity(2);
        forward.push((contract::OUTBOX_ID.into(), contract::outbox_id_header(&ids)));
        if let Some(tp) = &first.headers.traceparent {
            forward.push((contract::TRACEPARENT.into(), tp.clone()));
        }
        // Delivery callbacks: an ordered key's evidence unless the consumer records it; an unordered event's outcome
        // when its dedupe row cannot be read here (decision record 0015).
        let callback = if ordered {
            !by_consumer
        } else {
            self.cfg.unordered_outcome() == OutcomeSource::Callback
        };
        let dedup: Vec<(i64, i32)> = events.iter().map(|e| (e.id, e.dedup_generation)).collect();
        // Ordered messages keep their key's flow-control key; an unordered message of several events (any keys)
        // uses its topic's.
        let flow_key = if ordered || events.len() == 1 {
            flow_control_key(&format!("{}.{}", first.topic, first.partition_key))
        } else {
            flow_control_key(&first.topic)
        };
        Message {
            destination: contract::destination(&self.qstash.consumer_url, &first.topic),
            body,
            options: PublishOptions {
                content_type: Some("application/json".into()),
                deduplication_id: Some(contract::batch_dedup_id(&dedup)),
                retries: Some(self.qstash.retries),
                timeout: self.qstash.delivery_timeout,
                failure_callback: Some(format!("{cb}{}", contract::FAILURE_PATH)),
                callback: callback.then(|| format!("{cb}{}", contract::DELIVERED_PATH)),
                forward,
                flow_control: Some(FlowControl {
                    key: flow_key,
                    parallelism: Some(self.qstash.flow_parallelism),
                    rate: self.qstash.flow_rate,
                    period: self.qstash.flow_rate.map(|_| self.qstash.flow_period),
                }),
                label: Some(first.topic.clone()),
                ..Default::default()
            },
        }
    }

    fn evidence_for(&self, ordered: bool) -> Option<contract::Evidence> {
        ordered.then_some(if self.cfg.ordered_evidence == EvidenceMode::Consumer {
            contract::Evidence::Consumer
        } else {
            contract::Evidence::Callback
        })
    }

    /// Groups claimed events into QStash messages (decision record 0014), each with the indexes (into `events`)
    /// of the events it carries:
    ///
    /// - an ordered key's claimed run (its head and the consecutive events behind it) is one message, up to its
    ///   topic's `RELAY_DELIVERY_BATCH` events and under `QSTASH_MAX_MESSAGE_BYTES`;
    /// - unordered events are grouped by topic in ascending id into messages of up to the topic's
    ///   `RELAY_DELIVERY_BATCH`, each under `QSTASH_MAX_MESSAGE_BYTES`;
    /// - an event larger than the limit on its own still goes alone (QStash's verdict decides).
    ///
    /// An ordered key's events that do not fit its one message (size limit, a gap) are in
    /// [`Formed::left_over`]: a key never has two messages in flight, so they wait for the next claim.
    pub fn messages_for(&self, events: &[ClaimedEvent]) -> Formed {
        let batching = &self.cfg.batching;
        let mut formed = Formed::default();
        if !batching.any_batching() {
            formed.messages = events
                .iter()
                .enumerate()
                .map(|(i, e)| Outgoing {
                    message: self.message_for(e),
                    events: vec![i],
                })
                .collect();
            return formed;
        }
        // Ordered: one group per key lease, in sequence order. Unordered: one group per topic, in id order.
        let mut groups: Vec<(GroupKey<'_>, Vec<usize>)> = Vec::new();
        let mut index: std::collections::HashMap<GroupKey<'_>, usize> =
            std::collections::HashMap::new();
        for (i, e) in events.iter().enumerate() {
            let g = match e.seq {
                Some(_) => (
                    true,
                    e.topic.as_str(),
                    e.partition_key.as_str(),
                    e.lease_token,
                ),
                None => (false, e.topic.as_str(), "", 0),
            };
            let at = *index.entry(g).or_insert_with(|| {
                groups.push((g, Vec::new()));
                groups.len() - 1
            });
            groups[at].1.push(i);
        }
        for ((ordered, topic, _, _), mut members) in groups {
            let n = batching.n_for(topic).max(1) as usize;
            if ordered {
                members.sort_by_key(|&i| events[i].seq);
            } else {
                members.sort_by_key(|&i| events[i].id);
            }
            let overhead = contract::write_envelope(topic, self.evidence_for(ordered), &[]).len();
            let mut current: Vec<usize> = Vec::new();
            let mut size = overhead;
            let mut closed_key = false;
            for i in members {
                if closed_key {
                    formed.left_over.push(i);
                    continue;
                }
                let ev = &events[i];
                let event_size = self.event_size(ev, overhead);
                let contiguous = !ordered
                    || current
                        .last()
                        .is_none_or(|&p| events[p].seq.map(|s| s + 1) == ev.seq);
                let fits = current.is_empty()
                    || (current.len() < n
                        && size + 1 + event_size <= batching.max_message_bytes.saturating_sub(1));
                if fits && contiguous {
                    size += event_size + usize::from(!current.is_empty());
                    current.push(i);
                    continue;
                }
                if ordered {
                    // One message per key at a time: the rest waits for the key's next claim.
                    closed_key = true;
                    formed.left_over.push(i);
                    continue;
                }
                formed
                    .messages
                    .push(self.outgoing(events, std::mem::take(&mut current)));
                size = overhead + event_size;
                current.push(i);
            }
            if !current.is_empty() {
                formed.messages.push(self.outgoing(events, current));
            }
        }
        formed
    }

    /// The bytes one event adds to an envelope (its envelope alone minus the empty envelope).
    fn event_size(&self, ev: &ClaimedEvent, overhead: usize) -> usize {
        let headers: Vec<(&str, &str)> = ev
            .headers
            .traceparent
            .iter()
            .map(|t| (contract::TRACEPARENT, t.as_str()))
            .chain(
                ev.headers
                    .correlation_id
                    .iter()
                    .map(|c| (contract::CORRELATION_ID, c.as_str())),
            )
            .chain(
                ev.headers
                    .user
                    .iter()
                    .filter(|(name, _)| !crate::headers::is_reserved(name))
                    .map(|(n, v)| (n.as_str(), v.as_str())),
            )
            .collect();
        let one = contract::write_envelope(
            &ev.topic,
            self.evidence_for(ev.seq.is_some()),
            &[wire_event(ev, &headers)],
        );
        one.len().saturating_sub(overhead)
    }

    fn outgoing(&self, events: &[ClaimedEvent], members: Vec<usize>) -> Outgoing {
        let refs: Vec<&ClaimedEvent> = members.iter().map(|&i| &events[i]).collect();
        Outgoing {
            message: self.message_of(&refs),
            events: members,
        }
    }

    /// Step 2: publishes events through `/v2/batch` (requests of `QSTASH_BATCH_SIZE` messages run
    /// concurrently). Returns one outcome per event, in order, and the latency of each request.
    pub async fn publish(&self, events: &[ClaimedEvent]) -> (Vec<PublishOutcome>, Vec<Duration>) {
        let p = self.publish_classified(events).await;
        (p.outcomes, p.latencies)
    }

    /// Sends messages through `/v2/batch` requests of `QSTASH_BATCH_SIZE`: one outcome and request-level flag
    /// per message.
    async fn send(&self, messages: &[Message]) -> Sent {
        let chunk = self.qstash.batch_size.max(1) as usize;
        let requests = messages.chunks(chunk).map(|c| async move {
            let t = Instant::now();
            let resp = self.client.batch_classified(c).await;
            let out = resp.outcomes;
            // A permanent refusal of a whole multi-message request (e.g. 413: the batch is too large) says nothing
            // about each message: ask again one by one so only the culprits are dead-lettered.
            if c.len() > 1
                && out
                    .first()
                    .is_some_and(|o| matches!(o, PublishOutcome::Permanent { .. }))
                && all_equal(&out)
            {
                let out: Vec<PublishOutcome> =
                    futures::future::join_all(c.iter().map(|m| self.client.publish(m))).await;
                // Each single publish is a request of its own: its failure is request-level or the message's.
                let rl: Vec<bool> = out.iter().map(request_level_failure).collect();
                let failed = rl.iter().filter(|r| **r).count() as u64;
                return (out, rl, rl_len_ok(c.len(), failed), failed, t.elapsed());
            }
            let failed = u64::from(resp.request_failed);
            let rl = vec![resp.request_failed; out.len()];
            (out, rl, 1 - failed, failed, t.elapsed())
        });
        let results = futures::future::join_all(requests).await;
        let mut sent = Sent::default();
        for (o, rl, ok, failed, l) in results {
            sent.requests_ok += ok;
            sent.requests_failed += failed;
            sent.outcomes.extend(o);
            sent.request_level.extend(rl);
            sent.latencies.push(l);
        }
        sent
    }

    /// [`Relay::publish`], also telling which events' requests failed at request level, how many requests were
    /// answered or failed that way (the outage decision), and which events went out together.
    ///
    /// A message of several events that QStash refuses permanently is not the events' verdict: its events are
    /// published again one per message in the same cycle (an ordered run: its head alone, the rest waits) and
    /// each event gets its own outcome.
    pub async fn publish_classified(&self, events: &[ClaimedEvent]) -> Published {
        let mut formed = self.messages_for(events);
        let messages: Vec<Message> = formed.messages.iter().map(|m| m.message.clone()).collect();
        let mut sent = self.send(&messages).await;
        // Permanent refusals of multi-event messages: again one event per message.
        let refused: Vec<usize> = (0..formed.messages.len())
            .filter(|&m| {
                formed.messages[m].events.len() > 1
                    && !sent.request_level[m]
                    && matches!(sent.outcomes[m], PublishOutcome::Permanent { .. })
            })
            .collect();
        if !refused.is_empty() {
            let mut singles: Vec<usize> = Vec::new();
            for &m in &refused {
                let members = std::mem::take(&mut formed.messages[m].events);
                let ordered = events[members[0]].seq.is_some();
                if let PublishOutcome::Permanent { status, error } = &sent.outcomes[m] {
                    tracing::warn!(events = members.len(), status, error = %error,
                        "QStash refused a message of several events: publishing them one by one");
                }
                if ordered {
                    singles.push(members[0]);
                    formed.left_over.extend_from_slice(&members[1..]);
                } else {
                    singles.extend(members);
                }
            }
            let single_msgs: Vec<Message> = singles
                .iter()
                .map(|&i| self.message_for(&events[i]))
                .collect();
            let again = self.send(&single_msgs).await;
            sent.requests_ok += again.requests_ok;
            sent.requests_failed += again.requests_failed;
            sent.latencies.extend(again.latencies);
            for (k, &i) in singles.iter().enumerate() {
                formed.messages.push(Outgoing {
                    message: single_msgs[k].clone(),
                    events: vec![i],
                });
                sent.outcomes.push(again.outcomes[k].clone());
                sent.request_level.push(again.request_level[k]);
            }
        }
        let mut outcomes: Vec<Option<PublishOutcome>> = vec![None; events.len()];
        let mut request_level = vec![false; events.len()];
        let mut message_of: Vec<Option<usize>> = vec![None; events.len()];
        let mut groups: Vec<Vec<usize>> = Vec::with_capacity(formed.messages.len());
        for (m, out) in formed.messages.iter().enumerate() {
            if out.events.is_empty() {
                continue;
            }
            for &i in &out.events {
                outcomes[i] = Some(sent.outcomes[m].clone());
                request_level[i] = sent.request_level[m];
                message_of[i] = Some(groups.len());
            }
            groups.push(out.events.clone());
        }
        let mut unsent = vec![false; events.len()];
        for &i in &formed.left_over {
            unsent[i] = true;
        }
        Published {
            outcomes: outcomes
                .into_iter()
                .map(|o| {
                    o.unwrap_or_else(|| PublishOutcome::Transient {
                        status: None,
                        retry_after: None,
                        error: "not published this cycle: it waits behind its key's message".into(),
                        config_problem: false,
                    })
                })
                .collect(),
            request_level,
            requests_ok: sent.requests_ok,
            requests_failed: sent.requests_failed,
            latencies: sent.latencies,
            messages: groups,
            unsent,
        }
    }

    /// Decides what to record for each event (pure: no I/O).
    pub fn decide(&self, events: &[ClaimedEvent], outcomes: &[PublishOutcome]) -> Vec<SettleItem> {
        let mut rng = rand::rng();
        let max = self.cfg.max_attempts as i32;
        events
            .iter()
            .zip(outcomes)
            .map(|(ev, outcome)| {
                let skip_key = self.cfg.dead_head_policy(&ev.topic) == DeadHeadPolicy::Skip;
                let settlement = match outcome {
                    PublishOutcome::Accepted { message_id, .. } => Settlement::Dispatched {
                        message_id: message_id.clone(),
                    },
                    PublishOutcome::Permanent { status, error } => Settlement::Dead {
                        error: format!("QStash refused the message (HTTP {status}): {error}"),
                        status: Some(*status),
                        skip_key,
                    },
                    PublishOutcome::Transient {
                        error,
                        retry_after,
                        status,
                        ..
                    } => {
                        if ev.attempts >= max {
                            Settlement::Dead {
                                error: format!(
                                    "retry budget of {max} attempts exhausted; last error: {error}"
                                ),
                                status: *status,
                                skip_key,
                            }
                        } else {
                            Settlement::Retry {
                                delay: self.backoff.next_delay(
                                    ev.attempts.max(0) as u32,
                                    *retry_after,
                                    &mut rng,
                                ),
                                error: format!("attempt {}: {error}", ev.attempts),
                            }
                        }
                    }
                };
                SettleItem {
                    id: ev.id,
                    lease_token: ev.lease_token,
                    settlement,
                }
            })
            .collect()
    }

    /// Step 3: settles in one fenced statement.
    pub async fn settle(&self, items: &[SettleItem]) -> Result<SettleCounts, RelayError> {
        let mut conn = self.pool().acquire().await.map_err(db("acquire"))?;
        settle::settle(
            &mut conn,
            items,
            self.cfg.evidence_timeout,
            self.db.statements(),
        )
        .await
        .map_err(db("settle"))
    }

    /// One full cycle: claim, publish, settle. Events whose budget was already used up by earlier claims (the
    /// relay died mid-attempt) are dead-lettered without another publish. Events whose publish request failed at
    /// request level are released without spending their attempt; when that was every request, the outage is
    /// recorded ([`CycleReport::outage`]). Does not look at a recorded outage: [`Relay::drain`] does.
    #[tracing::instrument(name = "relay.cycle", skip_all)]
    pub async fn run_cycle(&self) -> Result<CycleReport, RelayError> {
        self.run_cycle_with(&self.claims, false).await
    }

    /// One cycle with the probe's claim of one event per kind of topic; an outage counts as a failed probe.
    pub async fn run_probe_cycle(&self) -> Result<CycleReport, RelayError> {
        self.run_cycle_with(&self.probe_claims, true).await
    }

    async fn run_cycle_with(
        &self,
        claims: &ClaimStatements,
        probe: bool,
    ) -> Result<CycleReport, RelayError> {
        let events = self.claim_with(claims).await?;
        if events.is_empty() {
            return Ok(CycleReport::default());
        }
        let max = self.cfg.max_attempts as i32;
        // An ordered key's claimed run shares its head's fate: its budget is the head's (followers are only
        // along for the ride), and when the head's budget was already used up the followers go back untouched.
        let mut heads: std::collections::HashMap<(&str, &str, i64), i64> =
            std::collections::HashMap::new();
        for e in &events {
            if let Some(seq) = e.seq {
                let h = heads
                    .entry((e.topic.as_str(), e.partition_key.as_str(), e.lease_token))
                    .or_insert(seq);
                *h = (*h).min(seq);
            }
        }
        let head_of = |e: &ClaimedEvent| -> Option<i64> {
            e.seq.and_then(|_| {
                heads
                    .get(&(e.topic.as_str(), e.partition_key.as_str(), e.lease_token))
                    .copied()
            })
        };
        let mut exhausted: Vec<ClaimedEvent> = Vec::new();
        let mut held_back: Vec<ClaimedEvent> = Vec::new();
        let mut to_publish: Vec<ClaimedEvent> = Vec::new();
        let spent_heads: Vec<(&str, &str, i64)> = events
            .iter()
            .filter(|e| e.attempts > max && head_of(e) == e.seq)
            .filter(|e| e.seq.is_some())
            .map(|e| (e.topic.as_str(), e.partition_key.as_str(), e.lease_token))
            .collect();
        for e in &events {
            let is_head = e.seq.is_none() || head_of(e) == e.seq;
            if is_head && e.attempts > max {
                exhausted.push(e.clone());
            } else if !is_head
                && spent_heads.contains(&(
                    e.topic.as_str(),
                    e.partition_key.as_str(),
                    e.lease_token,
                ))
            {
                held_back.push(e.clone());
            } else {
                to_publish.push(e.clone());
            }
        }
        let published = self.publish_classified(&to_publish).await;
        let outcomes = &published.outcomes;
        let mut items = self.decide(&to_publish, outcomes);
        // Request-level failures say nothing about the events: give them back, attempt unspent. In a mixed cycle
        // (some requests answered) this is all that happens to them; when no request was answered it is an outage.
        // Claimed events that went out in no message (behind their key's message) are given back the same way.
        for ((item, rl), unsent) in items
            .iter_mut()
            .zip(&published.request_level)
            .zip(&published.unsent)
        {
            if *rl || *unsent {
                item.settlement = Settlement::Release;
            }
        }
        // An ordered run's followers get their message's outcome as decided for its head; a dead head is the
        // key's dead head (blocking or skipped per policy), its followers simply go back to pending.
        for members in &published.messages {
            if members.len() < 2 || to_publish[members[0]].seq.is_none() {
                continue;
            }
            let follow = match &items[members[0]].settlement {
                Settlement::Dead { .. } => Settlement::Release,
                other => other.clone(),
            };
            for &i in &members[1..] {
                items[i].settlement = follow.clone();
            }
        }
        for ev in &exhausted {
            let skip_key = self.cfg.dead_head_policy(&ev.topic) == DeadHeadPolicy::Skip;
            items.push(SettleItem {
                id: ev.id,
                lease_token: ev.lease_token,
                settlement: Settlement::Dead {
                    error: format!(
                        "retry budget of {max} attempts exhausted (attempt {} was claimed but never settled: the relay \
                         stopped mid-attempt); last error: {}",
                        ev.attempts - 1,
                        ev.last_error.as_deref().unwrap_or("none")
                    ),
                    status: None,
                    skip_key,
                },
            });
        }
        for ev in &held_back {
            items.push(SettleItem {
                id: ev.id,
                lease_token: ev.lease_token,
                settlement: Settlement::Release,
            });
        }
        for (item, ev) in items.iter().zip(
            to_publish
                .iter()
                .chain(exhausted.iter())
                .chain(held_back.iter()),
        ) {
            if let Settlement::Dead { error, .. } = &item.settlement {
                tracing::warn!(outbox_id = ev.id, topic = %ev.topic, key = %ev.partition_key, attempt = ev.attempts,
                    error = %error, "dead-lettering event");
            }
        }
        let settled = self.settle(&items).await?;
        let outage = published.is_outage();
        if outage {
            let error = published
                .first_request_error()
                .unwrap_or_else(|| "publish request failed".into());
            let mut conn = self.pool().acquire().await.map_err(db("acquire"))?;
            let state = outage::record_failure(
                &mut conn,
                &error,
                probe,
                self.probe_backoff,
                self.db.statements(),
            )
            .await
            .map_err(db("record outage"))?;
            self.outage_hint.store(true, AtomicOrdering::Relaxed);
            tracing::warn!(error = %error, released = settled.released, probe, failures = state.failures,
                next_probe_in_secs = state.until_probe().as_secs_f64(),
                "QStash unavailable as a whole: claim released without spending attempts; publishing paused until the next probe");
        } else if published.requests_ok > 0
            && self.outage_hint.swap(false, AtomicOrdering::Relaxed)
            && let Some(lasted) = outage::clear(&self.db).await.map_err(db("clear outage"))?
        {
            tracing::info!(
                outage_secs = lasted.as_secs_f64(),
                "QStash answers again: outage over"
            );
        }
        let claimed = events.len() as u64;
        let batch = u64::from(claims.batch_size());
        let unordered = events.iter().filter(|e| e.seq.is_none()).count() as u64;
        Ok(CycleReport {
            claimed,
            fenced: claimed.saturating_sub(settled.total()),
            settled,
            // Ordered claims are counted in keys: a key's run may hold several events.
            full: unordered >= batch || heads.len() as u64 >= batch,
            publish_latencies: published.latencies.clone(),
            config_problems: outcomes
                .iter()
                .filter(|o| {
                    matches!(
                        o,
                        PublishOutcome::Transient {
                            config_problem: true,
                            ..
                        }
                    )
                })
                .count() as u64,
            requests_ok: published.requests_ok,
            requests_failed: published.requests_failed,
            outage,
        })
    }
}

fn rl_len_ok(requests: usize, failed: u64) -> u64 {
    (requests as u64).saturating_sub(failed)
}

fn all_equal(v: &[PublishOutcome]) -> bool {
    v.windows(2).all(|w| w[0] == w[1])
}

impl From<RelayError> for lambda_runtime::Diagnostic {
    fn from(e: RelayError) -> Self {
        let mut message = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            message.push_str(": ");
            message.push_str(&s.to_string());
            source = s.source();
        }
        lambda_runtime::Diagnostic {
            error_type: "RelayError".into(),
            error_message: message,
        }
    }
}
