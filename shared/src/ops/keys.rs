//! Ordered keys, for the operator console: every key a producer ever sequenced (`outbox_sequences`), with the
//! relay's state of each of its *lanes* (`outbox_keys`, one per (topic, key, subscriber) with work: done up to, in
//! flight, blocked and why) and the lane's head (its subscriber's copy). A page at a time, in (topic, key,
//! subscriber) order on the primary keys; a search by key prefix reads `outbox_sequences_key_idx`.
//!
//! | Rule | Why |
//! |---|---|
//! | One line per lane; a key without work is one line without a subscriber | Fan-out: each subscriber's lane has its own state, and a key's lanes must not be folded into one (or multiplied by the copies of its head) |
//! | The head is the lane's subscriber's copy at `done_seq + 1` | The copies of one event share its sequence; only the lane's own copy is its head |
//! | A subscriber filter joins that subscriber's lane only: every key once, with its state for that subscriber | "Keys of subscriber B" shows B's view of each key, idle where B has no work |
//! | The cursor is (topic, key, subscriber) | A page may end between two lanes of one key; the next page starts at the lane after it |

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::PgArguments;
use sqlx::query::QueryAs;
use sqlx::{PgConnection, Postgres};

use crate::ids::{OutboxId, PartitionKey, TopicName};

/// Which keys, and where the page starts.
#[derive(Debug, Clone, Default)]
pub struct KeyQuery {
    /// Only this topic.
    pub topic: Option<String>,
    /// Only keys starting with this text (case-sensitive).
    pub key_prefix: Option<String>,
    /// Only this subscriber's lanes (`''`: the default subscriber; see `crate::subscribers`).
    pub subscriber: Option<String>,
    /// Only keys blocked by a dead head.
    pub blocked_only: bool,
    /// Only lanes after this one: the previous page's `next_after`.
    pub after: Option<KeyCursor>,
    /// Page size (1..=1000).
    pub limit: u32,
}

/// Where a page of keys ends: the last line's topic, key and subscriber (`''` for a key without a lane).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyCursor {
    pub topic: String,
    pub partition_key: String,
    pub subscriber: String,
}

/// One ordered key's lane (or a key without work).
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct KeyLine {
    pub topic: TopicName,
    pub partition_key: PartitionKey,
    /// The lane's subscriber (`''`: the default one); `None` for a key without a lane (no work for anyone, or,
    /// with a subscriber filter, none for that subscriber).
    pub subscriber: Option<String>,
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
    /// The lane's head (its subscriber's copy with `seq = done_seq + 1`): id, attempts, when it was written, its
    /// last error.
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
    pub next_after: Option<KeyCursor>,
}

/// One page of ordered keys' lanes, in (topic, key, subscriber) order.
pub async fn keys(conn: &mut PgConnection, q: &KeyQuery) -> Result<KeyPage, sqlx::Error> {
    let limit = q.limit.clamp(1, 1000);
    let query = sqlx::query_as::<_, KeyLine>(sqlx::AssertSqlSafe(keys_sql(q, limit)));
    let mut items = bind_key_query(query, q).fetch_all(&mut *conn).await?;
    let more = items.len() > limit as usize;
    items.truncate(limit as usize);
    let next_after = if more {
        items.last().map(cursor_of)
    } else {
        None
    };
    Ok(KeyPage { items, next_after })
}

/// The parts of the keys query that depend on the [`KeyQuery`], its parameters numbered in the order
/// [`bind_key_query`] binds them.
struct KeyFilter {
    /// `WHERE` and the conditions that are set (empty when none is).
    filter: String,
    /// A subscriber's lanes only: the lane join's condition.
    lane: String,
    /// From the cursor on: the condition on `outbox_keys` (`k`) …
    from_keys: String,
    /// … and on `outbox` (`o`, the lane's head).
    from_heads: String,
}

