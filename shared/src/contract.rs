//! The wire contract between relay, QStash and the receivers (decision record 0025).
//!
//! QStash signs exactly two things of every request it makes: the body (its SHA-256 is the token's `body`
//! claim) and the URL it called (`sub`). Anything else — every request header — can be rewritten by whoever
//! holds one valid delivery (a token lives five minutes and can leak through a proxy, a log line or a captured
//! request). So everything that decides a write travels in signed data, and nowhere else:
//!
//! | what | where | signed by |
//! |---|---|---|
//! | contract version | destination query `?contract=2` ([`CONTRACT_QUERY`]) | `sub` |
//! | topic | destination path `/events/{topic}`, repeated as the envelope's `topic` | `sub`, `body` |
//! | outbox id, partition key, sequence, schema version, creation time, headers (with the fairness key), payload | the envelope's event | `body` |
//! | who records delivery evidence of an ordered event | the envelope's `evidence` | `body` |
//! | the named subscriber a copy is for (fan-out; omitted for the default subscriber) | the envelope's `subscriber` | `body` |
//! | the event a copy is of: the consumer's dedupe key (fan-out and replay; omitted when it is the copy's own id) | the envelope's event `event` | `body` |
//!
//! The body is a JSON **envelope** ([`Envelope`]):
//!
//! ```json
//! {"contract":2,"topic":"invoices","evidence":"consumer","events":[
//!   {"id":42,"key":"customer-7","seq":3,"created_at":"2026-11-30T12:00:00.000000Z","schema_version":2,
//!    "headers":{"traceparent":"00-…-01","x-correlation-id":"req-9","tenant":"acme"},"payload":{"invoice_id":"i-1"}}]}
//! ```
//!
//! `subscriber`, `evidence`, `seq`, `schema_version` and `headers` are omitted when they do not apply. A consumer
//! refuses a copy whose `subscriber` is not its `CONSUMER_NAME` (it would dedupe it in another subscriber's
//! namespace, [`crate::subscribers`]). `headers` holds the trace
//! context, the correlation id and the application's own headers ([`crate::headers`]: names the pipeline owns
//! are refused there, so the two never collide); the latter travel only here, never as request headers
//! (decision record 0026). `events` holds one event or a **batch** of up to [`MAX_BATCH_EVENTS`] (decision
//! records 0014 and 0027), whose shape [`parse_envelope`] checks:
//!
//! | batch rule | why |
//! |---|---|
//! | 1 ≤ k ≤ [`MAX_BATCH_EVENTS`] events, distinct ids | one message per relay batch; an id is the consumer's dedupe key |
//! | all events ordered (with `seq`) or all unordered | a topic is either |
//! | ordered: one partition key, consecutive sequences s, s+1, …, in that order | the relay publishes a key's next run behind its head |
//!
//! Two request headers stay as **informational copies** (`x-outbox-id` for QStash's console and logs — for a batch
//! the ids joined by `,` with no spaces, [`id_copy`] — and `traceparent`, the first event's, for tracing proxies). A receiver refuses a request whose `x-outbox-*` or `x-schema-version` copy
//! disagrees with the signed value; `traceparent` is not compared (tracing proxies rewrite it; the envelope's value
//! is the one used).
//!
//! A delivery whose URL has no `contract` parameter was published by a relay of the previous version (identity in
//! `x-outbox-*` headers): the consumer accepts it only after checking it against the outbox row
//! (`LEGACY_DELIVERIES`, see [`crate::consumer`]). A higher version than [`CONTRACT_VERSION`] comes from a newer
//! relay and is answered "retry later" until this consumer is upgraded.
//!
//! Callbacks ([`crate::callbacks`]) read the outbox id from their signed body: the original message's URL and
//! body (`url`, `sourceBody`) or the headers its publisher set (`sourceHeader`).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::ids::{OutboxId, PartitionKey, TopicName};

/// The contract version this relay writes and this consumer reads.
pub(crate) const CONTRACT_VERSION: u32 = 2;
/// The most events one envelope may hold (the relay's `RELAY_DELIVERY_BATCH` range ends here).
pub(crate) const MAX_BATCH_EVENTS: usize = 1000;
/// The destination query parameter that carries the contract version (covered by the token's `sub`).
pub(crate) const CONTRACT_PARAM: &str = "contract";
/// The query the relay appends to every destination.
pub const CONTRACT_QUERY: &str = "contract=2";

