//! Fan-out: one event, several subscribers (decision record 0068). Where a newcomer finds how each subscriber
//! gets every event once, in its own order, with its own retries and dead letters.
//!
//! A topic has one or more named subscribers (`outbox_subscribers`), each the base URL of a consumer whose
//! `CONSUMER_NAME` is the subscriber's name. The subscriber named `''` (shown as `default`) is the relay's
//! `CONSUMER_URL` / `CONSUMER_NAME`: every topic has it unless it was removed, so a deployment that never adds a
//! subscriber works as before.
//!
//! | Rule | Why |
//! |---|---|
//! | The producer's one statement writes a **copy** of each event per subscriber of its topic (an outbox row each, sharing the event's sequence; `event_id` names the first copy) | Each copy has its own lease, attempts, delivery evidence, dead letter and redrive: isolation is the relay's existing per-row machinery, and the copies commit with the business write, so no subscriber can miss an event the others got |
//! | An ordered key's relay state (`outbox_keys`) is per (topic, key, subscriber): a *lane* | A's dead head blocks A's lane only; B's slow consumer holds back B's events only |
//! | The relay publishes each copy to its subscriber's URL, with the subscriber in the flow-control key | QStash's per-key parallelism is per subscriber too: B's retries never take A's slot |
//! | The consumer's dedupe rows are keyed by its `CONSUMER_NAME`, the subscriber's name; the relay reads a named copy's dedupe row in that namespace | Once-only per subscriber ([`crate::once`]); the applied sweep and failure callbacks find the right row |
//! | [`add`] takes effect for every enqueue statement that starts after it commits | Statements read the subscriber list with their snapshot; per key, the copies a new subscriber gets are a suffix of the key's events, so its lane starts where its first copy is |
//! | [`add`] with a start ([`Start`]) first waits until every transaction older than the subscriber is over, then [`replay_step`] copies the retained events from the start up to that point that have no copy for it, in event order, a chunk per transaction (copies and cursor together) | Exactly the events it would otherwise miss, each once; a crash resumes from the cursor |
//! | While a subscriber replays, its ordered lanes wait (`available_at = 'infinity'`, also for lanes producers open meanwhile); each lane then starts at its first replayed sequence | A key's live events never overtake its replayed history |
//! | [`remove`] marks the subscriber removed, waits for older transactions, then deletes its unfinished copies and lanes; dead-lettered copies and dead letters stay | Deliveries stop; nothing it failed on is lost from view |
//!
//! Replay reaches what the outbox still holds: events are kept `OUTBOX_RETENTION_HOURS` after they are done for
//! their subscriber (`docs/operations.md` gives the storage cost).

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::Row;

use crate::db::Db;
use crate::ids::TopicName;

mod replay;
pub mod status;

use replay::fix_replay_end;
pub use replay::{REPLAY_CHUNK, ReplayProgress, release_waiting_lanes, replay, replay_step};

/// The default subscriber's stored name: the relay's `CONSUMER_URL` and `CONSUMER_NAME`.
pub const DEFAULT: &str = "";

/// How the default subscriber is shown and named on the command line.
pub const DEFAULT_LABEL: &str = "default";

/// The name as shown to people: `default` for the default subscriber.
pub fn label(name: &str) -> &str {
    if name.is_empty() { DEFAULT_LABEL } else { name }
}

