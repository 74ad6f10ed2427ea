//! The producer API — guarantee 1, **no event is lost at write time**: an event exists if and only if the
//! business transaction that wrote it committed.
//!
//! Call [`enqueue`] / [`enqueue_batch`] (or the [`Producer`] methods) with the caller's own transaction:
//!
//! ```no_run
//! # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox::producer::{enqueue, NewEvent, Topic};
//! const INVOICES: Topic = Topic::ordered("invoices");
//! let mut tx = pool.begin().await?;
//! sqlx::query("INSERT INTO invoices (id) VALUES (42)").execute(&mut *tx).await?;
//! enqueue(&mut tx, NewEvent::new(&INVOICES, "customer-7", &serde_json::json!({"invoice_id": 42}))?).await?;
//! tx.commit().await?; // the invoice and its event commit together, or neither does
//! # Ok(()) }
//! ```
//!
//! Each call is **one SQL statement**, so an invalid or failing batch writes nothing, whether or not the caller
//! is inside a transaction. Input is validated before anything is sent: an empty topic or key, an oversized
//! payload, a payload that is not JSON (or holds `\u0000`, which `jsonb` rejects) or a malformed header is an
//! [`InvalidEvent`] naming the event's index.
//!
//! An event can carry the application's own metadata as headers ([`NewEvent::header`]: a tenant, a causation
//! id, …); the handler reads them with [`crate::consumer::Event::header`]. Their rules are in
//! [`crate::headers`].
//!
//! Ordered topics allocate a per-key sequence in the same statement; see [`crate::ordering`] for why the
//! sequence follows commit order.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;
use sqlx::{PgConnection, Row};

use crate::db::Statements;
use crate::ids::OutboxId;

// Lives with the header rules it names, so that `headers` need not know the producer; re-exported here.
use crate::headers::InvalidEvent;
use crate::telemetry::spans::{Creating, is_traceparent};

/// Payload limit by default: QStash's smallest plan accepts 1 MB messages.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1_000_000;
/// Longest partition key accepted (it becomes part of HTTP headers and a flow-control key).
pub(crate) const MAX_KEY_BYTES: usize = 512;
/// Longest delay accepted.
pub(crate) const MAX_DELAY: Duration = Duration::from_secs(365 * 24 * 3600);

/// Whether a topic keeps per-key order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopicOrdering {
    /// Events may be delivered in any order (highest throughput).
    Unordered,
    /// Events of one partition key are applied in commit order (see [`crate::ordering`]).
    PerKey,
}

/// A topic and its ordering mode, usually declared once as a constant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topic {
    name: Cow<'static, str>,
    ordering: TopicOrdering,
}

impl Topic {
    /// An unordered topic.
    pub const fn unordered(name: &'static str) -> Topic {
        Topic {
            name: Cow::Borrowed(name),
            ordering: TopicOrdering::Unordered,
        }
    }

    /// A topic ordered per partition key.
    pub const fn ordered(name: &'static str) -> Topic {
        Topic {
            name: Cow::Borrowed(name),
            ordering: TopicOrdering::PerKey,
        }
    }

    /// A topic named at run time.
    pub fn new(name: impl Into<String>, ordering: TopicOrdering) -> Topic {
        Topic {
            name: Cow::Owned(name.into()),
            ordering,
        }
    }

    /// The topic name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The ordering mode.
    pub fn ordering(&self) -> TopicOrdering {
        self.ordering
    }
}

/// Checks a topic name: 1–100 characters of `A-Z a-z 0-9 . _ -` (it becomes a URL path segment).
pub(crate) fn validate_topic(name: &str) -> Result<(), InvalidEvent> {
    if name.is_empty() {
        return Err(InvalidEvent::EmptyTopic);
    }
    if crate::ids::is_topic_name(name) {
        Ok(())
    } else {
        Err(InvalidEvent::InvalidTopic(name.chars().take(120).collect()))
    }
}

/// Metadata carried with an event to the consumer, stored as the outbox row's `headers` (`jsonb`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct EventHeaders {
    /// W3C trace context of the producing span (`traceparent`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub traceparent: Option<String>,
    /// Correlation id (e.g. the request id that caused the event).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub correlation_id: Option<String>,
    /// Schema version of the payload (≥ 1).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub schema_version: Option<u32>,
    /// The application's own headers ([`NewEvent::header`]), by lower-case name. Kept apart from the fields
    /// above (stored under `user`), so a row written before they existed reads as "none".
    #[serde(skip_serializing_if = "BTreeMap::is_empty", default)]
    pub user: BTreeMap<String, String>,
}

