//! Handlers registered per topic with typed payloads.
//!
//! ```no_run
//! use outbox::consumer::{Event, Handler, HandlerError, Registry, TopicRoute};
//! use sqlx::PgConnection;
//!
//! #[derive(serde::Deserialize)]
//! struct Welcome { email: String }
//!
//! struct SendWelcome;
//! impl Handler<Welcome> for SendWelcome {
//!     async fn handle(&self, conn: &mut PgConnection, event: &Event<Welcome>) -> Result<(), HandlerError> {
//!         if !event.payload.email.contains('@') {
//!             return Err(HandlerError::permanent("email has no @"));
//!         }
//!         event.statements.query("INSERT INTO mails (outbox_id, email) VALUES ($1, $2)")
//!             .bind(event.meta.outbox_id)
//!             .bind(&event.payload.email)
//!             .execute(&mut *conn)
//!             .await?; // sqlx errors become transient (or permanent for data errors), see HandlerError
//!         Ok(())
//!     }
//! }
//!
//! let registry = Registry::new().route(TopicRoute::new("customers.registered", SendWelcome));
//! ```
//!
//! The handler runs inside the delivery's transaction (the steps of [`crate::once`], in `batch.rs`), in a
//! savepoint of its own when the delivery carries several events: everything it writes through `conn` commits
//! together with its event's dedupe row, or not at all. It must not have other side effects that cannot roll
//! back (or must make them idempotent on `event.meta.outbox_id`). Build its statements with `event.statements`
//! ([`crate::db::Statements::query`] and friends) so that they go out as the consumer's own do: named and cached,
//! or unnamed behind a transaction-mode pooler (`DB_PERSISTENT_STATEMENTS=false`).
//!
//! The producer's own metadata ([`crate::NewEvent::header`]: a tenant, a causation id, …) is read with
//! `event.header("tenant")` or `event.headers()`. It comes from the signed envelope, never from request headers,
//! so a handler may decide from it as from the payload (decision record 0026).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use serde::de::DeserializeOwned;
use sqlx::PgConnection;

use crate::db::Statements;
use crate::ids::{OutboxId, PartitionKey, TopicName};

/// The schema version assumed when an event's envelope entry has no `schema_version` (the producer set none).
pub const DEFAULT_SCHEMA_VERSION: u32 = 1;

/// Everything about an event except its payload: from its entry in the signed envelope (`crate::contract`; for a
/// delivery in the previous wire format, from its outbox row), plus the topic of the path and QStash's own
/// headers. The `x-outbox-*` / `x-schema-version` request headers are informational copies, only compared with
/// the envelope (a copy that disagrees is refused); nothing here is read from them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventMeta {
    /// The event's id: the same in every copy of it, for every subscriber and however it was made (the producer,
    /// a replay, a re-add), and across republishes and redrives. The consumer's dedupe key within its
    /// `CONSUMER_NAME`, and the id to use as an idempotency key in side effects of your own (decision record 0070).
    pub event_id: OutboxId,
    /// The outbox row of this copy, which delivery evidence is recorded against. The same as
    /// [`EventMeta::event_id`] for the event's first copy (a deployment without fan-out has no other).
    pub outbox_id: OutboxId,
    /// The topic (from the path `/events/{topic}`; the envelope's must be the same).
    pub topic: TopicName,
    /// The partition key (the envelope's `key`).
    pub key: Option<PartitionKey>,
    /// The per-key sequence (the envelope's `seq`; ordered topics only).
    pub seq: Option<i64>,
    /// The payload schema version (the envelope's `schema_version`, default [`DEFAULT_SCHEMA_VERSION`]).
    pub schema_version: u32,
    /// When the producer's transaction wrote the event (the envelope's `created_at`).
    pub created_at: Option<DateTime<Utc>>,
    /// The producer's W3C trace context (the envelope's `headers`).
    pub traceparent: Option<String>,
    pub correlation_id: Option<String>,
    /// Who the event belongs to for fairness ([`crate::NewEvent::fairness_key`]; the envelope's
    /// `x-outbox-fairness-key` header), `None` when the producer set none.
    pub fairness_key: Option<String>,
    /// The application's own headers ([`crate::NewEvent::header`]) by lower-case name, from the signed envelope
    /// (never from request headers, so a handler may decide things from them). Empty for a delivery in the
    /// previous wire format. Read them with [`Event::header`].
    pub headers: BTreeMap<String, String>,
    /// QStash's message id (`Upstash-Message-Id`; changes on republish: never a dedupe key).
    pub message_id: Option<String>,
    /// QStash's retry counter (`Upstash-Retried`, 0 on the first attempt).
    pub retried: u32,
}