/// What can go wrong managing subscribers.
#[derive(Debug, thiserror::Error)]
pub enum SubscriberError {
    /// A name that cannot be a subscriber's.
    #[error(
        "invalid subscriber name {0:?}: use 1 to 63 lower-case letters, digits, '_', '.' or '-', starting with a \
         letter or digit (it is the consumer's CONSUMER_NAME), or `default` for the relay's CONSUMER_URL"
    )]
    InvalidName(String),
    /// A destination that is not an absolute http(s) URL.
    #[error(
        "invalid URL {url:?} for subscriber {name}: {why} (give the consumer's base URL, e.g. https://billing.example.com)"
    )]
    InvalidUrl {
        /// The subscriber.
        name: String,
        /// The URL as given.
        url: String,
        /// What is wrong.
        why: String,
    },
    /// A topic name the producer would refuse.
    #[error("invalid topic {0:?}")]
    InvalidTopic(String),
    /// The subscriber exists already.
    #[error(
        "topic {topic} already has subscriber {name} (`outbox subscribers list`). To change its URL, remove it and \
         add it again, with --from and --again to replay what it missed meanwhile; its consumer recognises the \
         events it applied already"
    )]
    Exists {
        /// The topic.
        topic: String,
        /// The subscriber.
        name: String,
    },
    /// No such (live) subscriber.
    #[error("topic {topic} has no subscriber {name}")]
    NotFound {
        /// The topic.
        topic: String,
        /// The subscriber.
        name: String,
    },
    /// The default subscriber's URL is the relay's `CONSUMER_URL`.
    #[error(
        "the default subscriber delivers to the relay's CONSUMER_URL; `add <topic> default` only restores it \
         after a remove, without a URL"
    )]
    DefaultUrl,
    /// The subscriber existed before (it was removed) and is added again with its history: refused unless
    /// confirmed ([`add_again`], `outbox subscribers add --again`), because what is replayed differs from a first
    /// add.
    #[error(
        "subscriber {name} of topic {topic} was removed at {removed_at}. Adding it again from event #{from} replays \
         the {to_replay} retained event(s) from there that it has no copy of: those written while it was removed, \
         and those whose copies its removal deleted, which its consumer may have applied already (it recognises \
         those by their event id while it keeps their dedupe rows, PROCESSED_TTL_HOURS on the relay, 168 by \
         default: after that it could apply them again). Not replayed: the {delivered} event(s) from there \
         delivered to it before, and the {dead} that are its dead letters (`outbox dead-letters list --subscriber \
         {name}`; redrive them if it should still get them). Nothing was changed: run the command again with \
         --again to add it so"
    )]
    ReAdd {
        /// The topic.
        topic: String,
        /// The subscriber.
        name: String,
        /// When it was removed.
        removed_at: DateTime<Utc>,
        /// The replay's first event id.
        from: i64,
        /// Retained events from `from` it has no copy of (what the replay would copy).
        to_replay: i64,
        /// Its delivered copies from `from` (not replayed).
        delivered: i64,
        /// Its dead-lettered copies from `from` (not replayed).
        dead: i64,
    },
    /// A named subscriber whose name is the default subscriber's `CONSUMER_NAME`: both would dedupe in one
    /// namespace, each taking the other's events for duplicates.
    #[error(
        "{name} is the default subscriber's CONSUMER_NAME (recorded by the relay): a subscriber of that name would \
         share its dedupe namespace, and each would take the other's events for duplicates. Choose another name \
         (it is the new consumer's CONSUMER_NAME)"
    )]
    DefaultNamespace {
        /// The name.
        name: String,
    },
    /// The relay's `CONSUMER_NAME` is the name of a live named subscriber.
    #[error(
        "CONSUMER_NAME {name:?} is the name of a live named subscriber of {topics:?}: the default subscriber's consumer \
         would share its dedupe namespace, and each would take the other's events for duplicates. Give the relay and \
         its consumer another CONSUMER_NAME, or remove that subscriber"
    )]
    NamespaceTaken {
        /// The name.
        name: String,
        /// The topics it subscribes to.
        topics: Vec<String>,
    },
    /// A named subscriber needs a URL.
    #[error("subscriber {0} needs the URL of its consumer")]
    MissingUrl(String),
    /// Removing it would leave the topic without subscribers.
    #[error(
        "{name} is the last subscriber of topic {topic}: its events would go nowhere (add another one first)"
    )]
    LastSubscriber {
        /// The topic.
        topic: String,
        /// The subscriber.
        name: String,
    },
    /// No event at or after the replay's start time.
    #[error("no retained event of topic {topic} was written at or after {at}: nothing to replay")]
    NothingSince {
        /// The topic.
        topic: String,
        /// The time asked for.
        at: DateTime<Utc>,
    },
    /// A transaction older than the change did not end in time.
    #[error(
        "transactions that began before the change are still open after {waited:?} (backend pids {pids:?}; -1: a \
         prepared transaction, see pg_prepared_xacts); they may still write events without seeing it. The change \
         is recorded: run the command again once they end"
    )]
    OldTransactions {
        /// How long it waited.
        waited: Duration,
        /// Their backends (-1 for a prepared transaction).
        pids: Vec<i32>,
    },
    /// A replay parallelism outside 1–1000.
    #[error("replay parallelism {0} is outside 1 to 1000")]
    InvalidParallelism(u32),
    /// The default subscriber's replay parallelism is the relay's `QSTASH_REPLAY_PARALLELISM`.
    #[error(
        "the default subscriber's replay parallelism is the relay's QSTASH_REPLAY_PARALLELISM (template parameter \
         QstashReplayParallelism); a value of its own is for named subscribers"
    )]
    DefaultParallelism,
    /// The database.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

/// Checks and normalises a subscriber name as given on the command line: `default` is [`DEFAULT`].
pub fn parse_name(raw: &str) -> Result<String, SubscriberError> {
    if raw == DEFAULT_LABEL {
        return Ok(DEFAULT.to_owned());
    }
    if crate::ids::is_subscriber_name(raw) {
        Ok(raw.to_owned())
    } else {
        Err(SubscriberError::InvalidName(raw.to_owned()))
    }
}