impl EventHeaders {
    fn validate(&self) -> Result<(), InvalidEvent> {
        if let Some(tp) = &self.traceparent
            && !is_traceparent(tp)
        {
            return Err(InvalidEvent::InvalidHeader {
                name: "traceparent",
                reason: "expected W3C format 00-<32 hex>-<16 hex>-<2 hex>".into(),
            });
        }
        if let Some(id) = &self.correlation_id
            && (id.is_empty() || id.len() > 256 || !id.bytes().all(|b| (0x21..=0x7e).contains(&b)))
        {
            return Err(InvalidEvent::InvalidHeader {
                name: "correlation_id",
                reason: "expected 1–256 visible ASCII characters".into(),
            });
        }
        if self.schema_version == Some(0) {
            return Err(InvalidEvent::InvalidHeader {
                name: "schema_version",
                reason: "versions start at 1".into(),
            });
        }
        Ok(())
    }
}

/// An event's payload as it was given; [`NewEvent::validated`] decides whether it is JSON.
#[derive(Debug, Clone)]
enum Payload {
    /// Serialised by `serde_json` from a typed value ([`NewEvent::new`]): JSON by construction.
    Serialized(String),
    /// Text the caller says is JSON ([`NewEvent::from_json`], [`NewEvent::from_json_bytes`]): parsed when
    /// enqueued.
    Unchecked(String),
    /// Bytes that are not UTF-8 ([`NewEvent::from_json_bytes`]), so not JSON text: refused when enqueued.
    NotUtf8 {
        /// How many leading bytes are valid UTF-8.
        valid_up_to: usize,
    },
}

/// One event to write.
#[derive(Debug, Clone)]
pub struct NewEvent {
    topic: String,
    ordering: TopicOrdering,
    key: String,
    payload: Payload,
    headers: EventHeaders,
    /// [`NewEvent::header`] calls in order, checked when enqueued.
    user_headers: Vec<(String, String)>,
    delay: Option<Duration>,
    /// [`NewEvent::fairness_key`]; `None`: no key (`''` in the outbox).
    fairness_key: Option<String>,
}

impl NewEvent {
    /// An event with a typed payload serialised to JSON.
    pub fn new<T: Serialize + ?Sized>(
        topic: &Topic,
        key: impl Into<String>,
        payload: &T,
    ) -> Result<Self, EnqueueError> {
        let json = serde_json::to_string(payload).map_err(EnqueueError::Serialize)?;
        Ok(Self::build(topic, key.into(), Payload::Serialized(json)))
    }

    /// An event whose payload is already JSON text; it is checked when enqueued.
    pub fn from_json(topic: &Topic, key: impl Into<String>, json: impl Into<String>) -> Self {
        Self::build(topic, key.into(), Payload::Unchecked(json.into()))
    }

    /// An event whose payload is raw bytes that must be UTF-8 JSON; checked when enqueued. Bytes that are not
    /// UTF-8 are refused ([`InvalidEvent::NotUtf8`]), never repaired: replacing them would store a payload the
    /// producer did not write.
    pub fn from_json_bytes(topic: &Topic, key: impl Into<String>, bytes: &[u8]) -> Self {
        let payload = match std::str::from_utf8(bytes) {
            Ok(text) => Payload::Unchecked(text.to_owned()),
            Err(e) => Payload::NotUtf8 {
                valid_up_to: e.valid_up_to(),
            },
        };
        Self::build(topic, key.into(), payload)
    }

    fn build(topic: &Topic, key: String, payload: Payload) -> Self {
        NewEvent {
            topic: topic.name().to_owned(),
            ordering: topic.ordering(),
            key,
            payload,
            headers: EventHeaders::default(),
            user_headers: Vec::new(),
            delay: None,
            fairness_key: None,
        }
    }

    /// Sets the W3C `traceparent` forwarded to the consumer.
    pub fn traceparent(mut self, traceparent: impl Into<String>) -> Self {
        self.headers.traceparent = Some(traceparent.into());
        self
    }

