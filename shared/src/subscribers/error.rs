//! What can go wrong managing subscribers.

use std::time::Duration;

use chrono::{DateTime, Utc};

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
    /// [`super::add`] of a subscriber whose earlier removal has not finished (it stopped at its wait): the
    /// removal is finished first, and its wait for older transactions ran out. Unlike [`Self::OldTransactions`],
    /// nothing was recorded: the subscriber is still removed.
    #[error(
        "not added: subscriber {name} of topic {topic} is still being removed (its removal stopped while waiting for \
         older transactions, and they are still open after {waited:?}: backend pids {pids:?}; -1: a prepared \
         transaction, see pg_prepared_xacts). Its leftover copies and ordered lanes must go before it is added \
         again; nothing changed: run this command again once they end"
    )]
    RemovalUnfinished {
        /// The topic.
        topic: String,
        /// The subscriber (`default` for the default one).
        name: String,
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
