//! The backlog per topic, for the operator console: what waits to be published, what QStash holds without an
//! outcome yet, the ordered keys and the unhandled dead letters — each from the same partial indexes `outbox
//! status` reads (pending rows, in-flight rows, the small `outbox_keys` table).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;

/// One topic's figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TopicBacklog {
    pub topic: String,
    /// Neither dispatched nor dead.
    pub pending: i64,
    /// The oldest pending event's age, seconds (the topic's lag; 0 when none).
    pub oldest_pending_age_secs: f64,
    /// Accepted by QStash, no outcome yet.
    pub in_flight: i64,
    /// The oldest in-flight event's wait, seconds (0 when none).
    pub oldest_in_flight_secs: f64,
    /// Ordered keys with work (a row in `outbox_keys`).
    pub active_keys: i64,
    /// Of them, blocked by a dead head.
    pub blocked_keys: i64,
    /// Dead letters not redriven and not resolved.
    pub unhandled_dead_letters: i64,
}

/// Every topic with pending or in-flight events, active ordered keys or unhandled dead letters, by name (at most
/// `limit`). Topics whose events all went through do not appear.
pub async fn topics(conn: &mut PgConnection, limit: u32) -> Result<Vec<TopicBacklog>, sqlx::Error> {
    let mut by_topic: BTreeMap<String, TopicBacklog> = BTreeMap::new();
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *conn)
        .await?;
    let since = |t: DateTime<Utc>| (now - t).as_seconds_f64().max(0.0);

    let pending: Vec<(String, i64, DateTime<Utc>)> = sqlx::query_as(crate::schema::q(
        "SELECT topic, count(*), min(created_at) FROM {schema}.outbox \
         WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL GROUP BY topic",
    ))
    .fetch_all(&mut *conn)
    .await?;
    let in_flight: Vec<(String, i64, DateTime<Utc>)> = sqlx::query_as(crate::schema::q(
        "SELECT topic, count(*), min(dispatched_at) FROM {schema}.outbox \
         WHERE dispatched_at IS NOT NULL AND delivered_at IS NULL AND dead_lettered_at IS NULL GROUP BY topic",
    ))
    .fetch_all(&mut *conn)
    .await?;
    let keys: Vec<(String, i64, i64)> = sqlx::query_as(crate::schema::q(
        "SELECT topic, count(*), count(*) FILTER (WHERE blocked_at IS NOT NULL) FROM {schema}.outbox_keys \
         GROUP BY topic",
    ))
    .fetch_all(&mut *conn)
    .await?;
    let dead: Vec<(Option<String>, i64)> = sqlx::query_as(crate::schema::q(
        "SELECT topic, count(*) FROM {schema}.dead_letters \
         WHERE redriven_at IS NULL AND resolved_at IS NULL GROUP BY topic",
    ))
    .fetch_all(&mut *conn)
    .await?;

    for (topic, n, oldest) in pending {
        let t = entry(&mut by_topic, topic);
        t.pending = n;
        t.oldest_pending_age_secs = since(oldest);
    }
    for (topic, n, oldest) in in_flight {
        let t = entry(&mut by_topic, topic);
        t.in_flight = n;
        t.oldest_in_flight_secs = since(oldest);
    }
    for (topic, active, blocked) in keys {
        let t = entry(&mut by_topic, topic);
        t.active_keys = active;
        t.blocked_keys = blocked;
    }
    for (topic, n) in dead {
        // A dead letter without a topic (an unparseable failure callback) is listed under "".
        entry(&mut by_topic, topic.unwrap_or_default()).unhandled_dead_letters = n;
    }
    Ok(by_topic.into_values().take(limit as usize).collect())
}

fn entry(by_topic: &mut BTreeMap<String, TopicBacklog>, topic: String) -> &mut TopicBacklog {
    by_topic
        .entry(topic.clone())
        .or_insert_with(|| TopicBacklog {
            topic,
            ..TopicBacklog::default()
        })
}
