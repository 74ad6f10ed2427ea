//! Removing a subscriber, and the wait for older transactions it shares with a replay.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::db::Db;
use crate::ids::TopicName;

use super::error::SubscriberError;
use super::names::label;
use super::stored::not_found;

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
    /// Unfinished copies deleted (pending, leased or in flight, or dead-lettered "no destination" since the removal
    /// began): they will not be delivered.
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
/// appear; its unfinished ones and its lanes are deleted, with the copies relays dead-lettered "no destination"
/// since the removal began (their dead letters resolved `withdrawn`).
pub(super) async fn delete_copies(
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
    // A copy a relay dead-lettered "no destination" once the removal began was unfinished at the removal, like
    // those deleted here: withdrawn too (its dead letter resolved `withdrawn`, decision record 0070), not left
    // open for a subscriber that is not owed it. Dead letters from before the removal stay open.
    let withdrawn: Vec<i64> = sqlx::query_scalar(crate::schema::q(
        "UPDATE {schema}.dead_letters d SET resolved_at = now(), resolution = 'withdrawn' \
         FROM {schema}.outbox_subscribers s \
         WHERE s.topic = $1 AND s.name = $2 AND s.removed_at IS NOT NULL \
           AND d.topic = $1 AND d.subscriber = $2 AND d.source = 'relay' AND d.error LIKE 'no destination:%' \
           AND d.created_at >= s.removed_at AND d.resolved_at IS NULL AND d.redriven_at IS NULL \
           AND d.outbox_id IS NOT NULL \
         RETURNING d.outbox_id",
    ))
    .bind(topic)
    .bind(name)
    .fetch_all(&mut *tx)
    .await?;
    let copies_deleted = sqlx::query(crate::schema::q(
        "DELETE FROM {schema}.outbox WHERE topic = $1 AND subscriber = $2 AND delivered_at IS NULL \
           AND (dead_lettered_at IS NULL OR id = ANY($3))",
    ))
    .bind(topic)
    .bind(name)
    .bind(&withdrawn)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    Ok(Removed {
        copies_deleted,
        keys_deleted,
    })
}