/// Informational copy of the outbox id (request header; never trusted, compared with the signed id).
pub const OUTBOX_ID: &str = "x-outbox-id";
/// W3C trace context of the producer (request header copy and envelope header).
pub const TRACEPARENT: &str = "traceparent";
/// Correlation id (envelope header).
pub(crate) const CORRELATION_ID: &str = "x-correlation-id";
/// The event's fairness key, when it has one (envelope header; [`crate::fairness`]). An `x-outbox-*` name: user
/// headers cannot set it.
pub(crate) const FAIRNESS_KEY: &str = "x-outbox-fairness-key";

/// The request headers of the previous contract (identity in unsigned headers). Read only on the legacy path,
/// where every value is checked against the outbox row; on a current delivery a copy that disagrees with the
/// envelope is refused.
pub mod legacy {
    /// Outbox id.
    pub const OUTBOX_ID: &str = "x-outbox-id";
    /// Topic.
    pub(crate) const OUTBOX_TOPIC: &str = "x-outbox-topic";
    /// Partition key, percent-encoded.
    pub(crate) const OUTBOX_KEY: &str = "x-outbox-key";
    /// Per-key sequence.
    pub(crate) const OUTBOX_SEQ: &str = "x-outbox-seq";
    /// `consumer` when the consumer was asked to record delivery evidence.
    pub(crate) const OUTBOX_EVIDENCE: &str = "x-outbox-evidence";
    /// Payload schema version.
    pub(crate) const SCHEMA_VERSION: &str = "x-schema-version";
}

/// Path (under `CALLBACK_URL`) of QStash failure callbacks.
pub const FAILURE_PATH: &str = "/failure";
/// Path (under `CALLBACK_URL`) of QStash delivery callbacks (ordered topics).
pub const DELIVERED_PATH: &str = "/delivered";
/// Path prefix (under `CONSUMER_URL`) of event deliveries: `/events/{topic}`.
pub const EVENTS_PATH: &str = "/events/";

/// The destination of a topic's deliveries: `{consumer_url}/events/{topic}?contract=2`.
pub fn destination(consumer_url: &str, topic: &str) -> String {
    let base = consumer_url.trim_end_matches('/');
    let mut s = String::with_capacity(base.len() + EVENTS_PATH.len() + topic.len() + 11);
    s.push_str(base);
    s.push_str(EVENTS_PATH);
    s.push_str(topic);
    s.push('?');
    s.push_str(CONTRACT_QUERY);
    s
}

/// Which contract a delivery follows, read from its (signed) URL query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Contract {
    /// No `contract` parameter: published by a relay of the previous version.
    Legacy,
    /// [`CONTRACT_VERSION`]: the signed envelope.
    Current,
    /// A version this consumer does not know yet (a newer relay).
    Newer(u32),
}

/// The contract of a delivery from its raw query string. `Err` for a query that names no valid version, or
/// names one twice.
pub(crate) fn contract_of_query(query: Option<&str>) -> Result<Contract, String> {
    let mut found: Option<&str> = None;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if name == CONTRACT_PARAM {
            if found.is_some() {
                return Err("the URL names the contract version twice".into());
            }
            found = Some(value);
        }
    }
    let Some(v) = found else {
        return Ok(Contract::Legacy);
    };
    match v.parse::<u32>() {
        Ok(CONTRACT_VERSION) => Ok(Contract::Current),
        Ok(n) if n > CONTRACT_VERSION => Ok(Contract::Newer(n)),
        _ => Err(format!(
            "unknown contract version {:?} in the URL (this consumer reads {CONTRACT_VERSION})",
            v.chars().take(20).collect::<String>()
        )),
    }
}

/// Who records the delivery evidence of an ordered event (decision record 0007).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Evidence {
    /// The consumer, in the transaction that applies the event.
    Consumer,
    /// QStash's delivery callback (the consumer does nothing).
    Callback,
}

impl Evidence {
    /// The wire value.
    pub fn as_str(self) -> &'static str {
        match self {
            Evidence::Consumer => "consumer",
            Evidence::Callback => "callback",
        }
    }
}

