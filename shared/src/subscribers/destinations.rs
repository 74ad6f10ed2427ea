//! What the relay needs of every live subscriber ([`Destinations`]).

use std::collections::HashMap;

use sqlx::Row;

use crate::db::Db;

use super::names::DEFAULT;

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