/// Records the default subscriber's dedupe namespace, the relay's `CONSUMER_NAME` (the relay does at its first
/// invocation): refused while a live named subscriber has that name.
pub async fn record_default_consumer(db: &Db, consumer_name: &str) -> Result<(), SubscriberError> {
    let mut tx = db.pool().begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('outbox_subscribers:default-consumer'))")
        .execute(&mut *tx)
        .await?;
    let topics: Vec<String> = sqlx::query_scalar(crate::schema::q(
        "SELECT topic FROM {schema}.outbox_subscribers WHERE name = $1 AND removed_at IS NULL ORDER BY topic",
    ))
    .bind(consumer_name)
    .fetch_all(&mut *tx)
    .await?;
    if !topics.is_empty() {
        return Err(SubscriberError::NamespaceTaken {
            name: consumer_name.to_owned(),
            topics,
        });
    }
    sqlx::query(crate::schema::q(
        "INSERT INTO {schema}.outbox_default_consumer (consumer_name) VALUES ($1) \
         ON CONFLICT (only_row) DO UPDATE SET consumer_name = excluded.consumer_name, recorded_at = now() \
         WHERE {schema}.outbox_default_consumer.consumer_name IS DISTINCT FROM excluded.consumer_name",
    ))
    .bind(consumer_name)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Refuses a named subscriber called like the default subscriber's `CONSUMER_NAME` (as the relay recorded it).
async fn check_namespace(conn: &mut sqlx::PgConnection, name: &str) -> Result<(), SubscriberError> {
    if name == DEFAULT {
        return Ok(());
    }
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('outbox_subscribers:default-consumer'))")
        .execute(&mut *conn)
        .await?;
    let taken: bool = sqlx::query_scalar(crate::schema::q(
        "SELECT EXISTS (SELECT 1 FROM {schema}.outbox_default_consumer WHERE consumer_name = $1)",
    ))
    .bind(name)
    .fetch_one(&mut *conn)
    .await?;
    if taken {
        return Err(SubscriberError::DefaultNamespace {
            name: name.to_owned(),
        });
    }
    Ok(())
}

/// Checks a stored name: `''` (the default subscriber) or a name [`parse_name`] accepts other than `default`.
fn check_stored_name(name: &str) -> Result<(), SubscriberError> {
    if name == DEFAULT || (name != DEFAULT_LABEL && parse_name(name).is_ok()) {
        Ok(())
    } else {
        Err(SubscriberError::InvalidName(name.to_owned()))
    }
}

fn check_url(name: &str, raw: &str) -> Result<String, SubscriberError> {
    let bad = |why: String| SubscriberError::InvalidUrl {
        name: name.to_owned(),
        url: raw.to_owned(),
        why,
    };
    let url = url::Url::parse(raw).map_err(|e| bad(e.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad(format!(
            "scheme {:?} is not http or https",
            url.scheme()
        )));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(bad("a base URL has no query or fragment".into()));
    }
    // QStash calls a public URL; plain http would send the events (and the signatures) in clear. Only a consumer on
    // this machine (a local pipeline) may be called over http.
    if url.scheme() == "http" && !is_loopback(&url) {
        return Err(bad(
            "http is accepted only for a consumer on this machine (localhost, 127.0.0.1, ::1); QStash calls a public \
             URL, use https"
                .into(),
        ));
    }
    Ok(raw.trim_end_matches('/').to_owned())
}

fn is_loopback(url: &url::Url) -> bool {
    match url.host() {
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        Some(url::Host::Domain(d)) => d == "localhost" || d.ends_with(".localhost"),
        None => false,
    }
}

/// What the relay needs of every live subscriber, by topic and name: a named one's URL (where it publishes), its
/// replay's range (by which it recognises a replayed copy, [`Destinations::replayed`]) and its own replay
/// parallelism. Loaded from `outbox_subscribers` (a handful of rows); looked up per claimed event, by `&str`, so
/// a lookup allocates nothing.
#[derive(Debug, Clone, Default)]
pub struct Destinations {
    topics: HashMap<String, HashMap<String, Destination>>,
}

/// One subscriber's entry in [`Destinations`].
#[derive(Debug, Clone, Default)]
struct Destination {
    /// The base URL (`None` for the default subscriber: the relay's `CONSUMER_URL`).
    url: Option<String>,
    /// `replay_from ..= replay_to` (`None`: the end is not fixed yet, so everything from the start counts).
    replay: Option<(i64, Option<i64>)>,
    /// A replay parallelism of its own.
    parallelism: Option<u32>,
}

impl Destinations {
    /// Reads the live subscribers.
    pub async fn load(db: &Db) -> Result<Destinations, sqlx::Error> {
        let q = db.query(crate::schema::q(
            "SELECT topic, name, url, replay_from, replay_to, replay_parallelism FROM {schema}.outbox_subscribers \
             WHERE removed_at IS NULL",
        ));
        let rows = db.run(async |c| q.fetch_all(c).await).await?;
        let mut d = Destinations::default();
        for r in rows {
            let name: String = r.try_get("name")?;
            let url = match name.as_str() {
                DEFAULT => None,
                _ => r.try_get("url")?,
            };
            let replay = match r.try_get::<Option<i64>, _>("replay_from")? {
                Some(from) => Some((from, r.try_get("replay_to")?)),
                None => None,
            };
            let parallelism = r
                .try_get::<Option<i32>, _>("replay_parallelism")?
                .map(|p| u32::try_from(p).unwrap_or(1).max(1));
            *d.entry(&r.try_get::<String, _>("topic")?, &name) = Destination {
                url,
                replay,
                parallelism,
            };
        }
        Ok(d)
    }