/// A delivery body, as the consumer reads it. Unknown fields are ignored (a later minor addition); a change of
/// meaning gets a new [`CONTRACT_VERSION`].
#[derive(Debug, Deserialize)]
pub struct Envelope<'a> {
    /// Always [`CONTRACT_VERSION`].
    pub contract: u32,
    /// The topic (equal to the path's).
    pub topic: TopicName,
    /// The named subscriber this copy is for, whose `CONSUMER_NAME` must be the consumer's (fan-out); absent for
    /// the default subscriber and from relays before fan-out.
    #[serde(default)]
    pub subscriber: Option<String>,
    /// Who records delivery evidence (ordered events only).
    #[serde(default)]
    pub evidence: Option<Evidence>,
    /// The events: one, or a batch (see the module docs for its shape).
    #[serde(borrow)]
    pub events: Vec<EnvelopeEvent<'a>>,
}

/// One event of an [`Envelope`].
#[derive(Debug, Deserialize)]
pub struct EnvelopeEvent<'a> {
    /// The outbox id of this copy: what delivery evidence is recorded against.
    pub id: OutboxId,
    /// The event this is a copy of: the first copy's outbox id, the same in every copy of the event made for any
    /// subscriber, by the producer, a replay or a re-add (decision record 0070). The consumer's dedupe key within
    /// its namespace. Absent when it is [`EnvelopeEvent::id`] (the event's first copy, and every delivery of a relay
    /// before this field).
    #[serde(default)]
    pub event: Option<OutboxId>,
    /// This copy was sent again on purpose: a redrive, a reconciler's republish or a replay. Tracing only (the
    /// consumer's `process` span links the producer's instead of being its child); absent: false.
    #[serde(default)]
    pub resent: bool,
    /// The partition key.
    pub key: PartitionKey,
    /// The per-key sequence (ordered topics only).
    #[serde(default)]
    pub seq: Option<i64>,
    /// When the producer's transaction wrote it.
    #[serde(default)]
    pub created_at: Option<DateTime<Utc>>,
    /// The payload schema version (absent: 1).
    #[serde(default)]
    pub schema_version: Option<u32>,
    /// Trace context, correlation id, and the application's own headers (every name not in
    /// [`crate::headers::RESERVED_NAMES`] / [`crate::headers::RESERVED_PREFIXES`]).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// The payload, as the producer wrote it.
    #[serde(borrow)]
    pub payload: &'a RawValue,
}

/// Parses and checks a delivery body. The message of an error says what is wrong (the request is refused
/// permanently: a body QStash signed cannot be repaired by retrying).
pub fn parse_envelope(body: &[u8]) -> Result<Envelope<'_>, String> {
    let env: Envelope<'_> = serde_json::from_slice(body)
        .map_err(|e| format!("the body is not a contract-{CONTRACT_VERSION} envelope: {e}"))?;
    if env.contract != CONTRACT_VERSION {
        return Err(format!(
            "the envelope says contract {} but the URL says {CONTRACT_VERSION}",
            env.contract
        ));
    }
    if env.events.is_empty() {
        return Err("the envelope holds no event".into());
    }
    for e in &env.events {
        if e.id.get() <= 0 {
            return Err(format!("event id {} is not positive", e.id));
        }
        // A copy is written after the event's first copy, so its event id is never above its own.
        if let Some(event) = e.event
            && (event.get() <= 0 || event > e.id)
        {
            return Err(format!(
                "event {} names event {event} as the one it copies, which must be positive and not above its own id",
                e.id
            ));
        }
        if e.key.is_empty() {
            return Err(format!("event {} has an empty partition key", e.id));
        }
        if e.seq.is_some_and(|s| s <= 0) {
            return Err(format!("event {} has a sequence below 1", e.id));
        }
        if e.schema_version == Some(0) {
            return Err(format!("event {} has schema version 0", e.id));
        }
    }
    check_batch_shape(&env.events)?;
    Ok(env)
}

