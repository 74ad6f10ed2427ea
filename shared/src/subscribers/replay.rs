//! Replay of retained history to a subscriber added with a start ([`super::add`]): fixing where it ends, copying it
//! chunk by chunk with its cursor, and opening the lanes it left waiting. The rules are in the module docs of
//! [`crate::subscribers`].

use std::time::Duration;

use sqlx::Row;

use super::error::SubscriberError;
use super::remove::wait_for_older_transactions;
use super::stored::get;
use crate::db::Db;

/// Events copied per replay transaction.
pub const REPLAY_CHUNK: i64 = 5_000;

/// Fixes where a replay ends: once every older transaction is over, every event written later has a copy for
/// the subscriber, so the replay needs to reach only the topic's newest event id now. Returns roughly how many
/// events the replay covers (retained events in the range; some may have copies already).
pub(super) async fn fix_replay_end(
    db: &Db,
    topic: &str,
    name: &str,
    from: i64,
    wait: Duration,
) -> Result<i64, SubscriberError> {
    wait_for_older_transactions(db, wait).await?;
    let row = sqlx::query(crate::schema::q(
        "WITH e AS (SELECT coalesce(max(coalesce(event_id, id)), 0) AS last FROM {schema}.outbox WHERE topic = $1) \
         UPDATE {schema}.outbox_subscribers s SET replay_to = e.last, replayed_to = coalesce(s.replayed_to, $3 - 1) \
         FROM e WHERE s.topic = $1 AND s.name = $2 AND s.replay_to IS NULL \
         RETURNING s.replay_to, \
             (SELECT count(DISTINCT coalesce(o.event_id, o.id)) FROM {schema}.outbox o \
              WHERE o.topic = $1 AND coalesce(o.event_id, o.id) BETWEEN $3 AND s.replay_to) AS events",
    ))
    .bind(topic)
    .bind(name)
    .bind(from)
    .fetch_optional(db.pool())
    .await?;
    Ok(match row {
        Some(r) => r.try_get("events")?,
        None => 0,
    })
}

/// What one [`replay_step`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ReplayProgress {
    /// Copies made by this step.
    pub copied: i64,
    /// Copies made by the whole replay so far.
    pub total: i64,
    /// The cursor after this step.
    pub done_to: i64,
    /// The replay's last event id.
    pub to: i64,
    /// The replay is over: its ordered keys are released.
    pub finished: bool,
}

/// The next chunk of a replay, in one transaction: the retained events after the cursor (one copy each, the
/// lowest-id one, read through `outbox_event_idx`) that have no copy for the subscriber get one, each ordered
/// key's lane is opened (waiting) at its first copied sequence, and the cursor moves. Returns `None` when the
/// subscriber has no replay under way.
const REPLAY_CHUNK_SQL: &str = r#"
WITH src AS (
    -- Any retained copy of an event will do (they share key, sequence, payload and headers): in the index's
    -- order, so the scan stops after the chunk instead of sorting the rest of the range.
    SELECT DISTINCT ON (coalesce(o.event_id, o.id)) coalesce(o.event_id, o.id) AS ev, o.topic, o.partition_key,
           o.seq, o.payload, o.headers, o.fairness_key
    FROM {schema}.outbox o
    WHERE o.topic = $1 AND coalesce(o.event_id, o.id) > $3 AND coalesce(o.event_id, o.id) <= $4
    ORDER BY coalesce(o.event_id, o.id)
    LIMIT $5
),
-- The subscriber's copies in the same range (few: only live copies written before the replay's end was fixed),
-- as one set: a hashed NOT IN, whatever the planner thinks of the subscriber's row count (a per-event anti join
-- planned on stale statistics scanned the whole topic for every event: 150 s per chunk of 5,000).
have AS (
    SELECT coalesce(c.event_id, c.id) AS ev FROM {schema}.outbox c
    WHERE c.topic = $1 AND c.subscriber = $2
      AND coalesce(c.event_id, c.id) > $3 AND coalesce(c.event_id, c.id) <= $4
),
todo AS (
    SELECT s.* FROM src s WHERE s.ev NOT IN (SELECT ev FROM have)
),
lanes AS (
    INSERT INTO {schema}.outbox_keys AS k (topic, partition_key, subscriber, done_seq, available_at)
    SELECT topic, partition_key, $2, min(seq) - 1, 'infinity'::timestamptz
    FROM todo WHERE seq IS NOT NULL
    GROUP BY topic, partition_key
    ORDER BY topic, partition_key
    ON CONFLICT (topic, partition_key, subscriber)
    DO UPDATE SET done_seq = least(k.done_seq, excluded.done_seq)
),
copied AS (
    INSERT INTO {schema}.outbox (topic, partition_key, subscriber, seq, payload, headers, event_id, fairness_key)
    SELECT topic, partition_key, $2, seq, payload, headers, ev, fairness_key FROM todo ORDER BY ev
    RETURNING 1
),
moved AS (
    UPDATE {schema}.outbox_subscribers
    SET replayed_to = coalesce((SELECT max(ev) FROM src), $4),
        replayed = replayed + (SELECT count(*) FROM copied)
    WHERE topic = $1 AND name = $2
    RETURNING replayed_to, replayed
)
SELECT (SELECT count(*) FROM copied) AS copied, (SELECT count(*) FROM src) AS read, m.replayed_to, m.replayed
FROM moved m
"#;