    fn get(&self, topic: &str, name: &str) -> Option<&Destination> {
        self.topics.get(topic)?.get(name)
    }

    fn entry(&mut self, topic: &str, name: &str) -> &mut Destination {
        self.topics
            .entry(topic.to_owned())
            .or_default()
            .entry(name.to_owned())
            .or_default()
    }

    /// A named subscriber's base URL; `None` when it is not live (removed, or never added).
    pub fn url(&self, topic: &str, name: &str) -> Option<&str> {
        self.get(topic, name)?.url.as_deref()
    }

    /// Whether the copy of `event_id` for subscriber `name` of `topic` is part of the subscriber's replay (its
    /// event lies in the replay's range): the relay paces such copies apart from live traffic.
    pub fn replayed(&self, topic: &str, name: &str, event_id: i64) -> bool {
        match self.get(topic, name).and_then(|d| d.replay) {
            Some((from, to)) => event_id >= from && to.is_none_or(|to| event_id <= to),
            None => false,
        }
    }

    /// The replay parallelism a subscriber has of its own (`None`: the relay's `QSTASH_REPLAY_PARALLELISM`).
    pub fn replay_parallelism(&self, topic: &str, name: &str) -> Option<u32> {
        self.get(topic, name)?.parallelism
    }

    /// With one subscriber's URL set (tests and the local pipeline).
    pub fn with(mut self, topic: &str, name: &str, url: &str) -> Self {
        self.entry(topic, name).url = Some(url.to_owned());
        self
    }

    /// With a subscriber's own replay parallelism (tests).
    pub fn with_replay_parallelism(mut self, topic: &str, name: &str, parallelism: u32) -> Self {
        self.entry(topic, name).parallelism = Some(parallelism);
        self
    }

    /// With a subscriber's replay range set (tests).
    pub fn with_replay(mut self, topic: &str, name: &str, from: i64, to: Option<i64>) -> Self {
        self.entry(topic, name).replay = Some((from, to));
        self
    }
}

/// Where a new subscriber's history starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Only events written from now on (the default).
    Now,
    /// Retained events written at or after this time.
    Since(DateTime<Utc>),
    /// Retained events with this event id or a later one.
    FromId(i64),
}

impl std::str::FromStr for Start {
    type Err = String;

    /// `now`, an RFC 3339 timestamp, or an outbox id.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "now" {
            return Ok(Start::Now);
        }
        if let Ok(id) = s.parse::<i64>() {
            return if id > 0 {
                Ok(Start::FromId(id))
            } else {
                Err(format!("outbox id {id} must be positive"))
            };
        }
        DateTime::parse_from_rfc3339(s)
            .map(|t| Start::Since(t.with_timezone(&Utc)))
            .map_err(|e| format!("{s:?} is not `now`, an outbox id or an RFC 3339 timestamp ({e})"))
    }
}

/// A subscriber as stored.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Subscriber {
    /// Its topic.
    pub topic: String,
    /// Its name (`''`: the default one).
    pub name: String,
    /// Its consumer's base URL (`None`: the relay's `CONSUMER_URL`).
    pub url: Option<String>,
    /// When it was added.
    pub added_at: Option<DateTime<Utc>>,
    /// When it was removed.
    pub removed_at: Option<DateTime<Utc>>,
    /// Its replay, if it was added with a start.
    pub replay: Option<Replay>,
    /// Messages of its replay QStash delivers at once (`None`: the relay's `QSTASH_REPLAY_PARALLELISM`).
    pub replay_parallelism: Option<i32>,
}

/// A replay's progress.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Replay {
    /// First event id.
    pub from: i64,
    /// Last event id (set once older transactions ended).
    pub to: Option<i64>,
    /// The cursor: every event up to it that needed a copy has one.
    pub done_to: Option<i64>,
    /// Events copied so far.
    pub copied: i64,
    /// When the last chunk was copied and the subscriber's ordered keys were released.
    pub done_at: Option<DateTime<Utc>>,
}

fn subscriber_of(r: &sqlx::postgres::PgRow) -> Result<Subscriber, sqlx::Error> {
    let from: Option<i64> = r.try_get("replay_from")?;
    Ok(Subscriber {
        topic: r.try_get("topic")?,
        name: r.try_get("name")?,
        url: r.try_get("url")?,
        added_at: r.try_get("added_at")?,
        removed_at: r.try_get("removed_at")?,
        replay: match from {
            None => None,
            Some(from) => Some(Replay {
                from,
                to: r.try_get("replay_to")?,
                done_to: r.try_get("replayed_to")?,
                copied: r.try_get("replayed")?,
                done_at: r.try_get("replay_done_at")?,
            }),
        },
        replay_parallelism: r.try_get("replay_parallelism")?,
    })
}

