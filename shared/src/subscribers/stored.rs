//! Subscribers as stored: reading them, and a named subscriber's own replay parallelism.

use chrono::{DateTime, Utc};
use sqlx::Row;

use crate::db::Db;

use super::error::SubscriberError;
use super::names::{DEFAULT, label};

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

pub(super) fn subscriber_of(r: &sqlx::postgres::PgRow) -> Result<Subscriber, sqlx::Error> {
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

pub(super) const COLUMNS: &str = "topic, name, url, added_at, removed_at, replay_from, replay_to, replayed_to, replayed, \
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

pub(super) fn not_found(topic: &str, name: &str) -> SubscriberError {
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
