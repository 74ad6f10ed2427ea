//! Message forming (decision record 0014): claimed events become QStash messages, the relay half of
//! [`crate::contract`]. No I/O: everything here is decided from the claim and the settings.
//!
//! - Without batching (every topic's `RELAY_DELIVERY_BATCH` is 1) each event is a message of its own, exactly as
//!   before batching existed: deduplication id `outbox-<id>`, flow control per key.
//! - An ordered key's claimed run (its head and the consecutive events behind it, under one lease token) is one
//!   message, in sequence order; what does not fit (the topic's event count, `QSTASH_MAX_MESSAGE_BYTES`, a gap
//!   in the sequence) is left over for the key's next claim: a key never has two messages in flight.
//! - An unordered topic's events go out in id order, in messages of up to the topic's event count, each under
//!   `QSTASH_MAX_MESSAGE_BYTES`; an event larger than the limit on its own still goes alone (QStash decides).
//! - Each message's deduplication id follows its composition ([`contract::batch_dedup_id`]), so a claim formed
//!   again after a crash between publish and settle gets the same id and QStash drops the copy.

use std::collections::HashMap;
use std::sync::Arc;

use crate::config::{EvidenceMode, OutcomeSource, QstashConfig, RelayConfig, TenantLimit};
use crate::contract;
use crate::ids::{KeyLease, OutboxId, TopicName};
use crate::qstash::{FlowControl, HeaderName, Message, PublishOptions, flow_control_key};
use crate::subscriber_keys::SubscriberKeys;
use crate::subscribers::Destinations;

use super::claim::ClaimedEvent;

/// Messages formed from a claim ([`crate::relay::Relay::messages_for`]).
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

/// How claimed events are grouped into messages: an ordered key's claimed run (its key lease), or an unordered
/// topic's events per subscriber, replayed copies apart from live ones (they go out under different flow
/// control).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Group<'a> {
    Run(KeyLease),
    /// Topic, subscriber, replayed, and the fairness key: each key's messages go out under a flow-control key of
    /// its own ([`crate::fairness`]), so one tenant's backlog at QStash never queues another's.
    Topic(&'a TopicName, &'a str, bool, &'a str),
}

/// The settings forming reads: the relay's (evidence, batching), QStash's (URLs, retries, flow control) and the
/// named subscribers' URLs ([`crate::subscribers`]).
#[derive(Clone)]
pub(super) struct Forming<'a> {
    pub(super) cfg: &'a RelayConfig,
    pub(super) qstash: &'a QstashConfig,
    pub(super) destinations: Arc<Destinations>,
    /// Every subscriber's key ([`crate::subscriber_keys`]): a message for a subscriber with one carries its
    /// signature in the destination.
    pub(super) keys: &'a SubscriberKeys,
}

/// The envelope headers of one event: trace context, correlation id, then the application's own headers.
fn envelope_headers(ev: &ClaimedEvent) -> Vec<(&str, &str)> {
    let mut headers: Vec<(&str, &str)> = Vec::with_capacity(2 + ev.headers.user.len());
    if let Some(tp) = &ev.headers.traceparent {
        headers.push((contract::TRACEPARENT, tp));
    }
    if let Some(c) = &ev.headers.correlation_id {
        headers.push((contract::CORRELATION_ID, c));
    }
    if !ev.fairness_key.is_empty() {
        headers.push((contract::FAIRNESS_KEY, &ev.fairness_key));
    }
    // The producer refused reserved names; a row written by hand could still hold one, and it must not shadow
    // the pipeline's own entries in the envelope.
    headers.extend(
        ev.headers
            .user
            .iter()
            .filter(|(name, _)| !crate::headers::is_reserved(name))
            .map(|(n, v)| (n.as_str(), v.as_str())),
    );
    headers
}

fn wire_event<'a>(
    ev: &'a ClaimedEvent,
    headers: &'a [(&'a str, &'a str)],
    resent: bool,
) -> contract::WireEvent<'a> {
    contract::WireEvent {
        id: ev.id,
        event_id: ev.event_id,
        key: &ev.partition_key,
        seq: ev.seq,
        created_at: ev.created_at,
        schema_version: ev.headers.schema_version,
        headers,
        payload: &ev.payload,
        resent,
    }
}

/// The named subscriber an event's copy is for, as the envelope says it (`None` for the default subscriber).
fn named(ev: &ClaimedEvent) -> Option<&str> {
    (!ev.subscriber.is_empty()).then_some(ev.subscriber.as_str())
}