const COLUMNS: &str = "topic, name, url, added_at, removed_at, replay_from, replay_to, replayed_to, replayed, \
                       replay_done_at, replay_parallelism";

/// Every subscriber on record, and the implicit default subscriber of each topic that has named ones, ordered by
/// topic and name. Removed ones are included (`removed_at`). A topic not listed has only the default subscriber.
pub async fn list(db: &Db) -> Result<Vec<Subscriber>, sqlx::Error> {
    let sql = crate::schema::sql(&format!(
        "SELECT {COLUMNS} FROM {{schema}}.outbox_subscribers \
         UNION ALL \
         SELECT t.topic, '', NULL, NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL::integer \
         FROM (SELECT DISTINCT topic FROM {{schema}}.outbox_subscribers) t \
         WHERE NOT EXISTS (SELECT 1 FROM {{schema}}.outbox_subscribers x WHERE x.topic = t.topic AND x.name = '') \
         ORDER BY 1, 2"
    ));
    let q = db.query(sqlx::AssertSqlSafe(sql));
    let rows = db.run(async |c| q.fetch_all(c).await).await?;
    rows.iter().map(subscriber_of).collect()
}

/// What [`add`] did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Added {
    /// The subscriber as stored.
    pub subscriber: Subscriber,
    /// Retained events it will be sent (copies still to make), when it replays.
    pub to_replay: Option<i64>,
}

/// Adds a subscriber to a live topic (see the module docs): from the next enqueue statement on, or, with a
/// [`Start`] other than `Now`, also the retained history from there, copied by [`replay_step`] (call
/// [`replay`] to run it to the end). Re-adding a removed subscriber from now starts it afresh; with a start it is
/// refused with [`SubscriberError::ReAdd`], which says what would and would not be replayed ([`add_again`] goes
/// ahead). Waits at most `wait` for transactions older than the change.
pub async fn add(
    db: &Db,
    topic: &str,
    name: &str,
    url: Option<&str>,
    start: Start,
    wait: Duration,
) -> Result<Added, SubscriberError> {
    add_with(db, topic, name, url, start, wait, ReAdd::Refuse).await
}

/// [`add`] for a subscriber that was removed, with its history: the replay copies the retained events from the
/// start that it has no copy of (written while it was removed, or whose copies its removal deleted); its consumer
/// recognises those it applied before by their event id (decision record 0070).
pub async fn add_again(
    db: &Db,
    topic: &str,
    name: &str,
    url: Option<&str>,
    start: Start,
    wait: Duration,
) -> Result<Added, SubscriberError> {
    add_with(db, topic, name, url, start, wait, ReAdd::Confirmed).await
}

/// Whether [`add_with`] may add a removed subscriber again with its history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReAdd {
    Refuse,
    Confirmed,
}

/// What adding a removed subscriber again from event `from` would and would not replay (`ReAdd` error's figures).
async fn readd_figures(
    conn: &mut sqlx::PgConnection,
    topic: &str,
    name: &str,
    from: i64,
) -> Result<(i64, i64, i64), sqlx::Error> {
    sqlx::query_as(crate::schema::q(
        "SELECT count(DISTINCT coalesce(o.event_id, o.id)) FILTER (WHERE NOT EXISTS ( \
                    SELECT 1 FROM {schema}.outbox c WHERE c.topic = $1 AND c.subscriber = $2 \
                      AND coalesce(c.event_id, c.id) = coalesce(o.event_id, o.id))), \
                count(*) FILTER (WHERE o.subscriber = $2 AND o.delivered_at IS NOT NULL), \
                count(*) FILTER (WHERE o.subscriber = $2 AND o.dead_lettered_at IS NOT NULL) \
         FROM {schema}.outbox o WHERE o.topic = $1 AND coalesce(o.event_id, o.id) >= $3",
    ))
    .bind(topic)
    .bind(name)
    .bind(from)
    .fetch_one(conn)
    .await
}