/// The batch rules of the module table (a single event always passes).
fn check_batch_shape(events: &[EnvelopeEvent<'_>]) -> Result<(), String> {
    let k = events.len();
    if k > MAX_BATCH_EVENTS {
        return Err(format!(
            "the envelope holds {k} events; a batch holds at most {MAX_BATCH_EVENTS}"
        ));
    }
    let Some(first) = events.first() else {
        return Ok(());
    };
    let mut seen = std::collections::HashSet::with_capacity(k);
    for e in events {
        if !seen.insert(e.id) {
            return Err(format!("event id {} appears twice in the batch", e.id));
        }
    }
    let ordered = first.seq.is_some();
    for (i, e) in events.iter().enumerate().skip(1) {
        match (first.seq, e.seq) {
            (None, None) => {}
            (Some(s0), Some(s)) => {
                if e.key != first.key {
                    return Err(format!(
                        "ordered batch mixes partition keys: event {} has key {:?}, event {} has key {:?}",
                        first.id,
                        first.key.chars().take(100).collect::<String>(),
                        e.id,
                        e.key.chars().take(100).collect::<String>()
                    ));
                }
                let want = i64::try_from(i).ok().and_then(|i| s0.checked_add(i));
                if want != Some(s) {
                    return Err(format!(
                        "ordered batch is not consecutive: event {} (position {}) has sequence {s}, expected {}",
                        e.id,
                        i + 1,
                        want.map(|w| w.to_string())
                            .unwrap_or_else(|| "overflow".into())
                    ));
                }
            }
            _ => {
                return Err(format!(
                    "batch mixes ordered and unordered events: event {} has {} sequence, event {} has {}",
                    first.id,
                    if ordered { "a" } else { "no" },
                    e.id,
                    if e.seq.is_some() { "one" } else { "none" }
                ));
            }
        }
    }
    Ok(())
}

/// The informational `x-outbox-id` copy of a message of `ids`: the id for one event, the ids joined by `,` (no
/// spaces) for a batch. Receivers compare it with the signed envelope's ids.
pub fn id_copy(ids: impl IntoIterator<Item = OutboxId>) -> String {
    let mut out = String::new();
    for (i, id) in ids.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&id.to_string());
    }
    out
}

/// One event as the relay writes it.
#[derive(Debug, Clone, Copy)]
pub struct WireEvent<'a> {
    /// Outbox id (of this copy).
    pub id: OutboxId,
    /// The event it is a copy of (written as `event` when it differs from `id`).
    pub event_id: OutboxId,
    /// Partition key.
    pub key: &'a str,
    /// Per-key sequence.
    pub seq: Option<i64>,
    pub created_at: DateTime<Utc>,
    pub schema_version: Option<u32>,
    /// Headers `(name, value)`.
    pub headers: &'a [(&'a str, &'a str)],
    /// The payload: JSON text as Postgres rendered the `jsonb` value (trusted, written as is).
    pub payload: &'a str,
    /// Sent again on purpose (a redrive, a reconciler's republish, a replay): written as `"resent":true`.
    pub resent: bool,
}

/// Writes a delivery body ([`Envelope`]): `subscriber` is the named subscriber the copy is for (`None` for the
/// default one). The payload is trusted JSON (from a `jsonb` column) and copied as is; every string is escaped by
/// serde_json.
pub fn write_envelope(
    topic: &str,
    subscriber: Option<&str>,
    evidence: Option<Evidence>,
    events: &[WireEvent<'_>],
) -> String {
    let size: usize = events.iter().map(|e| e.payload.len() + 160).sum();
    let mut out: Vec<u8> = Vec::with_capacity(size + 64);
    out.extend_from_slice(b"{\"contract\":");
    out.extend_from_slice(CONTRACT_VERSION.to_string().as_bytes());
    out.extend_from_slice(b",\"topic\":");
    json_str(&mut out, topic);
    if let Some(s) = subscriber {
        out.extend_from_slice(b",\"subscriber\":");
        json_str(&mut out, s);
    }
    if let Some(ev) = evidence {
        out.extend_from_slice(b",\"evidence\":\"");
        out.extend_from_slice(ev.as_str().as_bytes());
        out.push(b'"');
    }
    out.extend_from_slice(b",\"events\":[");
    for (i, e) in events.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"id\":");
        out.extend_from_slice(e.id.to_string().as_bytes());
        if e.event_id != e.id {
            out.extend_from_slice(b",\"event\":");
            out.extend_from_slice(e.event_id.to_string().as_bytes());
        }
        if e.resent {
            out.extend_from_slice(b",\"resent\":true");
        }
        out.extend_from_slice(b",\"key\":");
        json_str(&mut out, e.key);
        if let Some(seq) = e.seq {
            out.extend_from_slice(b",\"seq\":");
            out.extend_from_slice(seq.to_string().as_bytes());
        }
        out.extend_from_slice(b",\"created_at\":\"");
        out.extend_from_slice(
            e.created_at
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
                .as_bytes(),
        );
        out.push(b'"');
        if let Some(v) = e.schema_version {
            out.extend_from_slice(b",\"schema_version\":");
            out.extend_from_slice(v.to_string().as_bytes());
        }
        if !e.headers.is_empty() {
            out.extend_from_slice(b",\"headers\":{");
            for (j, (name, value)) in e.headers.iter().enumerate() {
                if j > 0 {
                    out.push(b',');
                }
                json_str(&mut out, name);
                out.push(b':');
                json_str(&mut out, value);
            }
            out.push(b'}');
        }
        out.extend_from_slice(b",\"payload\":");
        out.extend_from_slice(e.payload.as_bytes());
        out.push(b'}');
    }
    out.extend_from_slice(b"]}");
    // Every piece is UTF-8 (escaped strings, digits, the payload text), so this never replaces anything.
    String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