/// The QStash flow-control key of a tenant's messages on a topic with per-tenant limits:
/// `{topic}{@subscriber}.tenant-{fairness key}` (sanitised; a key with `:` is hashed like any other).
fn tenant_flow_key(ev: &ClaimedEvent, lane: &str) -> String {
    flow_control_key(&format!("{}{lane}.tenant-{}", ev.topic, ev.fairness_key))
}

/// Claimed events grouped for forming, in first-seen order: ordered events per key lease (a subscriber's lane),
/// unordered per topic, subscriber and whether replayed.
fn groups<'e>(
    events: &'e [ClaimedEvent],
    destinations: &Destinations,
    own_lane: impl Fn(&TopicName, usize) -> bool,
) -> Vec<(Group<'e>, Vec<usize>)> {
    // How many unordered events each fairness key has in this claim, per topic and subscriber: a key with a
    // message's worth goes in a lane of its own ([`Forming::tenant_limit`]); lighter keys share the topic's.
    let mut per_key: HashMap<(&TopicName, &str, &str), usize> = HashMap::new();
    for e in events.iter().filter(|e| e.seq.is_none()) {
        *per_key
            .entry((&e.topic, &e.subscriber, &e.fairness_key))
            .or_insert(0) += 1;
    }
    let mut groups: Vec<(Group<'_>, Vec<usize>)> = Vec::new();
    let mut index: HashMap<Group<'_>, usize> = HashMap::new();
    for (i, e) in events.iter().enumerate() {
        let g = match e.key_lease() {
            Some(lease) => Group::Run(lease),
            None => {
                let n = per_key[&(&e.topic, e.subscriber.as_str(), e.fairness_key.as_str())];
                let lane = if own_lane(&e.topic, n) {
                    e.fairness_key.as_str()
                } else {
                    ""
                };
                Group::Topic(
                    &e.topic,
                    &e.subscriber,
                    destinations.replayed(&e.topic, &e.subscriber, e.event_id.get()),
                    lane,
                )
            }
        };
        let at = match index.get(&g) {
            Some(&at) => at,
            None => {
                groups.push((g.clone(), Vec::new()));
                index.insert(g, groups.len() - 1);
                groups.len() - 1
            }
        };
        groups[at].1.push(i);
    }
    groups
}

impl Forming<'_> {
    /// Where an event's subscriber receives it: the default subscriber at `CONSUMER_URL`, a named one at its URL;
    /// `None` for a subscriber that is not live (the relay dead-letters such a copy instead of forming it).
    pub(super) fn destination(&self, ev: &ClaimedEvent) -> Option<String> {
        let base = if ev.subscriber.is_empty() {
            self.qstash.consumer_url.as_str()
        } else {
            self.destinations.url(&ev.topic, &ev.subscriber)?
        };
        Some(contract::destination(base, &ev.topic))
    }

    /// The QStash message carrying `events`: all of one topic, and for an ordered topic consecutive events of one
    /// key in sequence order. Everything that decides a write is in the signed envelope body and the signed
    /// destination URL; `x-outbox-id` (the ids, comma-joined) and `traceparent` (the first event's) are
    /// informational header copies. The application's own headers travel in the envelope only (decision record
    /// 0026).
    pub(super) fn message_of(&self, events: &[&ClaimedEvent]) -> Message {
        let first = events[0];
        let header_lists: Vec<Vec<(&str, &str)>> =
            events.iter().map(|ev| envelope_headers(ev)).collect();
        let ordered = first.seq.is_some();
        let wire: Vec<contract::WireEvent<'_>> = events
            .iter()
            .zip(&header_lists)
            .map(|(ev, headers)| wire_event(ev, headers, self.resent(ev)))
            .collect();
        let body = contract::write_envelope(
            &first.topic,
            named(first),
            self.evidence_for(ordered),
            &wire,
        );
        // The relay only forms events whose subscriber is live (`Relay::orphans`); should one slip through, an
        // unroutable destination makes QStash refuse it rather than deliver it to someone else.
        let mut destination = self.destination(first).unwrap_or_else(|| {
            contract::destination("http://subscriber-not-configured.invalid", &first.topic)
        });
        if let Some(sig) = self.keys.sign(&first.subscriber, body.as_bytes()) {
            destination.push('&');
            destination.push_str(crate::subscriber_keys::SIGNATURE_PARAM);
            destination.push('=');
            destination.push_str(&sig);
        }
        Message {
            destination,
            body,
            options: self.options(events),
        }
    }

    /// The publish options of a message carrying `events` (see [`Forming::message_of`]).
    fn options(&self, events: &[&ClaimedEvent]) -> PublishOptions {
        let first = events[0];
        let ordered = first.seq.is_some();
        let by_consumer = self.evidence_for(ordered) == Some(contract::Evidence::Consumer);
        let ids: Vec<OutboxId> = events.iter().map(|e| e.id).collect();
        let mut forward: Vec<(HeaderName, String)> = Vec::with_capacity(2);
        forward.push((
            contract::OUTBOX_ID.into(),
            contract::id_copy(ids.iter().copied()),
        ));
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
        let dedup: Vec<(OutboxId, i32)> =
            events.iter().map(|e| (e.id, e.dedup_generation)).collect();
        // Ordered messages keep their key's flow-control key; an unordered message of several events (any keys)
        // uses its topic's. A named subscriber's messages have their own keys: its retries never take another
        // subscriber's parallelism. A replay's messages share one key per subscriber, at the replay's
        // parallelism: its backlog waits in a queue of its own, not ahead of anyone's live events (an ordered
        // lane still has one message in flight, so its order does not depend on the key).
        let lane = if first.subscriber.is_empty() {
            String::new()
        } else {
            format!("@{}", first.subscriber)
        };
        let replayed =
            self.destinations
                .replayed(&first.topic, &first.subscriber, first.event_id.get());
        let flow_control = match self.tenant_limit(events, replayed) {
            // A tenant's lane (crate::fairness): every message of this key on this topic (and subscriber) shares one
            // flow-control key, with the topic's per-tenant limits or the usual parallelism and rate.
            Some(limit) => FlowControl {
                key: tenant_flow_key(first, &lane),
                parallelism: limit.parallelism,
                rate: limit.rate,
                period: limit
                    .rate
                    .map(|_| limit.period.unwrap_or(self.qstash.flow_period)),
            },
            None => self.usual_flow_control(events, &lane, replayed),
        };
        let cb = &self.qstash.callback_url;
        PublishOptions {
            content_type: Some("application/json".into()),
            deduplication_id: Some(contract::batch_dedup_id(&dedup)),
            retries: Some(self.qstash.retries),
            timeout: self.qstash.delivery_timeout,
            failure_callback: Some(format!("{cb}{}", contract::FAILURE_PATH)),
            callback: callback.then(|| format!("{cb}{}", contract::DELIVERED_PATH)),
            forward,
            flow_control: Some(flow_control),
            label: Some(first.topic.to_string()),
            ..Default::default()
        }
    }

    /// The limits of the tenant lane a message goes out in, or `None` for the usual flow control: a message of
    /// one fairness key goes in its tenant's lane when its topic has per-tenant limits, or when it carries several
    /// unordered events (forming gives a key its own messages when it has a message's worth in the claim: a flood
    /// waits at QStash in its own lane, while light tenants share the topic's key and its messages). A replay
    /// keeps its own key, and so does a single event or an ordered key without limits (they have a key of their
    /// own already), or a message of several tenants.
    fn tenant_limit(&self, events: &[&ClaimedEvent], replayed: bool) -> Option<TenantLimit> {
        let first = events[0];
        let one_key = events.iter().all(|e| e.fairness_key == first.fairness_key);
        if first.fairness_key.is_empty() || replayed || !one_key {
            return None;
        }
        let usual = || TenantLimit {
            rate: self.qstash.flow_rate,
            period: None,
            parallelism: Some(self.qstash.flow_parallelism),
        };
        match self.cfg.fairness.limits.for_topic(&first.topic) {
            Some(limit) => Some(limit),
            None if first.seq.is_none() && events.len() > 1 => Some(usual()),
            None => None,
        }
    }

    /// The flow control of a message without per-tenant limits: a replay's key, an ordered key's (or a single
    /// event's), or the topic's.
    fn usual_flow_control(
        &self,
        events: &[&ClaimedEvent],
        lane: &str,
        replayed: bool,
    ) -> FlowControl {
        let first = events[0];
        let ordered = first.seq.is_some();
        let (flow_key, parallelism, rate) = if replayed {
            (
                flow_control_key(&format!("{}{lane}.replay", first.topic)),
                self.destinations
                    .replay_parallelism(&first.topic, &first.subscriber)
                    .unwrap_or(self.qstash.replay_parallelism),
                None,
            )
        } else if ordered || events.len() == 1 {
            (
                flow_control_key(&format!("{}.{}{lane}", first.topic, first.partition_key)),
                self.qstash.flow_parallelism,
                self.qstash.flow_rate,
            )
        } else {
            (
                flow_control_key(&format!("{}{lane}", first.topic)),
                self.qstash.flow_parallelism,
                self.qstash.flow_rate,
            )
        };
        FlowControl {
            key: flow_key,
            parallelism: Some(parallelism),
            rate,
            period: rate.map(|_| self.qstash.flow_period),
        }
    }

    /// Who records an ordered event's delivery evidence (the envelope's `evidence`); `None` for unordered events.
    fn evidence_for(&self, ordered: bool) -> Option<contract::Evidence> {
        ordered.then_some(if self.cfg.ordered_evidence == EvidenceMode::Consumer {
            contract::Evidence::Consumer
        } else {
            contract::Evidence::Callback
        })
    }

    /// Groups claimed events into messages (the module docs say how), each with the indexes (into `events`) of
    /// the events it carries; an ordered key's events that do not fit its one message are in
    /// [`Formed::left_over`].
    pub(super) fn messages_for(&self, events: &[ClaimedEvent]) -> Formed {
        let mut formed = Formed::default();
        if !self.cfg.batching.any_batching() {
            formed.messages = (0..events.len())
                .map(|i| self.outgoing(events, vec![i]))
                .collect();
            return formed;
        }
        let own_lane = |topic: &TopicName, n: usize| {
            self.cfg.fairness.limits.for_topic(topic).is_some()
                || n >= self.cfg.batching.n_for(topic).max(2) as usize
        };
        for (group, mut members) in groups(events, &self.destinations, own_lane) {
            let (ordered, topic) = match &group {
                Group::Run(lease) => (true, lease.topic.as_str()),
                Group::Topic(topic, _, _, _) => (false, topic.as_str()),
            };
            if ordered {
                members.sort_by_key(|&i| events[i].seq);
            } else {
                members.sort_by_key(|&i| events[i].id);
            }
            self.pack(events, ordered, topic, members, &mut formed);
        }
        formed
    }

    /// Packs one group's members (sorted) into messages of up to the topic's event count, under the size limit.
    /// An ordered group makes one message; the members after the first that does not fit are left over.
    fn pack(
        &self,
        events: &[ClaimedEvent],
        ordered: bool,
        topic: &str,
        members: Vec<usize>,
        formed: &mut Formed,
    ) {
        let batching = &self.cfg.batching;
        let n = batching.n_for(topic).max(1) as usize;
        let subscriber = members.first().and_then(|&i| named(&events[i]));
        let overhead =
            contract::write_envelope(topic, subscriber, self.evidence_for(ordered), &[]).len();
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

    /// Whether `ev` is sent again on purpose: redriven, republished by the reconciler, or a replayed copy.
    fn resent(&self, ev: &ClaimedEvent) -> bool {
        ev.dedup_generation > 0
            || (self.destinations).replayed(&ev.topic, &ev.subscriber, ev.event_id.get())
    }

    /// The bytes one event adds to an envelope (its envelope alone minus the empty envelope).
    fn event_size(&self, ev: &ClaimedEvent, overhead: usize) -> usize {
        let headers = envelope_headers(ev);
        let one = contract::write_envelope(
            &ev.topic,
            named(ev),
            self.evidence_for(ev.seq.is_some()),
            &[wire_event(ev, &headers, self.resent(ev))],
        );
        one.len().saturating_sub(overhead)
    }

    /// The message of `members` (indexes into `events`).
    pub(super) fn outgoing(&self, events: &[ClaimedEvent], members: Vec<usize>) -> Outgoing {
        let refs: Vec<&ClaimedEvent> = members.iter().map(|&i| &events[i]).collect();
        Outgoing {
            message: self.message_of(&refs),
            events: members,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::config::Vars;

    struct Settings {
        cfg: RelayConfig,
        qstash: QstashConfig,
        destinations: Arc<Destinations>,
        keys: SubscriberKeys,
    }

    impl Settings {
        fn new(extra: &[(&'static str, &'static str)]) -> Self {
            let mut env: HashMap<&'static str, &'static str> = [
                ("CONSUMER_URL", "https://consumer.example"),
                ("CALLBACK_URL", "https://callbacks.example"),
            ]
            .into_iter()
            .collect();
            env.extend(extra.iter().copied());
            let v = Vars::new(&env);
            Settings {
                cfg: RelayConfig::from_vars(&v, 5).expect("relay settings"),
                qstash: QstashConfig::from_vars(&v).expect("qstash settings"),
                destinations: Arc::new(Destinations::default().with(
                    "orders",
                    "billing",
                    "https://billing.example",
                )),
                keys: SubscriberKeys::none(),
            }
        }

        fn forming(&self) -> Forming<'_> {
            Forming {
                cfg: &self.cfg,
                qstash: &self.qstash,
                destinations: self.destinations.clone(),
                keys: &self.keys,
            }
        }
    }

    fn event(id: i64, topic: &str, key: &str, seq: Option<i64>, lease_token: i64) -> ClaimedEvent {
        ClaimedEvent::for_test(id, topic, key, seq, lease_token)
    }

    /// The outbox ids of each message, in message order.
    fn ids(events: &[ClaimedEvent], formed: &Formed) -> Vec<Vec<i64>> {
        formed
            .messages
            .iter()
            .map(|m| m.events.iter().map(|&i| events[i].id.get()).collect())
            .collect()
    }

    fn flow_control(m: &Message) -> &FlowControl {
        m.options.flow_control.as_ref().expect("flow control")
    }

    fn envelope_ids(m: &Message) -> Vec<i64> {
        let env = contract::parse_envelope(m.body.as_bytes()).expect("an envelope");
        env.events.iter().map(|e| e.id.get()).collect()
    }

    fn of_tenant(id: i64, tenant: &str) -> ClaimedEvent {
        ClaimedEvent {
            fairness_key: tenant.into(),
            ..event(id, "audit", &format!("k{id}"), None, 1)
        }
    }

    /// A tenant with a message's worth of events in the claim gets messages and a QStash lane of its own, with the
    /// usual parallelism (or the topic's per-tenant limits); light tenants share the topic's messages and key; the
    /// envelope names each event's fairness key.
    #[test]
    fn a_heavy_tenant_gets_its_own_lane_and_light_tenants_share_the_topics() {
        let s = Settings::new(&[("RELAY_DELIVERY_BATCH", "50")]);
        let mut events: Vec<ClaimedEvent> = (1..=120).map(|i| of_tenant(i, "bulk")).collect();
        events.push(of_tenant(200, "t1"));
        events.extend([
            of_tenant(201, "t2"),
            of_tenant(202, "t2"),
            of_tenant(203, ""),
        ]);
        let formed = s.forming().messages_for(&events);
        let lanes: Vec<(String, usize)> = formed
            .messages
            .iter()
            .map(|m| (flow_control(&m.message).key.clone(), m.events.len()))
            .collect();
        let bulk = flow_control_key("audit.tenant-bulk");
        assert_eq!(
            lanes,
            vec![
                (bulk.clone(), 50),
                (bulk.clone(), 50),
                (bulk, 20),
                (flow_control_key("audit"), 4)
            ]
        );
        assert_eq!(
            flow_control(&formed.messages[0].message).parallelism,
            Some(s.qstash.flow_parallelism)
        );
        let shared = contract::parse_envelope(formed.messages[3].message.body.as_bytes()).unwrap();
        let keys: Vec<Option<&str>> = shared
            .events
            .iter()
            .map(|e| e.headers.get(contract::FAIRNESS_KEY).map(String::as_str))
            .collect();
        assert_eq!(keys, [Some("t1"), Some("t2"), Some("t2"), None]);

        // With per-tenant limits on the topic every tenant has its own lane, at the topic's limits.
        let limited = Settings::new(&[
            ("RELAY_DELIVERY_BATCH", "50"),
            ("RELAY_TENANT_LIMITS", "audit:rate=5,period=1m"),
        ]);
        let formed = limited.forming().messages_for(&events);
        let t2 = formed
            .messages
            .iter()
            .find(|m| m.events.len() == 2)
            .expect("t2's own message");
        let fc = flow_control(&t2.message);
        assert_eq!(fc.key, flow_control_key("audit.tenant-t2"));
        assert_eq!(
            (fc.rate, fc.period, fc.parallelism),
            (Some(5), Some(std::time::Duration::from_secs(60)), None)
        );
        assert_eq!(fc.value().as_deref(), Some("rate=5, period=60s"));
    }

    #[test]
    fn without_batching_every_event_is_a_message_of_its_own() {
        let s = Settings::new(&[("RELAY_DELIVERY_BATCH", "1")]);
        let mut events = vec![
            event(3, "audit", "a", None, 1),
            event(1, "audit", "b", None, 1),
            event(2, "orders", "k", Some(1), 2),
        ];
        events[1].dedup_generation = 2;
        let formed = s.forming().messages_for(&events);
        assert_eq!(ids(&events, &formed), vec![vec![3], vec![1], vec![2]]);
        assert!(formed.left_over.is_empty());
        let dedup: Vec<_> = formed
            .messages
            .iter()
            .map(|m| m.message.options.deduplication_id.clone())
            .collect();
        assert_eq!(
            dedup,
            vec![
                Some("outbox-3".to_string()),
                Some("outbox-1-r2".to_string()),
                Some("outbox-2".to_string())
            ]
        );
        for (m, ev) in formed.messages.iter().zip(&events) {
            let fc = flow_control(&m.message);
            assert_eq!(
                fc.key,
                flow_control_key(&format!("{}.{}", ev.topic, ev.partition_key))
            );
            assert_eq!(envelope_ids(&m.message), vec![ev.id.get()]);
        }
    }

    #[test]
    fn unordered_events_go_per_topic_in_id_order_up_to_each_topics_n() {
        let s = Settings::new(&[
            ("RELAY_DELIVERY_BATCH", "2"),
            ("RELAY_DELIVERY_BATCH_TOPICS", "audit=3"),
        ]);
        let events: Vec<ClaimedEvent> = [(5, "audit"), (2, "metrics"), (1, "audit"), (4, "audit")]
            .into_iter()
            .chain([(3, "metrics"), (9, "audit"), (6, "audit"), (7, "metrics")])
            .map(|(id, topic)| event(id, topic, &format!("k{id}"), None, 0))
            .collect();
        let formed = s.forming().messages_for(&events);
        let groups = ids(&events, &formed);
        assert_eq!(groups, vec![vec![1, 4, 5], vec![6, 9], vec![2, 3], vec![7]]);
        assert!(formed.left_over.is_empty());
        for (m, group) in formed.messages.iter().zip(&groups) {
            let topic = &events[m.events[0]].topic;
            let fc = flow_control(&m.message);
            if m.events.len() > 1 {
                // Several events of any keys: the topic's flow-control key, a composition's dedup id.
                assert_eq!(fc.key, flow_control_key(topic));
                let dedup = m
                    .message
                    .options
                    .deduplication_id
                    .clone()
                    .unwrap_or_default();
                assert!(dedup.starts_with("outbox-b"), "{dedup}");
            } else {
                let ev = &events[m.events[0]];
                assert_eq!(
                    fc.key,
                    flow_control_key(&format!("{topic}.{}", ev.partition_key))
                );
            }
            assert_eq!(&envelope_ids(&m.message), group);
            assert_eq!(
                m.message.options.forward[0].1,
                contract::id_copy(group.iter().copied().map(OutboxId))
            );
        }
    }

    #[test]
    fn an_ordered_run_is_one_message_and_what_does_not_fit_waits() {
        let s = Settings::new(&[("RELAY_DELIVERY_BATCH", "3")]);
        // Key k (lease 7): 1, 2, 3, 4 — one more than n. Key j (lease 8): 1, 2, then a gap before 4.
        let events = vec![
            event(12, "orders", "k", Some(2), 7),
            event(21, "orders", "j", Some(1), 8),
            event(11, "orders", "k", Some(1), 7),
            event(24, "orders", "j", Some(4), 8),
            event(14, "orders", "k", Some(4), 7),
            event(13, "orders", "k", Some(3), 7),
            event(22, "orders", "j", Some(2), 8),
        ];
        let formed = s.forming().messages_for(&events);
        assert_eq!(ids(&events, &formed), vec![vec![11, 12, 13], vec![21, 22]]);
        let mut left: Vec<i64> = formed
            .left_over
            .iter()
            .map(|&i| events[i].id.get())
            .collect();
        left.sort();
        assert_eq!(left, vec![14, 24]);
        for m in &formed.messages {
            let opts = &m.message.options;
            // Callback evidence (the default): the delivery callback frees the key.
            assert_eq!(
                opts.callback.as_deref(),
                Some("https://callbacks.example/delivered")
            );
            let ev = &events[m.events[0]];
            let fc = flow_control(&m.message);
            assert_eq!(
                fc.key,
                flow_control_key(&format!("orders.{}", ev.partition_key))
            );
            let env = contract::parse_envelope(m.message.body.as_bytes()).expect("an envelope");
            assert_eq!(env.evidence, Some(contract::Evidence::Callback));
            let seqs: Vec<Option<i64>> = env.events.iter().map(|e| e.seq).collect();
            let expected: Vec<Option<i64>> = (1..=seqs.len() as i64).map(Some).collect();
            assert_eq!(seqs, expected);
        }
    }

    #[test]
    fn the_size_limit_splits_messages_and_a_huge_event_goes_alone() {
        let limit = 1000;
        let s = Settings::new(&[
            ("RELAY_DELIVERY_BATCH", "10"),
            ("QSTASH_MAX_MESSAGE_BYTES", "1000"),
        ]);
        let mut events: Vec<ClaimedEvent> =
            (1..=5).map(|id| event(id, "audit", "k", None, 0)).collect();
        for ev in &mut events {
            ev.payload = format!("\"{}\"", "x".repeat(300));
        }
        events[2].payload = format!("\"{}\"", "y".repeat(2000));
        let formed = s.forming().messages_for(&events);
        assert_eq!(ids(&events, &formed), vec![vec![1, 2], vec![3], vec![4, 5]]);
        for m in &formed.messages {
            if m.events.len() > 1 {
                assert!(m.message.body.len() < limit, "{}", m.message.body.len());
            } else {
                assert!(m.message.body.len() > limit);
            }
        }
        // An ordered key's run stops at the limit: the rest waits for the key's next claim.
        let ordered: Vec<ClaimedEvent> = events
            .iter()
            .cloned()
            .enumerate()
            .map(|(i, mut ev)| {
                ev.seq = Some(i as i64 + 1);
                ev.lease_token = 3;
                ev
            })
            .collect();
        let formed = s.forming().messages_for(&ordered);
        assert_eq!(ids(&ordered, &formed), vec![vec![1, 2]]);
        assert_eq!(formed.left_over, vec![2, 3, 4]);
    }

    #[test]
    fn each_subscribers_copies_go_to_its_url_in_messages_and_flow_keys_of_their_own() {
        let s = Settings::new(&[("RELAY_DELIVERY_BATCH", "10")]);
        let mut events: Vec<ClaimedEvent> = (1..=4)
            .map(|id| event(id, "orders", "k", None, 0))
            .collect();
        events[1].subscriber = "billing".into();
        events[3].subscriber = "billing".into();
        let formed = s.forming().messages_for(&events);
        assert_eq!(ids(&events, &formed), vec![vec![1, 3], vec![2, 4]]);
        let default = &formed.messages[0].message;
        let billing = &formed.messages[1].message;
        assert_eq!(
            default.destination,
            contract::destination("https://consumer.example", "orders")
        );
        assert_eq!(
            billing.destination,
            contract::destination("https://billing.example", "orders")
        );
        assert_ne!(flow_control(default).key, flow_control(billing).key);
        // An ordered lane: one message per (key, subscriber) under the same claim token.
        let mut a = event(5, "orders", "k", Some(1), 9);
        let mut b = a.clone();
        b.id = OutboxId(6);
        b.subscriber = "billing".into();
        a.headers = b.headers.clone();
        let formed = s.forming().messages_for(&[a.clone(), b.clone()]);
        assert_eq!(formed.messages.len(), 2);
        assert_ne!(
            flow_control(&formed.messages[0].message).key,
            flow_control(&formed.messages[1].message).key
        );
        // A subscriber that is not live has no destination (the relay dead-letters its copies).
        b.subscriber = "gone".into();
        assert_eq!(s.forming().destination(&b), None);
        assert!(s.forming().destination(&a).is_some());
    }

    #[test]
    fn a_replays_copies_share_one_paced_key_and_never_a_message_with_live_ones() {
        let mut s = Settings::new(&[
            ("RELAY_DELIVERY_BATCH", "10"),
            ("QSTASH_REPLAY_PARALLELISM", "3"),
        ]);
        s.destinations = Arc::new(
            Destinations::default()
                .with("orders", "billing", "https://billing.example")
                .with_replay("orders", "billing", 1, Some(100)),
        );
        // Billing's copies of events 1..=100 are its replay; event 150's copy is live. Copies have ids of their
        // own (the replay wrote them late), the event id says which event they carry.
        let copy = |id: i64, event: i64, key: &str, seq: Option<i64>| {
            let mut e = event_for(id, key, seq);
            e.subscriber = "billing".into();
            e.event_id = OutboxId(event);
            e
        };
        let events = vec![
            copy(1001, 7, "a", None),
            copy(1002, 150, "b", None),
            copy(1003, 8, "c", None),
        ];
        let formed = s.forming().messages_for(&events);
        assert_eq!(ids(&events, &formed), vec![vec![1001, 1003], vec![1002]]);
        let replay = flow_control(&formed.messages[0].message);
        let live = flow_control(&formed.messages[1].message);
        assert_eq!(replay.key, flow_control_key("orders@billing.replay"));
        assert_eq!(replay.parallelism, Some(3));
        assert_eq!(live.parallelism, Some(10));
        assert_ne!(replay.key, live.key);
        // Two replayed lanes share the key; the same lane's live copy (after the replay's end) does not.
        let lanes = [
            copy(1004, 9, "x", Some(1)),
            copy(1005, 10, "y", Some(1)),
            copy(1006, 151, "z", Some(1)),
        ];
        let keys: Vec<String> = lanes
            .iter()
            .map(|e| flow_control(&s.forming().message_of(&[e])).key.clone())
            .collect();
        assert_eq!(keys[0], keys[1]);
        assert_eq!(keys[0], flow_control_key("orders@billing.replay"));
        assert_eq!(keys[2], flow_control_key("orders.z@billing"));
        // A subscriber's own replay parallelism wins over the relay's setting.
        s.destinations = Arc::new(
            Destinations::clone(&s.destinations).with_replay_parallelism("orders", "billing", 20),
        );
        let own = s
            .forming()
            .message_of(&[&lanes[0]])
            .options
            .flow_control
            .expect("flow control");
        assert_eq!(own.parallelism, Some(20));
        // The default subscriber's copies of the same events are not billing's replay.
        let mut default = copy(1007, 7, "a", None);
        default.subscriber = String::new();
        let fc = s
            .forming()
            .message_of(&[&default])
            .options
            .flow_control
            .expect("flow control");
        assert_eq!(fc.key, "orders.a");
    }

    /// A copy sent again on purpose (redriven or republished: a dedup generation; a replayed copy) says so in
    /// the envelope, for the consumer's tracing (linked, not a child of the producer's span); a first send does not.
    #[test]
    fn a_copy_sent_again_on_purpose_is_marked_resent() {
        let mut s = Settings::new(&[("RELAY_DELIVERY_BATCH", "1")]);
        s.destinations = Arc::new(
            Destinations::default()
                .with("orders", "billing", "https://billing.example")
                .with_replay("orders", "billing", 1, Some(100)),
        );
        let first = event_for(1, "a", None);
        let mut redriven = event_for(2, "b", None);
        redriven.dedup_generation = 1;
        let mut replayed = event_for(1003, "c", None);
        replayed.subscriber = "billing".into();
        replayed.event_id = OutboxId(3);
        let resent = |ev: &ClaimedEvent| {
            let m = s.forming().message_of(&[ev]);
            contract::parse_envelope(m.body.as_bytes())
                .expect("an envelope")
                .events[0]
                .resent
        };
        assert_eq!(
            [resent(&first), resent(&redriven), resent(&replayed)],
            [false, true, true]
        );
    }

    fn event_for(id: i64, key: &str, seq: Option<i64>) -> ClaimedEvent {
        event(id, "orders", key, seq, 0)
    }

    #[test]
    fn envelope_and_headers_carry_what_the_consumer_reads() {
        let s = Settings::new(&[("RELAY_ORDERED_EVIDENCE", "consumer")]);
        let mut ev = event(8, "orders", "k", Some(1), 4);
        ev.headers.traceparent =
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into());
        ev.headers.correlation_id = Some("req-1".into());
        ev.headers.user.insert("tenant".into(), "t1".into());
        // Written by hand past the producer: must not shadow the pipeline's own entries.
        ev.headers.user.insert("x-outbox-id".into(), "99".into());
        let f = s.forming();
        let m = f.message_of(&[&ev]);
        assert_eq!(
            m.destination,
            contract::destination("https://consumer.example", "orders")
        );
        let env = contract::parse_envelope(m.body.as_bytes()).expect("an envelope");
        assert_eq!(env.evidence, Some(contract::Evidence::Consumer));
        let headers = &env.events[0].headers;
        assert_eq!(headers.get("tenant").map(String::as_str), Some("t1"));
        assert_eq!(
            headers.get(contract::CORRELATION_ID).map(String::as_str),
            Some("req-1")
        );
        assert!(!headers.contains_key("x-outbox-id"));
        // The consumer records the evidence: no delivery callback; the failure callback always.
        assert_eq!(m.options.callback, None);
        assert_eq!(
            m.options.failure_callback.as_deref(),
            Some("https://callbacks.example/failure")
        );
        let forward: Vec<(String, String)> = m
            .options
            .forward
            .iter()
            .map(|(n, v)| (n.to_string(), v.clone()))
            .collect();
        assert_eq!(
            forward,
            vec![
                ("x-outbox-id".to_string(), "8".to_string()),
                (
                    "traceparent".to_string(),
                    ev.headers.traceparent.clone().unwrap_or_default()
                )
            ]
        );
        // The size an event adds is what it adds to a real envelope.
        let overhead = contract::write_envelope("orders", None, f.evidence_for(true), &[]).len();
        assert_eq!(f.event_size(&ev, overhead), m.body.len() - overhead);
    }
}