async fn add_with(
    db: &Db,
    topic: &str,
    name: &str,
    url: Option<&str>,
    start: Start,
    wait: Duration,
    again: ReAdd,
) -> Result<Added, SubscriberError> {
    crate::producer::validate_topic(topic)
        .map_err(|_| SubscriberError::InvalidTopic(topic.to_owned()))?;
    check_stored_name(name)?;
    let url = match (name, url) {
        (DEFAULT, Some(_)) => return Err(SubscriberError::DefaultUrl),
        (DEFAULT, None) => None,
        (n, None) => return Err(SubscriberError::MissingUrl(n.to_owned())),
        (n, Some(u)) => Some(check_url(n, u)?),
    };
    let mut tx = db.pool().begin().await?;
    check_namespace(&mut tx, name).await?;
    let from: Option<i64> = match start {
        Start::Now => None,
        Start::FromId(id) => Some(id),
        Start::Since(at) => {
            // The events' own times: a first copy (`event_id IS NULL`) is written by the producer with its event,
            // where a copy made by another subscriber's replay has the time of that replay.
            let first: Option<i64> = sqlx::query_scalar(crate::schema::q(
                "SELECT min(id) FROM {schema}.outbox \
                 WHERE topic = $1 AND created_at >= $2 AND event_id IS NULL",
            ))
            .bind(topic)
            .bind(at)
            .fetch_one(&mut *tx)
            .await?;
            Some(first.ok_or_else(|| SubscriberError::NothingSince {
                topic: topic.to_owned(),
                at,
            })?)
        }
    };
    let existing: Option<Option<DateTime<Utc>>> = sqlx::query_scalar(crate::schema::q(
        "SELECT removed_at FROM {schema}.outbox_subscribers WHERE topic = $1 AND name = $2 FOR UPDATE",
    ))
    .bind(topic)
    .bind(name)
    .fetch_optional(&mut *tx)
    .await?;
    let live = match existing {
        Some(removed) => removed.is_none(),
        // The default subscriber exists without a row until it is removed.
        None => name == DEFAULT,
    };
    if live {
        return Err(SubscriberError::Exists {
            topic: topic.to_owned(),
            name: label(name).to_owned(),
        });
    }
    if let (Some(Some(removed_at)), Some(from), ReAdd::Refuse) = (existing, from, again) {
        let (to_replay, delivered, dead) = readd_figures(&mut tx, topic, name, from).await?;
        return Err(SubscriberError::ReAdd {
            topic: topic.to_owned(),
            name: label(name).to_owned(),
            removed_at,
            from,
            to_replay,
            delivered,
            dead,
        });
    }
    let sql = crate::schema::sql(&format!(
        "INSERT INTO {{schema}}.outbox_subscribers (topic, name, url, replay_from) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (topic, name) DO UPDATE SET url = excluded.url, added_at = now(), removed_at = NULL, \
             replay_from = excluded.replay_from, replay_to = NULL, replayed_to = NULL, replayed = 0, \
             replay_done_at = NULL \
         RETURNING {COLUMNS}"
    ));
    let row = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(topic)
        .bind(name)
        .bind(&url)
        .bind(from)
        .fetch_one(&mut *tx)
        .await?;
    tx.commit().await?;
    let mut subscriber = subscriber_of(&row)?;
    let Some(from) = from else {
        return Ok(Added {
            subscriber,
            to_replay: None,
        });
    };
    let to_replay = fix_replay_end(db, topic, name, from, wait).await?;
    subscriber = get(db, topic, name).await?;
    Ok(Added {
        subscriber,
        to_replay: Some(to_replay),
    })
}

/// What [`ensure`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Ensured {
    /// Live already, with that URL.
    Unchanged,
    /// Live already: its URL was changed (deliveries not yet published go to the new one).
    UrlChanged,
    /// Added, from now on ([`Start::Now`]).
    Added,
}

/// Makes a named subscriber live with `url`, as a declaration does (the relay's `OUTBOX_SUBSCRIBERS`, the local
/// pipeline): added from now on when it is not live, its URL updated when it differs. Never replays or removes.
pub async fn ensure(
    db: &Db,
    topic: &str,
    name: &str,
    url: &str,
) -> Result<Ensured, SubscriberError> {
    if name == DEFAULT {
        return Err(SubscriberError::DefaultUrl);
    }
    check_stored_name(name)?;
    let url = check_url(name, url)?;
    crate::producer::validate_topic(topic)
        .map_err(|_| SubscriberError::InvalidTopic(topic.to_owned()))?;
    let row: Option<(Option<String>,)> = sqlx::query_as(crate::schema::q(
        "SELECT url FROM {schema}.outbox_subscribers WHERE topic = $1 AND name = $2 AND removed_at IS NULL",
    ))
    .bind(topic)
    .bind(name)
    .fetch_optional(db.pool())
    .await?;
    match row {
        Some((Some(current),)) if current == url => Ok(Ensured::Unchanged),
        Some(_) => {
            sqlx::query(crate::schema::q(
                "UPDATE {schema}.outbox_subscribers SET url = $3 WHERE topic = $1 AND name = $2",
            ))
            .bind(topic)
            .bind(name)
            .bind(&url)
            .execute(db.pool())
            .await?;
            Ok(Ensured::UrlChanged)
        }
        // `add_with`, not `add`: one async layer less in the relay's future, whose layout is near the compiler's
        // default query depth.
        None => match add_with(
            db,
            topic,
            name,
            Some(&url),
            Start::Now,
            Duration::ZERO,
            ReAdd::Refuse,
        )
        .await
        {
            Ok(_) => Ok(Ensured::Added),
            // Someone else added it meanwhile.
            Err(SubscriberError::Exists { .. }) => Ok(Ensured::Unchanged),
            Err(e) => Err(e),
        },
    }
}