fn json_str(out: &mut Vec<u8>, s: &str) {
    // Writing a `&str` into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// QStash's deduplication id for an event: `outbox-<id>`, and `outbox-<id>-r<n>` once it was published again on
/// purpose n times (redrives plus the reconciler's republishes, decision record 0015: such a publish must not be
/// swallowed by QStash's dedup window). Never contains `:` (QStash rejects it).
pub fn dedup_id(outbox_id: OutboxId, generation: i32) -> String {
    if generation > 0 {
        format!("outbox-{outbox_id}-r{generation}")
    } else {
        format!("outbox-{outbox_id}")
    }
}

/// QStash's deduplication id for a message carrying `events` (`(outbox id, generation: see [`dedup_id`])`, in message order;
/// decision record 0014). One event: exactly [`dedup_id`]. More: `outbox-b<first id>-<k>-<16 hex chars of
/// SHA-256 over "id:generation," of every event in order>`, so the same composition formed again (after a
/// crash between publish and settle) gets the same id and QStash drops the copy, while a different composition
/// gets a different id (the consumer's per-event dedupe absorbs the overlap). Never contains `:`.
pub(crate) fn batch_dedup_id(events: &[(OutboxId, i32)]) -> String {
    use sha2::{Digest, Sha256};
    match events {
        [] => String::new(),
        [(id, redrive)] => dedup_id(*id, *redrive),
        [(first, _), ..] => {
            let mut h = Sha256::new();
            for (id, redrive) in events {
                h.update(format!("{id}:{redrive},").as_bytes());
            }
            let digest = h.finalize();
            let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
            format!("outbox-b{first}-{}-{hex}", events.len())
        }
    }
}

/// Percent-encodes a partition key for an HTTP header value (the legacy `x-outbox-key` header).
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // for `crate::internals`
pub fn encode_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Decodes [`encode_key`]; `None` for malformed input or non-UTF-8 results.
pub(crate) fn decode_key(encoded: &str) -> Option<String> {
    let bytes = encoded.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = encoded.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip() {
        for k in ["plain", "a b/c:d", "ünïcødé", "100%", "x\u{1F600}y"] {
            let e = encode_key(k);
            assert!(e.bytes().all(|b| b.is_ascii_graphic()), "{e}");
            assert_eq!(decode_key(&e).as_deref(), Some(k));
        }
        assert_eq!(decode_key("%zz"), None);
        assert_eq!(decode_key("%4"), None);
    }

    #[test]
    fn batch_dedup_ids_follow_the_composition() {
        assert_eq!(
            batch_dedup_id(&[(OutboxId(42), 3)]),
            dedup_id(OutboxId(42), 3)
        );
        let a = batch_dedup_id(&[(OutboxId(41), 0), (OutboxId(42), 0), (OutboxId(43), 0)]);
        assert!(a.starts_with("outbox-b41-3-"), "{a}");
        assert_eq!(a.len(), "outbox-b41-3-".len() + 16);
        assert!(!a.contains(':'));
        assert_eq!(
            a,
            batch_dedup_id(&[(OutboxId(41), 0), (OutboxId(42), 0), (OutboxId(43), 0)])
        );
        assert_ne!(a, batch_dedup_id(&[(OutboxId(41), 0), (OutboxId(42), 0)]));
        assert_ne!(
            a,
            batch_dedup_id(&[(OutboxId(41), 0), (OutboxId(42), 1), (OutboxId(43), 0)])
        );
        assert_ne!(
            a,
            batch_dedup_id(&[(OutboxId(41), 0), (OutboxId(43), 0), (OutboxId(42), 0)])
        );
        assert_eq!(
            id_copy([OutboxId(41), OutboxId(42), OutboxId(43)]),
            "41,42,43"
        );
        assert_eq!(id_copy([OutboxId(7)]), "7");
    }

    #[test]
    fn dedup_ids_never_contain_colons() {
        assert_eq!(dedup_id(OutboxId(42), 0), "outbox-42");
        assert_eq!(dedup_id(OutboxId(42), 3), "outbox-42-r3");
    }

    #[test]
    fn the_contract_version_comes_from_the_query() {
        assert_eq!(contract_of_query(None), Ok(Contract::Legacy));
        assert_eq!(contract_of_query(Some("")), Ok(Contract::Legacy));
        assert_eq!(contract_of_query(Some("a=1")), Ok(Contract::Legacy));
        assert_eq!(contract_of_query(Some("contract=2")), Ok(Contract::Current));
        assert_eq!(
            contract_of_query(Some("x=1&contract=2")),
            Ok(Contract::Current)
        );
        assert_eq!(
            contract_of_query(Some("contract=7")),
            Ok(Contract::Newer(7))
        );
        assert!(contract_of_query(Some("contract=1")).is_err());
        assert!(contract_of_query(Some("contract=")).is_err());
        assert!(contract_of_query(Some("contract=2&contract=2")).is_err());
        assert_eq!(
            destination("https://c.example/", "invoices"),
            "https://c.example/events/invoices?contract=2"
        );
    }

    #[test]
    fn what_the_relay_writes_the_consumer_reads_back() {
        let created = DateTime::parse_from_rfc3339("2026-11-30T12:00:00.123456Z")
            .unwrap()
            .with_timezone(&Utc);
        let odd_key = "k \"quoted\" \\ \u{1b}[31m ü \u{202e} \n";
        let headers = [
            (TRACEPARENT, "00-x"),
            (CORRELATION_ID, "c\"1"),
            ("tenant", "ac\"me ü"),
        ];
        let body = write_envelope(
            "invoices",
            Some("billing"),
            Some(Evidence::Consumer),
            &[WireEvent {
                id: OutboxId(42),
                event_id: OutboxId(40),
                key: odd_key,
                seq: Some(3),
                created_at: created,
                schema_version: Some(2),
                headers: &headers,
                payload: r#"{"a": [1, 2, {"b": "ü\n"}]}"#,
                resent: true,
            }],
        );
        let env = parse_envelope(body.as_bytes()).unwrap();
        assert_eq!(env.topic, "invoices");
        assert_eq!(env.subscriber.as_deref(), Some("billing"));
        assert_eq!(env.evidence, Some(Evidence::Consumer));
        let e = &env.events[0];
        assert_eq!(
            (e.id, e.event, e.key.as_str(), e.seq),
            (OutboxId(42), Some(OutboxId(40)), odd_key, Some(3))
        );
        assert_eq!(e.created_at, Some(created));
        assert_eq!(e.schema_version, Some(2));
        assert!(e.resent);
        assert_eq!(
            e.headers.get(CORRELATION_ID).map(String::as_str),
            Some("c\"1")
        );
        assert_eq!(
            e.headers.get("tenant").map(String::as_str),
            Some("ac\"me ü")
        );
        assert_eq!(e.payload.get(), r#"{"a": [1, 2, {"b": "ü\n"}]}"#);

        let bare = write_envelope(
            "notifications",
            None,
            None,
            &[WireEvent {
                id: OutboxId(1),
                event_id: OutboxId(1),
                key: "k",
                seq: None,
                created_at: created,
                schema_version: None,
                headers: &[],
                payload: "{}",
                resent: false,
            }],
        );
        let env = parse_envelope(bare.as_bytes()).unwrap();
        assert!(!env.events[0].resent && !bare.contains("resent"), "{bare}");
        assert_eq!(env.subscriber, None);
        assert!(!bare.contains("subscriber"), "{bare}");
        assert_eq!(
            env.events[0].event, None,
            "a first copy names no event: {bare}"
        );
        assert_eq!(env.evidence, None);
        assert_eq!(env.events[0].seq, None);
        assert!(env.events[0].headers.is_empty());
    }

    #[test]
    fn batches_of_the_agreed_shape_are_read() {
        let ok = [
            &br#"{"contract":2,"topic":"t","events":[{"id":5,"key":"a","payload":{}},{"id":3,"key":"b","payload":1}]}"#[..],
            br#"{"contract":2,"topic":"t","evidence":"consumer","events":[{"id":7,"key":"k","seq":4,"payload":{}},{"id":9,"key":"k","seq":5,"payload":{}},{"id":8,"key":"k","seq":6,"payload":{}}]}"#,
        ];
        for body in ok {
            let env = parse_envelope(body).unwrap();
            assert!(env.events.len() > 1);
        }
        let mut big = String::from(r#"{"contract":2,"topic":"t","events":["#);
        for id in 1..=1001 {
            if id > 1 {
                big.push(',');
            }
            big.push_str(&format!(r#"{{"id":{id},"key":"k","payload":{{}}}}"#));
        }
        big.push_str("]}");
        let err = parse_envelope(big.as_bytes()).unwrap_err();
        assert!(err.contains("at most 1000"), "{err}");
        assert_eq!(id_copy([OutboxId(41)]), "41");
        assert_eq!(
            id_copy([OutboxId(41), OutboxId(42), OutboxId(43)]),
            "41,42,43"
        );
    }

    #[test]
    fn bad_envelopes_are_named() {
        for (body, want) in [
            (&b"not json"[..], "not a contract-2 envelope"),
            (
                br#"{"contract":3,"topic":"t","events":[]}"#,
                "says contract 3",
            ),
            (br#"{"contract":2,"topic":"t","events":[]}"#, "no event"),
            (
                br#"{"contract":2,"topic":"t","events":[{"id":0,"key":"k","payload":{}}]}"#,
                "not positive",
            ),
            (
                br#"{"contract":2,"topic":"t","events":[{"id":1,"key":"","payload":{}}]}"#,
                "empty partition key",
            ),
            (
                br#"{"contract":2,"topic":"t","events":[{"id":1,"key":"k","seq":0,"payload":{}}]}"#,
                "sequence below 1",
            ),
            (
                br#"{"contract":2,"topic":"t","events":[{"id":1,"key":"k"}]}"#,
                "missing field `payload`",
            ),
            (
                br#"{"contract":2,"topic":"t","evidence":"carrier-pigeon","events":[]}"#,
                "unknown variant",
            ),
            (
                br#"{"contract":2,"topic":"t","events":[{"id":1,"key":"k","payload":{}},{"id":1,"key":"k","payload":{}}]}"#,
                "appears twice",
            ),
            (
                br#"{"contract":2,"topic":"t","events":[{"id":1,"key":"k","seq":1,"payload":{}},{"id":2,"key":"j","seq":2,"payload":{}}]}"#,
                "mixes partition keys",
            ),
            (
                br#"{"contract":2,"topic":"t","events":[{"id":1,"key":"k","seq":1,"payload":{}},{"id":2,"key":"k","seq":3,"payload":{}}]}"#,
                "not consecutive",
            ),
            (
                br#"{"contract":2,"topic":"t","events":[{"id":2,"key":"k","seq":2,"payload":{}},{"id":1,"key":"k","seq":1,"payload":{}}]}"#,
                "not consecutive",
            ),
            (
                br#"{"contract":2,"topic":"t","events":[{"id":1,"key":"k","seq":1,"payload":{}},{"id":2,"key":"k","payload":{}}]}"#,
                "mixes ordered and unordered",
            ),
            (
                br#"{"contract":2,"topic":"t","events":[{"id":1,"key":"k","payload":{}},{"id":2,"key":"k","seq":2,"payload":{}}]}"#,
                "mixes ordered and unordered",
            ),
        ] {
            let err = parse_envelope(body).unwrap_err();
            assert!(err.contains(want), "{err}");
        }
    }
}