    /// Sets the correlation id forwarded to the consumer.
    pub fn correlation_id(mut self, id: impl Into<String>) -> Self {
        self.headers.correlation_id = Some(id.into());
        self
    }

    /// Sets the payload schema version (≥ 1).
    pub fn schema_version(mut self, version: u32) -> Self {
        self.headers.schema_version = Some(version);
        self
    }

    /// Attaches one of the application's own headers (a tenant, a causation id, the payload's media type, …):
    /// it travels inside the signed delivery and the handler reads it with
    /// [`crate::consumer::Event::header`], so it may decide things there. The name is case-insensitive (stored
    /// lower-cased). Checked when enqueued against the rules in [`crate::headers`]: names the pipeline owns
    /// (`x-outbox-*`, `upstash-*`, `traceparent`, `content-type`, …) are refused, never overridden, and so is a
    /// name set twice.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.user_headers.push((name.into(), value.into()));
        self
    }

    /// Names who the event belongs to for fairness (a tenant, an account): the relay shares each claim among the
    /// keys with waiting events, so one key's flood does not delay the others (decision record 0076), an operator
    /// can pause one key, and a topic can give each key its own rate at QStash. The consumer reads it with
    /// [`crate::consumer::Event::fairness_key`]. 1–64 characters of `A-Z a-z 0-9 . _ - :`, checked when
    /// enqueued ([`InvalidEvent::InvalidFairnessKey`]). Without one the event shares the "no key" group with every
    /// other such event, as before fairness keys existed.
    pub fn fairness_key(mut self, key: impl Into<String>) -> Self {
        self.fairness_key = Some(key.into());
        self
    }

    /// Delays the first publish. For an ordered topic the delay holds back the key's later events too.
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = Some(delay);
        self
    }

    fn validated(&self, max_payload: usize) -> Result<String, InvalidEvent> {
        validate_topic(&self.topic)?;
        if self.key.is_empty() {
            return Err(InvalidEvent::EmptyKey);
        }
        if self.key.len() > MAX_KEY_BYTES {
            return Err(InvalidEvent::KeyTooLong {
                len: self.key.len(),
                max: MAX_KEY_BYTES,
            });
        }
        if self.key.contains(['\0', '\r', '\n']) {
            return Err(InvalidEvent::InvalidHeader {
                name: "partition_key",
                reason: "must not contain NUL, CR or LF".into(),
            });
        }
        let json = match &self.payload {
            Payload::Serialized(json) => json.clone(),
            Payload::Unchecked(text) => {
                if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(text) {
                    return Err(InvalidEvent::NotJson(e.to_string()));
                }
                text.clone()
            }
            Payload::NotUtf8 { valid_up_to } => {
                return Err(InvalidEvent::NotUtf8 {
                    valid_up_to: *valid_up_to,
                });
            }
        };
        if json.len() > max_payload {
            return Err(InvalidEvent::PayloadTooLarge {
                size: json.len(),
                max: max_payload,
            });
        }
        if json.contains("\\u0000") {
            return Err(InvalidEvent::NulInPayload);
        }
        self.headers.validate()?;
        if let Some(k) = &self.fairness_key {
            crate::headers::validate_fairness_key(k)?;
        }
        if let Some(d) = self.delay
            && d > MAX_DELAY
        {
            return Err(InvalidEvent::DelayTooLong(d));
        }
        Ok(json)
    }
}

/// What was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnqueuedEvent {
    /// The outbox id (the consumer's dedupe key).
    pub id: OutboxId,
    /// The per-key sequence, for ordered topics.
    pub seq: Option<i64>,
}