/// An event with its typed payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Event<P> {
    /// Ids, key, sequence, version, trace context.
    pub meta: EventMeta,
    pub payload: P,
    /// The consumer's statement mode (`DB_PERSISTENT_STATEMENTS`): build every query the handler runs with it
    /// (`event.statements.query(..)`), so it is unnamed behind RDS Proxy / PgBouncer in transaction mode.
    pub statements: Statements,
}

impl EventMeta {
    /// The application's header `name` (case-insensitive), as the producer set it with
    /// [`crate::NewEvent::header`].
    pub fn header(&self, name: &str) -> Option<&str> {
        match self.headers.get(name) {
            Some(v) => Some(v),
            None => self
                .headers
                .get(&name.to_ascii_lowercase())
                .map(String::as_str),
        }
    }
}

impl<P> Event<P> {
    /// The application's header `name` (case-insensitive), as the producer set it with
    /// [`crate::NewEvent::header`]: `event.header("tenant")`. Signed like the payload, so safe to decide on.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.meta.header(name)
    }

    /// The event's fairness key (a tenant), as the producer set it with [`crate::NewEvent::fairness_key`]; signed
    /// like the payload.
    pub fn fairness_key(&self) -> Option<&str> {
        self.meta.fairness_key.as_deref()
    }

    /// All of the application's headers, by lower-case name (the pipeline's own — trace context, correlation
    /// id — are in [`EventMeta`]'s fields instead).
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.meta.headers
    }
}

/// Why a handler did not apply an event. The transaction is rolled back in both cases.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandlerError {
    /// Retrying cannot help (invalid data, a business rule refused it): answered 489 with
    /// `Upstash-NonRetryable-Error: true`, so QStash dead-letters it at once and calls the failure callback.
    #[error("{0}")]
    Permanent(String),
    /// Retrying may help (database unavailable, a dependency is down): answered 503, with `Retry-After` when
    /// `retry_after` is set; QStash retries with its backoff.
    #[error("{message}")]
    Transient {
        /// What failed.
        message: String,
        /// When to retry, if known (QStash honours up to one day).
        retry_after: Option<Duration>,
    },
}

impl HandlerError {
    /// A permanent error.
    pub fn permanent(message: impl Into<String>) -> Self {
        HandlerError::Permanent(message.into())
    }

    /// A transient error.
    pub fn transient(message: impl Into<String>) -> Self {
        HandlerError::Transient {
            message: message.into(),
            retry_after: None,
        }
    }

    /// A transient error with a retry hint.
    pub fn retry_after(message: impl Into<String>, after: Duration) -> Self {
        HandlerError::Transient {
            message: message.into(),
            retry_after: Some(after),
        }
    }

    /// Whether this is [`HandlerError::Permanent`].
    pub fn is_permanent(&self) -> bool {
        matches!(self, HandlerError::Permanent(_))
    }
}

/// Database errors from a handler: data errors that a retry cannot fix (SQLSTATE class 22 "data exception",
/// 23502 not-null and 23514 check violations) are permanent; everything else (connection loss, timeouts,
/// serialization failures, deadlocks, unique and foreign-key violations — which another event may resolve) is
/// transient. Map errors yourself when a handler knows better.
impl From<sqlx::Error> for HandlerError {
    fn from(e: sqlx::Error) -> Self {
        let permanent = e
            .as_database_error()
            .and_then(|d| d.code())
            .is_some_and(|c| c.starts_with("22") || c == "23502" || c == "23514");
        if permanent {
            HandlerError::Permanent(format!("database rejected the event's data: {e}"))
        } else {
            HandlerError::transient(format!("database error: {e}"))
        }
    }
}