/// One subscriber row.
pub async fn get(db: &Db, topic: &str, name: &str) -> Result<Subscriber, SubscriberError> {
    let sql = crate::schema::sql(&format!(
        "SELECT {COLUMNS} FROM {{schema}}.outbox_subscribers WHERE topic = $1 AND name = $2"
    ));
    let row = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(topic)
        .bind(name)
        .fetch_optional(db.pool())
        .await?
        .ok_or_else(|| not_found(topic, name))?;
    Ok(subscriber_of(&row)?)
}

fn not_found(topic: &str, name: &str) -> SubscriberError {
    SubscriberError::NotFound {
        topic: topic.to_owned(),
        name: label(name).to_owned(),
    }
}

/// Whether subscriber `name` may have `parallelism` as its own replay parallelism ([`set_replay_parallelism`]): a
/// named subscriber, 1 to 1000. For checking a command before it changes anything.
pub fn check_replay_parallelism(
    name: &str,
    parallelism: Option<u32>,
) -> Result<(), SubscriberError> {
    if name == DEFAULT && parallelism.is_some() {
        return Err(SubscriberError::DefaultParallelism);
    }
    match parallelism {
        Some(p) if !(1..=1000).contains(&p) => Err(SubscriberError::InvalidParallelism(p)),
        _ => Ok(()),
    }
}

/// Sets how many messages of a named subscriber's replay QStash delivers at once (`None`: the relay's
/// `QSTASH_REPLAY_PARALLELISM` again). Relays pick it up within their subscriber cache's lifetime (5 s).
pub async fn set_replay_parallelism(
    db: &Db,
    topic: &str,
    name: &str,
    parallelism: Option<u32>,
) -> Result<Subscriber, SubscriberError> {
    check_replay_parallelism(name, parallelism)?;
    let sql = crate::schema::sql(&format!(
        "UPDATE {{schema}}.outbox_subscribers SET replay_parallelism = $3 \
         WHERE topic = $1 AND name = $2 AND removed_at IS NULL RETURNING {COLUMNS}"
    ));
    let row = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(topic)
        .bind(name)
        .bind(parallelism.map(|p| p as i32))
        .fetch_optional(db.pool())
        .await?
        .ok_or_else(|| not_found(topic, name))?;
    Ok(subscriber_of(&row)?)
}

