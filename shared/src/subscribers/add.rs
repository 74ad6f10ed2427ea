//! Adding a subscriber: from now on, or with its history ([`Start`]); adding it again; declaring it ([`ensure`]).

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use sqlx::postgres::PgRow;

use crate::db::Db;

use super::error::SubscriberError;
use super::names::{DEFAULT, check_namespace, check_stored_name, check_url, label};
use super::remove::delete_copies;
use super::replay::fix_replay_end;
use super::stored::{COLUMNS, Subscriber, get, subscriber_of};

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

/// [`add`], [`add_again`] and [`ensure`]: checks the names, finishes an unfinished removal, then adds the
/// subscriber (or, removed, again) from `start`, and fixes where its replay ends. `again`: whether a removed
/// subscriber may come back with its history.
async fn add_with(
    db: &Db,
    topic: &str,
    name: &str,
    url: Option<&str>,
    start: Start,
    wait: Duration,
    again: ReAdd,
) -> Result<Added, SubscriberError> {
    let url = checked_target(topic, name, url)?;
    // A removal that has not finished (it was waiting for older transactions when it stopped) left the subscriber's
    // unfinished copies and ordered lanes behind. Adding it again on top of them would keep those lanes as they
    // were — open, not waiting for the replay — so live copies of later sequences could overtake the replayed ones
    // and the consumer would refuse these as late. The removal is finished first (its wait included).
    if has_leftovers(db, topic, name).await? {
        delete_copies(db, topic, name, wait)
            .await
            .map_err(|e| unfinished_removal(e, topic, name))?;
    }
    let mut tx = db.pool().begin().await?;
    check_namespace(&mut tx, name).await?;
    let from: Option<i64> = match start {
        Start::Now => None,
        Start::FromId(id) => Some(id),
        Start::Since(at) => Some(first_event_since(&mut tx, topic, at).await?),
    };
    let existing = lock_existing(&mut tx, topic, name).await?;
    check_not_live(existing, topic, name)?;
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
    let row = upsert(&mut tx, topic, name, url.as_deref(), from).await?;
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

/// Checks the topic and the name, and the URL: none for the default subscriber, a valid one for a named one.
fn checked_target(
    topic: &str,
    name: &str,
    url: Option<&str>,
) -> Result<Option<String>, SubscriberError> {
    crate::producer::validate_topic(topic)
        .map_err(|_| SubscriberError::InvalidTopic(topic.to_owned()))?;
    check_stored_name(name)?;
    match (name, url) {
        (DEFAULT, Some(_)) => Err(SubscriberError::DefaultUrl),
        (DEFAULT, None) => Ok(None),
        (n, None) => Err(SubscriberError::MissingUrl(n.to_owned())),
        (n, Some(u)) => Ok(Some(check_url(n, u)?)),
    }
}

/// Whether a removal of the subscriber has not finished: it is removed, and lanes or unfinished copies of it remain.
async fn has_leftovers(db: &Db, topic: &str, name: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(crate::schema::q(
        "SELECT EXISTS (SELECT 1 FROM {schema}.outbox_subscribers                         WHERE topic = $1 AND name = $2 AND removed_at IS NOT NULL)             AND (EXISTS (SELECT 1 FROM {schema}.outbox_keys WHERE topic = $1 AND subscriber = $2)                  OR EXISTS (SELECT 1 FROM {schema}.outbox WHERE topic = $1 AND subscriber = $2                               AND delivered_at IS NULL AND dead_lettered_at IS NULL))",
    ))
    .bind(topic)
    .bind(name)
    .fetch_one(db.pool())
    .await
}

/// A removal that could not finish for older transactions is [`SubscriberError::RemovalUnfinished`].
fn unfinished_removal(e: SubscriberError, topic: &str, name: &str) -> SubscriberError {
    match e {
        SubscriberError::OldTransactions { waited, pids } => SubscriberError::RemovalUnfinished {
            topic: topic.to_owned(),
            name: label(name).to_owned(),
            waited,
            pids,
        },
        e => e,
    }
}

/// The first event of `topic` written at or after `at`, by the events' own times: a first copy (`event_id IS
/// NULL`) is written by the producer with its event, where a copy made by another subscriber's replay has the time
/// of that replay.
async fn first_event_since(
    tx: &mut PgConnection,
    topic: &str,
    at: DateTime<Utc>,
) -> Result<i64, SubscriberError> {
    let first: Option<i64> = sqlx::query_scalar(crate::schema::q(
        "SELECT min(id) FROM {schema}.outbox \
         WHERE topic = $1 AND created_at >= $2 AND event_id IS NULL",
    ))
    .bind(topic)
    .bind(at)
    .fetch_one(&mut *tx)
    .await?;
    first.ok_or_else(|| SubscriberError::NothingSince {
        topic: topic.to_owned(),
        at,
    })
}

/// The subscriber's row, locked: `None` when it has none, else when it was removed (`None`: live).
async fn lock_existing(
    tx: &mut PgConnection,
    topic: &str,
    name: &str,
) -> Result<Option<Option<DateTime<Utc>>>, sqlx::Error> {
    sqlx::query_scalar(crate::schema::q(
        "SELECT removed_at FROM {schema}.outbox_subscribers WHERE topic = $1 AND name = $2 FOR UPDATE",
    ))
    .bind(topic)
    .bind(name)
    .fetch_optional(&mut *tx)
    .await
}

/// Refuses to add a subscriber that is live ([`SubscriberError::Exists`]), by its locked row ([`lock_existing`]).
fn check_not_live(
    existing: Option<Option<DateTime<Utc>>>,
    topic: &str,
    name: &str,
) -> Result<(), SubscriberError> {
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
    Ok(())
}

/// Writes the subscriber's row: new, or a removed one's afresh (added now, its replay from `from`).
async fn upsert(
    tx: &mut PgConnection,
    topic: &str,
    name: &str,
    url: Option<&str>,
    from: Option<i64>,
) -> Result<PgRow, sqlx::Error> {
    let sql = crate::schema::sql(&format!(
        "INSERT INTO {{schema}}.outbox_subscribers (topic, name, url, replay_from) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (topic, name) DO UPDATE SET url = excluded.url, added_at = now(), removed_at = NULL, \
             replay_from = excluded.replay_from, replay_to = NULL, replayed_to = NULL, replayed = 0, \
             replay_done_at = NULL \
         RETURNING {COLUMNS}"
    ));
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(topic)
        .bind(name)
        .bind(url)
        .bind(from)
        .fetch_one(&mut *tx)
        .await
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