/// Applies events of one payload type. Implement it for a struct; `async fn` works in the impl.
pub trait Handler<P>: Send + Sync + 'static {
    /// Applies one event inside the dedupe transaction.
    fn handle(
        &self,
        conn: &mut PgConnection,
        event: &Event<P>,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

type Upcaster<P> = Box<dyn Fn(&[u8]) -> Result<P, serde_json::Error> + Send + Sync>;

/// One topic's registration: the handler, the schema versions decoded directly as `P`, and upcasters from
/// older versions.
pub struct TopicRoute<P, H> {
    topic: String,
    handler: H,
    versions: BTreeSet<u32>,
    upcasters: BTreeMap<u32, Upcaster<P>>,
}

impl<P, H> TopicRoute<P, H>
where
    P: DeserializeOwned + Send + Sync + 'static,
    H: Handler<P>,
{
    /// A topic whose payload is `P` at schema version 1 (or without a schema version in the envelope).
    pub fn new(topic: impl Into<String>, handler: H) -> Self {
        TopicRoute {
            topic: topic.into(),
            handler,
            versions: BTreeSet::from([DEFAULT_SCHEMA_VERSION]),
            upcasters: BTreeMap::new(),
        }
    }

    /// The schema versions whose JSON decodes directly as `P` (replaces the default `{1}`).
    pub fn versions(mut self, versions: impl IntoIterator<Item = u32>) -> Self {
        self.versions = versions.into_iter().collect();
        self
    }

    /// Accepts an older schema version by decoding it as `Old` and converting it.
    pub fn upcast<Old, F>(mut self, version: u32, convert: F) -> Self
    where
        Old: DeserializeOwned,
        F: Fn(Old) -> P + Send + Sync + 'static,
    {
        self.upcasters.insert(
            version,
            Box::new(move |body| serde_json::from_slice::<Old>(body).map(&convert)),
        );
        self
    }
}

/// A decoded event ready to be applied (type-erased).
pub(crate) trait Prepared: Send + Sync {
    fn apply<'a>(&'a self, conn: &'a mut PgConnection) -> BoxFuture<'a, Result<(), HandlerError>>;
}

struct PreparedEvent<P, H> {
    handler: Arc<H>,
    event: Event<P>,
}

impl<P, H> Prepared for PreparedEvent<P, H>
where
    P: Send + Sync + 'static,
    H: Handler<P>,
{
    fn apply<'a>(&'a self, conn: &'a mut PgConnection) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(self.handler.handle(conn, &self.event))
    }
}

/// A topic route (type-erased).
pub(crate) trait Route: Send + Sync {
    /// Decodes the body for `meta.schema_version`; errors are permanent.
    fn prepare(
        &self,
        meta: EventMeta,
        body: &[u8],
        statements: Statements,
    ) -> Result<Box<dyn Prepared>, HandlerError>;
    fn supported_versions(&self) -> Vec<u32>;
}

struct RouteImpl<P, H> {
    handler: Arc<H>,
    versions: BTreeSet<u32>,
    upcasters: BTreeMap<u32, Upcaster<P>>,
}

impl<P, H> Route for RouteImpl<P, H>
where
    P: DeserializeOwned + Send + Sync + 'static,
    H: Handler<P>,
{
    fn prepare(
        &self,
        meta: EventMeta,
        body: &[u8],
        statements: Statements,
    ) -> Result<Box<dyn Prepared>, HandlerError> {
        let version = meta.schema_version;
        let decoded = if let Some(up) = self.upcasters.get(&version) {
            up(body)
        } else if self.versions.contains(&version) {
            serde_json::from_slice::<P>(body)
        } else {
            return Err(HandlerError::permanent(format!(
                "unsupported schema version {version} for topic {:?} (supported: {:?})",
                meta.topic,
                self.supported_versions()
            )));
        };
        let payload = decoded.map_err(|e| {
            HandlerError::permanent(format!(
                "malformed payload for topic {:?} (schema version {version}): {e}",
                meta.topic
            ))
        })?;
        Ok(Box::new(PreparedEvent {
            handler: Arc::clone(&self.handler),
            event: Event {
                meta,
                payload,
                statements,
            },
        }))
    }

    fn supported_versions(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .versions
            .iter()
            .chain(self.upcasters.keys())
            .copied()
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// The topics a consumer serves. An event for a topic not registered here is refused as permanent (489).
#[derive(Default, Clone)]
pub struct Registry {
    routes: HashMap<String, Arc<dyn Route>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut topics: Vec<&str> = self.topics().collect();
        topics.sort_unstable();
        f.debug_struct("Registry").field("topics", &topics).finish()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Registry::default()
    }

    /// Adds a topic route (replacing an earlier one for the same topic).
    pub fn route<P, H>(mut self, route: TopicRoute<P, H>) -> Self
    where
        P: DeserializeOwned + Send + Sync + 'static,
        H: Handler<P>,
    {
        self.routes.insert(
            route.topic,
            Arc::new(RouteImpl {
                handler: Arc::new(route.handler),
                versions: route.versions,
                upcasters: route.upcasters,
            }),
        );
        self
    }

    /// Shorthand for `route(TopicRoute::new(topic, handler))` (schema version 1).
    pub fn on<P, H>(self, topic: impl Into<String>, handler: H) -> Self
    where
        P: DeserializeOwned + Send + Sync + 'static,
        H: Handler<P>,
    {
        self.route(TopicRoute::new(topic, handler))
    }

    /// The registered topics.
    pub fn topics(&self) -> impl Iterator<Item = &str> {
        self.routes.keys().map(String::as_str)
    }

    /// The schema versions a topic accepts (`None` if the topic is not registered).
    pub fn supported_versions(&self, topic: &str) -> Option<Vec<u32>> {
        self.routes.get(topic).map(|r| r.supported_versions())
    }

    pub(crate) fn get(&self, topic: &str) -> Option<&Arc<dyn Route>> {
        self.routes.get(topic)
    }
}