/// Waits until every transaction that was open when it was called (other than this session's) has ended,
/// polling; a transaction older than a change to `outbox_subscribers` may still write events with the list it
/// read. It waits on the transactions themselves, as `CREATE INDEX CONCURRENTLY` does: each holds a lock on its
/// own virtual transaction id until it ends, and `pg_locks` shows those to every role, where
/// `pg_stat_activity.xact_start` is NULL for other roles' sessions unless the role may read all statistics (a
/// wait on it passed at once under the roles the deployment docs create, and an older producer's events were never
/// replayed). Prepared transactions (two-phase commit) of this database prepared before the call are waited for
/// too.
pub async fn wait_for_older_transactions(db: &Db, wait: Duration) -> Result<(), SubscriberError> {
    let mut conn = db.pool().acquire().await?;
    let (since, open): (DateTime<Utc>, Vec<String>) = sqlx::query_as(
        "SELECT clock_timestamp(), coalesce(array_agg(l.virtualxid::text), '{}') \
         FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'virtualxid' AND l.virtualxid = l.virtualtransaction AND l.granted \
           AND l.pid <> pg_backend_pid() AND a.datname = current_database()",
    )
    .fetch_one(&mut *conn)
    .await?;
    let started = std::time::Instant::now();
    loop {
        let pids: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_locks WHERE locktype = 'virtualxid' AND virtualxid::text = ANY ($1) AND granted \
             UNION \
             SELECT -1 FROM pg_prepared_xacts WHERE database = current_database() AND prepared < $2 \
             ORDER BY 1",
        )
        .bind(&open)
        .bind(since)
        .fetch_all(&mut *conn)
        .await?;
        if pids.is_empty() {
            return Ok(());
        }
        if started.elapsed() >= wait {
            return Err(SubscriberError::OldTransactions {
                waited: started.elapsed(),
                pids,
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What [`remove`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Removed {
    /// Unfinished copies deleted (pending, leased or in flight): they will not be delivered.
    pub copies_deleted: u64,
    /// Ordered lanes deleted.
    pub keys_deleted: u64,
}

/// Removes a subscriber from a topic (see the module docs): no copy is written for it once this commits, and
/// after the older transactions end its unfinished copies and lanes are deleted. Its dead letters and
/// dead-lettered copies stay queryable. Refuses to remove a topic's last subscriber. Run again on a subscriber
/// already removed, it finishes that removal (after [`SubscriberError::OldTransactions`]).
pub async fn remove(
    db: &Db,
    topic: &str,
    name: &str,
    wait: Duration,
) -> Result<Removed, SubscriberError> {
    let topic_name = TopicName::from(topic);
    let mut tx = db.pool().begin().await?;
    // Serialises changes to the topic's subscribers (two removals could otherwise leave none).
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('outbox_subscribers:' || $1))")
        .bind(topic)
        .execute(&mut *tx)
        .await?;
    let live: Vec<String> = sqlx::query_scalar(crate::schema::q(
        "SELECT name FROM {schema}.outbox_subscribers WHERE topic = $1 AND removed_at IS NULL \
         UNION ALL SELECT '' WHERE NOT EXISTS \
             (SELECT 1 FROM {schema}.outbox_subscribers WHERE topic = $1 AND name = '')",
    ))
    .bind(&topic_name)
    .fetch_all(&mut *tx)
    .await?;
    if !live.iter().any(|n| n == name) {
        // Removed before (a removal that gave up waiting for older transactions): finish it.
        let removed: bool = sqlx::query_scalar(crate::schema::q(
            "SELECT EXISTS (SELECT 1 FROM {schema}.outbox_subscribers \
                            WHERE topic = $1 AND name = $2 AND removed_at IS NOT NULL)",
        ))
        .bind(topic)
        .bind(name)
        .fetch_one(&mut *tx)
        .await?;
        if !removed {
            return Err(not_found(topic, name));
        }
        tx.commit().await?;
        return delete_copies(db, topic, name, wait).await;
    }
    if live.len() == 1 {
        return Err(SubscriberError::LastSubscriber {
            topic: topic.to_owned(),
            name: label(name).to_owned(),
        });
    }
    // A named subscriber has its row; the default one gets one when it is first removed.
    sqlx::query(crate::schema::q(
        "INSERT INTO {schema}.outbox_subscribers AS s (topic, name, url, removed_at) \
         SELECT $1, $2, url, now() FROM {schema}.outbox_subscribers WHERE topic = $1 AND name = $2 \
         UNION ALL SELECT $1, $2, NULL, now() WHERE $2 = '' \
         LIMIT 1 \
         ON CONFLICT (topic, name) DO UPDATE SET removed_at = now()",
    ))
    .bind(topic)
    .bind(name)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    delete_copies(db, topic, name, wait).await
}

/// The second half of [`remove`]: once the older transactions are over, no new copy for the subscriber can
/// appear; its unfinished ones and its lanes are deleted.
async fn delete_copies(
    db: &Db,
    topic: &str,
    name: &str,
    wait: Duration,
) -> Result<Removed, SubscriberError> {
    wait_for_older_transactions(db, wait).await?;
    let mut tx = db.pool().begin().await?;
    let keys_deleted = sqlx::query(crate::schema::q(
        "DELETE FROM {schema}.outbox_keys WHERE topic = $1 AND subscriber = $2",
    ))
    .bind(topic)
    .bind(name)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    let copies_deleted = sqlx::query(crate::schema::q(
        "DELETE FROM {schema}.outbox WHERE topic = $1 AND subscriber = $2 \
           AND delivered_at IS NULL AND dead_lettered_at IS NULL",
    ))
    .bind(topic)
    .bind(name)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    Ok(Removed {
        copies_deleted,
        keys_deleted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(parse_name("default").unwrap(), "");
        assert_eq!(parse_name("billing-eu.v2").unwrap(), "billing-eu.v2");
        for bad in ["", "Billing", "-x", "a b", "a/b", &"x".repeat(64)] {
            assert!(parse_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn urls() {
        assert_eq!(
            check_url("b", "https://billing.example/").unwrap(),
            "https://billing.example"
        );
        assert!(check_url("b", "ftp://x").is_err());
        assert!(check_url("b", "billing").is_err());
        assert!(check_url("b", "https://x/?a=1").is_err());
        assert!(check_url("b", "http://127.0.0.1:9").is_ok());
        assert!(check_url("b", "http://localhost:8080").is_ok());
        assert!(check_url("b", "http://[::1]:8080").is_ok());
        let e = check_url("b", "http://billing.example.com")
            .unwrap_err()
            .to_string();
        assert!(e.contains("use https"), "{e}");
    }

    #[test]
    fn starts() {
        assert_eq!("now".parse::<Start>(), Ok(Start::Now));
        assert_eq!("42".parse::<Start>(), Ok(Start::FromId(42)));
        assert!(matches!(
            "2026-12-01T00:00:00Z".parse::<Start>(),
            Ok(Start::Since(_))
        ));
        assert!("0".parse::<Start>().is_err());
        assert!("yesterday".parse::<Start>().is_err());
    }
}