impl KeyFilter {
    /// The filter of `q`: only the conditions that are set.
    fn of(q: &KeyQuery) -> Self {
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
        // From the cursor on, in each of the three tables, so that each index scan starts there: without it a later
        // page read every lane and head before the cursor (90 ms instead of 0.5 ms at 50,000 keys, 33,000 lanes).
        let mut from = (String::new(), String::new());
        if q.after.is_some() {
            let (t, k, sub) = (param(), param(), param());
            // The first part on the primary key's order; the second picks the lanes after the cursor's in its key.
            conditions.push(format!(
                "(s.topic, s.partition_key) >= ({t}, {k}) \
                 AND ((s.topic, s.partition_key) > ({t}, {k}) OR coalesce(k.subscriber, '') > {sub})"
            ));
            from = (
                format!(" AND (k.topic, k.partition_key) >= ({t}, {k})"),
                format!(" AND (o.topic, o.partition_key) >= ({t}, {k})"),
            );
        }
        if q.blocked_only {
            conditions.push("k.blocked_at IS NOT NULL".to_owned());
        }
        // A subscriber's lanes only: in the join, so that with a left join each key still shows once (idle for it).
        let lane = match q.subscriber {
            Some(_) => format!(" AND k.subscriber = {}", param()),
            None => String::new(),
        };
        let filter = if conditions.is_empty() {
            String::new()
        } else {
            format!("WHERE {}", conditions.join(" AND "))
        };
        let (from_keys, from_heads) = from;
        KeyFilter {
            filter,
            lane,
            from_keys,
            from_heads,
        }
    }
}

/// The keys query for `q`: a page of `limit` lines, and one more to tell whether another page follows.
fn keys_sql(q: &KeyQuery, limit: u32) -> String {
    let KeyFilter {
        filter,
        lane,
        from_keys,
        from_heads,
    } = KeyFilter::of(q);
    let join = if q.blocked_only { "JOIN" } else { "LEFT JOIN" };
    crate::schema::sql(&format!(
        "SELECT s.topic, s.partition_key, k.subscriber, s.last_seq, k.done_seq, k.available_at, k.locked_until, \
                k.inflight_id, k.inflight_since, k.blocked_at, k.blocked_id, k.blocked_reason, \
                h.id AS head_id, h.attempts AS head_attempts, h.created_at AS head_created_at, \
                h.last_error AS head_last_error \
         FROM {{schema}}.outbox_sequences s \
         {join} {{schema}}.outbox_keys k ON k.topic = s.topic AND k.partition_key = s.partition_key{lane}{} \
         LEFT JOIN LATERAL (SELECT o.id, o.attempts, o.created_at, o.last_error FROM {{schema}}.outbox o \
                            WHERE o.topic = s.topic AND o.partition_key = s.partition_key \
                              AND o.subscriber = k.subscriber AND o.seq = k.done_seq + 1{}) h ON true \
         {filter} ORDER BY s.topic, s.partition_key, k.subscriber NULLS FIRST LIMIT {}",
        from_keys,
        from_heads,
        limit + 1
    ))
}

/// Binds the parameters of [`keys_sql`], in [`KeyFilter::of`]'s order.
fn bind_key_query<'q>(
    mut query: QueryAs<'q, Postgres, KeyLine, PgArguments>,
    q: &'q KeyQuery,
) -> QueryAs<'q, Postgres, KeyLine, PgArguments> {
    if let Some(t) = &q.topic {
        query = query.bind(t);
    }
    if let Some(p) = &q.key_prefix {
        query = query.bind(format!("{}%", crate::dead_letters::like_escaped(p)));
    }
    if let Some(c) = &q.after {
        query = query
            .bind(&c.topic)
            .bind(&c.partition_key)
            .bind(&c.subscriber);
    }
    if let Some(sub) = &q.subscriber {
        query = query.bind(sub);
    }
    query
}

/// Where a page ending with line `k` ends.
fn cursor_of(k: &KeyLine) -> KeyCursor {
    KeyCursor {
        topic: k.topic.to_string(),
        partition_key: k.partition_key.to_string(),
        subscriber: k.subscriber.clone().unwrap_or_default(),
    }
}