/// Copies the next chunk of `limit` events of a subscriber's replay (the chunk statement above); the chunk that
/// reaches the end also releases the subscriber's waiting ordered keys and marks the replay done. `None`: no
/// replay under way (none asked for, already finished, or its end is not fixed yet).
pub async fn replay_step(
    db: &Db,
    topic: &str,
    name: &str,
    limit: i64,
) -> Result<Option<ReplayProgress>, SubscriberError> {
    let mut tx = db.pool().begin().await?;
    let state: Option<(Option<i64>, Option<i64>)> = sqlx::query_as(crate::schema::q(
        "SELECT replayed_to, replay_to FROM {schema}.outbox_subscribers \
         WHERE topic = $1 AND name = $2 AND removed_at IS NULL AND replay_from IS NOT NULL \
           AND replay_done_at IS NULL FOR UPDATE",
    ))
    .bind(topic)
    .bind(name)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((Some(cursor), Some(to))) = state else {
        return Ok(None);
    };
    let row = sqlx::query(crate::schema::q(REPLAY_CHUNK_SQL))
        .bind(topic)
        .bind(name)
        .bind(cursor)
        .bind(to)
        .bind(limit.max(1))
        .fetch_one(&mut *tx)
        .await?;
    let read: i64 = row.try_get("read")?;
    let done_to: i64 = row.try_get("replayed_to")?;
    let finished = read < limit.max(1) || done_to >= to;
    if finished {
        sqlx::query(crate::schema::q(
            "UPDATE {schema}.outbox_subscribers SET replay_done_at = now(), replayed_to = replay_to \
             WHERE topic = $1 AND name = $2",
        ))
        .bind(topic)
        .bind(name)
        .execute(&mut *tx)
        .await?;
        sqlx::query(crate::schema::q(
            "UPDATE {schema}.outbox_keys SET available_at = now() \
             WHERE topic = $1 AND subscriber = $2 AND available_at = 'infinity'",
        ))
        .bind(topic)
        .bind(name)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(Some(ReplayProgress {
        copied: row.try_get("copied")?,
        total: row.try_get("replayed")?,
        done_to: if finished { to } else { done_to },
        to,
        finished,
    }))
}

/// Runs a subscriber's replay to the end, chunk by chunk, calling `progress` after each; fixes the replay's end
/// first when an earlier [`super::add`] could not (older transactions were still open). Returns the last progress.
pub async fn replay(
    db: &Db,
    topic: &str,
    name: &str,
    wait: Duration,
    mut progress: impl FnMut(&ReplayProgress),
) -> Result<Option<ReplayProgress>, SubscriberError> {
    let s = get(db, topic, name).await?;
    let Some(r) = s.replay else {
        return Ok(None);
    };
    if r.to.is_none() {
        fix_replay_end(db, topic, name, r.from, wait).await?;
    }
    let mut last = None;
    while let Some(p) = replay_step(db, topic, name, REPLAY_CHUNK).await? {
        progress(&p);
        let finished = p.finished;
        last = Some(p);
        if finished {
            break;
        }
    }
    Ok(last)
}

/// Opens the ordered lanes still waiting (`available_at = 'infinity'`) for a subscriber that is not replaying any
/// more. A producer whose statement saw the subscriber replaying may open a lane after the replay's last chunk
/// released the others; the relay's housekeeping calls this every pass (one probe of `outbox_keys_ready_idx`).
pub async fn release_waiting_lanes(db: &Db) -> Result<u64, sqlx::Error> {
    let q = db.query(crate::schema::q(
        "UPDATE {schema}.outbox_keys k SET available_at = now() \
         WHERE k.available_at = 'infinity' AND k.blocked_at IS NULL \
           AND NOT EXISTS (SELECT 1 FROM {schema}.outbox_subscribers s \
                           WHERE s.topic = k.topic AND s.name = k.subscriber AND s.removed_at IS NULL \
                             AND s.replay_from IS NOT NULL AND s.replay_done_at IS NULL)",
    ));
    db.execute(q).await
}