/// An enqueue failure. Nothing was written in any case.
#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    /// An event failed validation.
    #[error("{}: {problem}", match .index { Some(i) => format!("event #{i} rejected"), None => "event rejected".to_owned() })]
    Invalid {
        /// Its position in the batch (`None` for a single enqueue).
        index: Option<usize>,
        problem: InvalidEvent,
    },
    /// A typed payload could not be serialised.
    #[error("could not serialise the payload to JSON")]
    Serialize(#[source] serde_json::Error),
    /// The database rejected the statement (the caller's transaction is then aborted, as always in Postgres).
    #[error("database error while enqueueing")]
    Database(#[from] sqlx::Error),
}

impl EnqueueError {
    /// The validation problem, if that was the cause.
    pub fn invalid(&self) -> Option<&InvalidEvent> {
        match self {
            EnqueueError::Invalid { problem, .. } => Some(problem),
            _ => None,
        }
    }
}

/// Producer settings. [`Producer::default`] suits most callers.
#[derive(Debug, Clone)]
pub struct Producer {
    max_payload_bytes: usize,
    statements: Statements,
    notify: bool,
}

impl Default for Producer {
    fn default() -> Self {
        Producer {
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            statements: Statements::Prepared,
            notify: false,
        }
    }
}

/// The channel of the optional wake-up hint (off by default; `docs/configuration.md` says why).
pub(crate) const NOTIFY_CHANNEL: &str = "outbox_new";

const ENQUEUE_SQL: &str = r#"
WITH input AS (
    SELECT t.ord, t.topic, t.partition_key, t.ordered, t.payload, t.headers, t.delay_secs, t.fairness_key
    FROM unnest($1::text[], $2::text[], $3::bool[], $4::text[], $5::text[], $6::float8[], $7::text[])
         WITH ORDINALITY AS t(topic, partition_key, ordered, payload, headers, delay_secs, fairness_key, ord)
),
-- Fan-out (decision record 0068): every subscriber of each topic gets a copy of the event. The named subscribers
-- not removed, and the default one ('') unless it was removed; a replaying subscriber's new keys wait for the
-- replay ('infinity').
subs AS (
    SELECT t.topic, s.name, s.replaying
    FROM (SELECT DISTINCT topic FROM input) t
    CROSS JOIN LATERAL (
        SELECT x.name, (x.replay_from IS NOT NULL AND x.replay_done_at IS NULL) AS replaying
        FROM {schema}.outbox_subscribers x WHERE x.topic = t.topic AND x.removed_at IS NULL
        UNION ALL
        SELECT '', false
        WHERE NOT EXISTS (SELECT 1 FROM {schema}.outbox_subscribers x WHERE x.topic = t.topic AND x.name = '')
    ) s
),
first_sub AS (
    SELECT t.topic, coalesce((SELECT min(s.name) FROM subs s WHERE s.topic = t.topic), '') AS name
    FROM (SELECT DISTINCT topic FROM input) t
),
counts AS (
    SELECT topic, partition_key, count(*) AS n
    FROM input WHERE ordered
    GROUP BY topic, partition_key
),
-- Ordered topics: take the next sequence numbers under the key's row lock, held until commit (crate::ordering).
alloc AS (
    INSERT INTO {schema}.outbox_sequences AS s (topic, partition_key, last_seq)
    SELECT topic, partition_key, n FROM counts ORDER BY topic, partition_key
    ON CONFLICT (topic, partition_key) DO UPDATE SET last_seq = s.last_seq + excluded.last_seq
    RETURNING s.topic, s.partition_key, s.last_seq
),
first_seq AS (
    SELECT a.topic, a.partition_key, a.last_seq - c.n AS before_seq
    FROM alloc a JOIN counts c USING (topic, partition_key)
),
-- Re-activate an idle key for the relay, once per subscriber; an active key row is left alone (never locked by
-- producers).
activate AS (
    INSERT INTO {schema}.outbox_keys (topic, partition_key, subscriber, done_seq, available_at)
    SELECT f.topic, f.partition_key, s.name, f.before_seq,
           CASE WHEN s.replaying THEN 'infinity'::timestamptz ELSE now() END
    FROM first_seq f JOIN subs s USING (topic)
    ORDER BY f.topic, f.partition_key, s.name
    ON CONFLICT (topic, partition_key, subscriber) DO NOTHING
),
events AS (
    SELECT i.ord, i.topic, i.partition_key,
           CASE WHEN i.ordered THEN f.before_seq
                + row_number() OVER (PARTITION BY i.topic, i.partition_key, i.ordered ORDER BY i.ord) END AS seq,
           i.payload::jsonb AS payload, i.headers::jsonb AS headers, i.fairness_key,
           -- A paused tenant's unordered events wait at 'infinity' until resumed (crate::ops::fairness).
           CASE WHEN NOT i.ordered AND i.fairness_key <> '' AND EXISTS (
                    SELECT 1 FROM {schema}.outbox_paused_keys p WHERE p.fairness_key = i.fairness_key)
                THEN 'infinity'::timestamptz
                ELSE now() + make_interval(secs => i.delay_secs) END AS available_at
    FROM input i
    LEFT JOIN first_seq f ON i.ordered AND f.topic = i.topic AND f.partition_key = i.partition_key
),
-- The first subscriber's copy is the event: its id is the event's id.
firsts AS (
    INSERT INTO {schema}.outbox (topic, partition_key, subscriber, seq, payload, headers, available_at, fairness_key)
    SELECT e.topic, e.partition_key, fs.name, e.seq, e.payload, e.headers, e.available_at, e.fairness_key
    FROM events e JOIN first_sub fs USING (topic)
    ORDER BY e.ord
    RETURNING id, seq
),
-- Identity values are drawn in insertion order, which follows the input order: the n-th id is input n's.
numbered AS (
    SELECT id, seq, row_number() OVER (ORDER BY id) AS ord FROM firsts
),
copies AS (
    INSERT INTO {schema}.outbox (topic, partition_key, subscriber, seq, payload, headers, available_at, event_id,
                                 fairness_key)
    SELECT e.topic, e.partition_key, s.name, e.seq, e.payload, e.headers, e.available_at, n.id, e.fairness_key
    FROM events e
    JOIN numbered n ON n.ord = e.ord
    JOIN first_sub fs ON fs.topic = e.topic
    JOIN subs s ON s.topic = e.topic AND s.name <> fs.name
    ORDER BY e.ord, s.name
)
SELECT id, seq FROM numbered
"#;

impl Producer {
    /// Default settings.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the payload limit in bytes of JSON text.
    pub fn max_payload_bytes(mut self, max: usize) -> Self {
        self.max_payload_bytes = max;
        self
    }

    /// Named prepared statements ([`Statements::Prepared`], the default) or unnamed ones (behind RDS Proxy /
    /// PgBouncer transaction mode): pass the mode of the pool the connection comes from ([`crate::db::Db::statements`]).
    pub fn statements(mut self, statements: Statements) -> Self {
        self.statements = statements;
        self
    }

    /// Also sends `NOTIFY outbox_new` (delivered at commit) as a wake-up hint for a listening relay.
    pub fn notify(mut self, notify: bool) -> Self {
        self.notify = notify;
        self
    }

    /// Writes one event in the caller's transaction (or connection).
    pub async fn enqueue(
        &self,
        conn: &mut PgConnection,
        event: NewEvent,
    ) -> Result<EnqueuedEvent, EnqueueError> {
        let caller = opentelemetry::Context::current();
        let mut out = self
            .write(conn, std::slice::from_ref(&event), false, &caller)
            .await?;
        out.pop()
            .ok_or(EnqueueError::Database(sqlx::Error::RowNotFound))
    }

    /// Writes many events in one statement: all or nothing.
    pub async fn enqueue_batch(
        &self,
        conn: &mut PgConnection,
        events: &[NewEvent],
    ) -> Result<Vec<EnqueuedEvent>, EnqueueError> {
        let caller = opentelemetry::Context::current();
        self.write(conn, events, true, &caller).await
    }

    #[tracing::instrument(name = "outbox.enqueue", skip_all, fields(events = events.len()))]
    async fn write(
        &self,
        conn: &mut PgConnection,
        events: &[NewEvent],
        batch: bool,
        caller: &opentelemetry::Context,
    ) -> Result<Vec<EnqueuedEvent>, EnqueueError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        // The messaging `create` spans (their context is what the event carries), when tracing is on.
        let creating = Creating::start(
            caller,
            events
                .iter()
                .map(|e| (e.topic.as_str(), e.headers.traceparent.as_deref())),
        );
        let written = self.write_traced(conn, events, batch, &creating).await;
        match &written {
            Ok(out) => creating.end(Ok(&out.iter().map(|e| e.id.get()).collect::<Vec<_>>())),
            Err(e) => creating.end(Err(e)),
        }
        written
    }

    async fn write_traced(
        &self,
        conn: &mut PgConnection,
        events: &[NewEvent],
        batch: bool,
        creating: &Creating,
    ) -> Result<Vec<EnqueuedEvent>, EnqueueError> {
        let n = events.len();
        let mut fairness: Vec<&str> = Vec::with_capacity(n);
        let (mut topics, mut keys, mut ordered, mut payloads, mut headers, mut delays) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for (i, e) in events.iter().enumerate() {
            let invalid = |problem| EnqueueError::Invalid {
                index: batch.then_some(i),
                problem,
            };
            let json = e.validated(self.max_payload_bytes).map_err(invalid)?;
            let user = crate::headers::validate(&e.user_headers).map_err(invalid)?;
            topics.push(e.topic.as_str());
            keys.push(e.key.as_str());
            ordered.push(e.ordering == TopicOrdering::PerKey);
            payloads.push(json);
            let traced = creating.traceparent(i);
            let row_headers = if user.is_empty() && traced.is_none() {
                serde_json::to_string(&e.headers)
            } else {
                serde_json::to_string(&EventHeaders {
                    user,
                    traceparent: traced.or_else(|| e.headers.traceparent.clone()),
                    ..e.headers.clone()
                })
            };
            headers.push(row_headers.map_err(EnqueueError::Serialize)?);
            delays.push(e.delay.map(|d| d.as_secs_f64()).unwrap_or(0.0));
            fairness.push(e.fairness_key.as_deref().unwrap_or(""));
        }
        // On a bare connection with unnamed statements, one transaction keeps a pooler's server connection.
        let st = self.statements;
        let mut c = st.autocommit(conn).await?;
        let rows = st
            .query(crate::schema::q(ENQUEUE_SQL))
            .bind(&topics)
            .bind(&keys)
            .bind(&ordered)
            .bind(&payloads)
            .bind(&headers)
            .bind(&delays)
            .bind(&fairness)
            .fetch_all(&mut *c)
            .await?;
        if self.notify {
            st.query("SELECT pg_notify($1, '')")
                .bind(NOTIFY_CHANNEL)
                .execute(&mut *c)
                .await?;
        }
        c.finish().await?;
        let mut out = rows
            .iter()
            .map(|r| {
                Ok(EnqueuedEvent {
                    id: r.try_get("id")?,
                    seq: r.try_get("seq")?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()?;
        // Identity values are drawn in insertion order, which follows the input order.
        out.sort_by_key(|e| e.id);
        Ok(out)
    }
}

/// Writes one event with [`Producer::default`] settings.
pub async fn enqueue(
    conn: &mut PgConnection,
    event: NewEvent,
) -> Result<EnqueuedEvent, EnqueueError> {
    Producer::default().enqueue(conn, event).await
}

/// Writes many events in one statement with [`Producer::default`] settings.
pub async fn enqueue_batch(
    conn: &mut PgConnection,
    events: &[NewEvent],
) -> Result<Vec<EnqueuedEvent>, EnqueueError> {
    Producer::default().enqueue_batch(conn, events).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_format() {
        assert!(is_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        assert!(!is_traceparent(
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"
        ));
        assert!(!is_traceparent(
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01"
        ));
        assert!(!is_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7"
        ));
    }

    #[test]
    fn json_bytes_that_are_not_utf8_are_refused_not_repaired() {
        const T: Topic = Topic::unordered("t");
        // Latin-1 "café": the old lossy decoding turned it into valid JSON holding U+FFFD and stored that.
        let latin1 = NewEvent::from_json_bytes(&T, "k", b"{\"name\":\"caf\xe9\"}");
        assert_eq!(
            latin1.validated(DEFAULT_MAX_PAYLOAD_BYTES),
            Err(InvalidEvent::NotUtf8 { valid_up_to: 12 })
        );
        let utf8 = NewEvent::from_json_bytes(&T, "k", "{\"name\":\"café\"}".as_bytes());
        assert_eq!(
            utf8.validated(DEFAULT_MAX_PAYLOAD_BYTES).as_deref(),
            Ok("{\"name\":\"café\"}")
        );
    }

    #[test]
    fn topic_names() {
        assert!(validate_topic("invoices.v2_eu-1").is_ok());
        assert_eq!(validate_topic(""), Err(InvalidEvent::EmptyTopic));
        assert!(matches!(
            validate_topic("a/b"),
            Err(InvalidEvent::InvalidTopic(_))
        ));
        assert!(matches!(
            validate_topic(&"x".repeat(101)),
            Err(InvalidEvent::InvalidTopic(_))
        ));
    }
}
