//! Ordered keys, for the operator console: every key a producer ever sequenced (`outbox_sequences`), with the
//! relay's state of it (`outbox_keys`: done up to, in flight, blocked and why) and its head event. A page at a
//! time, in (topic, key) order on the primary key; a search by key prefix reads `outbox_sequences_key_idx`.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;

use crate::ids::{OutboxId, PartitionKey, TopicName};

/// Which keys, and where the page starts.
#[derive(Debug, Clone, Default)]
pub struct KeyQuery {
    /// Only this topic.
    pub topic: Option<String>,
    /// Only keys starting with this text (case-sensitive).
    pub key_prefix: Option<String>,
    /// Only keys blocked by a dead head.
    pub blocked_only: bool,
    /// Only keys after this (topic, key): the previous page's `next_after`.
    pub after: Option<(String, String)>,
    /// Page size (1..=1000).
    pub limit: u32,
}

/// One ordered key.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct KeyLine {
    pub topic: TopicName,
    pub partition_key: PartitionKey,
    /// The last sequence a producer handed out.
    pub last_seq: i64,
    /// Every event up to this sequence is finished; `None` when the key has no work (no `outbox_keys` row).
    pub done_seq: Option<i64>,
    /// The head may be claimed from then on (backoff, or the relay's lease).
    pub available_at: Option<DateTime<Utc>>,
    /// The relay's lease on the key ends then.
    pub locked_until: Option<DateTime<Utc>>,
    /// The event accepted by QStash that the key waits on (delivery evidence), and since when.
    pub inflight_id: Option<OutboxId>,
    pub inflight_since: Option<DateTime<Utc>>,
    /// Blocked by a dead head: since when, by which event, why.
    pub blocked_at: Option<DateTime<Utc>>,
    pub blocked_id: Option<OutboxId>,
    pub blocked_reason: Option<String>,
    /// The head (`seq = done_seq + 1`): id, attempts, when it was written, its last error.
    pub head_id: Option<OutboxId>,
    pub head_attempts: Option<i32>,
    pub head_created_at: Option<DateTime<Utc>>,
    pub head_last_error: Option<String>,
}

impl KeyLine {
    /// Events of the key not finished yet (the head included).
    pub fn unfinished(&self) -> i64 {
        self.done_seq.map_or(0, |d| (self.last_seq - d).max(0))
    }

    /// `blocked`, `in flight`, `pending` or `idle` (nothing to do).
    pub fn state(&self) -> &'static str {
        if self.blocked_at.is_some() {
            "blocked"
        } else if self.inflight_id.is_some() {
            "in flight"
        } else if self.unfinished() > 0 {
            "pending"
        } else {
            "idle"
        }
    }
}

/// One page of keys.
#[derive(Debug, Clone, Serialize)]
pub struct KeyPage {
    pub items: Vec<KeyLine>,
    /// Pass as `after` for the next page; `None` when this was the last.
    pub next_after: Option<(String, String)>,
}

/// One page of ordered keys, in (topic, key) order.
pub async fn keys(conn: &mut PgConnection, q: &KeyQuery) -> Result<KeyPage, sqlx::Error> {
    let limit = q.limit.clamp(1, 1000);
    // Only the conditions that are set, so that each query's plan fits it (a prefix uses the key index, a
    // blocked-only page starts from the few blocked keys).
    let mut conditions = Vec::new();
    let mut n = 0;
    let mut param = || {
        n += 1;
        format!("${n}")
    };
    if q.topic.is_some() {
        conditions.push(format!("s.topic = {}", param()));
    }
    if q.key_prefix.is_some() {
        conditions.push(format!("s.partition_key LIKE {}", param()));
    }
    if q.after.is_some() {
        let (t, k) = (param(), param());
        conditions.push(format!("(s.topic, s.partition_key) > ({t}, {k})"));
    }
    if q.blocked_only {
        conditions.push("k.blocked_at IS NOT NULL".to_owned());
    }
    let filter = if conditions.is_empty() {
        String::new()
    } else {
        format!("WHERE {}", conditions.join(" AND "))
    };
    let join = if q.blocked_only { "JOIN" } else { "LEFT JOIN" };
    let sql = crate::schema::sql(&format!(
        "SELECT s.topic, s.partition_key, s.last_seq, k.done_seq, k.available_at, k.locked_until, k.inflight_id, \
                k.inflight_since, k.blocked_at, k.blocked_id, k.blocked_reason, \
                h.id AS head_id, h.attempts AS head_attempts, h.created_at AS head_created_at, \
                h.last_error AS head_last_error \
         FROM {{schema}}.outbox_sequences s \
         {join} {{schema}}.outbox_keys k ON k.topic = s.topic AND k.partition_key = s.partition_key \
         LEFT JOIN LATERAL (SELECT o.id, o.attempts, o.created_at, o.last_error FROM {{schema}}.outbox o \
                            WHERE o.topic = s.topic AND o.partition_key = s.partition_key \
                              AND o.seq = k.done_seq + 1) h ON true \
         {filter} ORDER BY s.topic, s.partition_key LIMIT {}",
        limit + 1
    ));
    let mut query = sqlx::query_as::<_, KeyLine>(sqlx::AssertSqlSafe(sql));
    if let Some(t) = &q.topic {
        query = query.bind(t);
    }
    if let Some(p) = &q.key_prefix {
        query = query.bind(format!("{}%", crate::dead_letters::like_escaped(p)));
    }
    if let Some((t, k)) = &q.after {
        query = query.bind(t).bind(k);
    }
    let mut items = query.fetch_all(&mut *conn).await?;
    let more = items.len() > limit as usize;
    items.truncate(limit as usize);
    let next_after = if more {
        items
            .last()
            .map(|k| (k.topic.to_string(), k.partition_key.to_string()))
    } else {
        None
    };
    Ok(KeyPage { items, next_after })
}
