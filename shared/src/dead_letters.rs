//! Guarantee 4 — **nothing fails silently.** Every event ends dispatched and consumed, or as a row in
//! `dead_letters` with its payload, the error and the attempt count: one table, one query, one CLI command, and
//! an alarm on every arrival (the relay's EMF metric `DeadLettered`).
//!
//! Two sources write here: the relay (retry budget exhausted, or a permanent publish error; written inside the
//! relay's settle statement) and QStash (it gave up delivering and called the failure callback; written by
//! [`record_qstash_failure`]). Both are idempotent on `(source, natural_id)`.
//!
//! The operator side (`outbox dead-letters …`): [`list`] (filters, paging by id cursor), [`get`] and
//! [`event_state`] (show), [`redrive`] / [`redrive_matching`] (back through the outbox with the same id and a fresh
//! QStash dedup id; ordered heads unblock their key, middle events only with [`RedriveOptions::out_of_order`] —
//! decision record 0060) and [`purge`] (never touches the outbox; keeps dead letters of blocking heads — 0061).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use sqlx::{PgConnection, Row};

use crate::config::DeadHeadPolicy;
use crate::contract;
use crate::ordering;
use crate::producer::{EventHeaders, is_traceparent};

/// What QStash told us about a message it gave up on (parsed from the failure-callback body), or as much of
/// it as could be parsed.
#[derive(Debug, Clone, Default)]
pub struct QstashFailure {
    /// QStash's DLQ id (`dlqId`): the natural id of the dead letter.
    pub dlq_id: Option<String>,
    /// Our outbox id, from the forwarded `x-outbox-id` header. Kept on the dead letter even when the outbox row
    /// is gone (pruned after dispatch while QStash was still retrying).
    pub outbox_id: Option<i64>,
    /// The topic, from the original message's headers (`x-outbox-topic`) or its URL; used when the outbox row
    /// is gone.
    pub topic: Option<String>,
    /// The partition key (decoded `x-outbox-key` of the original message); used when the outbox row is gone.
    pub partition_key: Option<String>,
    /// QStash's message id (`sourceMessageId`).
    pub source_message_id: Option<String>,
    /// The consumer's last HTTP status (`status`).
    pub status: Option<i32>,
    /// The consumer's last response body (decoded from base64 `body`; lossy UTF-8).
    pub response_body: Option<String>,
    /// `retried` + 1 = delivery attempts made.
    pub attempts: Option<i32>,
    /// The original message body (decoded from base64 `sourceBody`).
    pub source_body: Option<Vec<u8>>,
    /// The original message headers (`sourceHeader`).
    pub source_headers: Option<Value>,
    /// The destination URL.
    pub url: Option<String>,
    /// The callback body as received, kept when it could not be fully parsed.
    pub raw_callback: Option<Vec<u8>>,
    /// Why the body could not be parsed.
    pub parse_error: Option<String>,
}

impl QstashFailure {
    /// The natural id: the `dlqId`, else a hash of the raw callback (so a retried callback is still idempotent).
    pub fn natural_id(&self) -> String {
        if let Some(id) = self.dlq_id.as_deref().filter(|s| !s.is_empty()) {
            return id.to_owned();
        }
        let mut h = Sha256::new();
        h.update(self.raw_callback.as_deref().unwrap_or_default());
        h.update(self.source_message_id.as_deref().unwrap_or_default());
        h.update(self.outbox_id.map(|i| i.to_string()).unwrap_or_default());
        let digest = h.finalize();
        let hex: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
        format!("nodlq-{hex}")
    }

    fn error_text(&self) -> String {
        match (self.status, self.parse_error.as_deref()) {
            (_, Some(e)) => format!("QStash failure callback could not be parsed: {e}"),
            (Some(s), None) => format!(
                "QStash gave up after {} attempt(s); last status {s}",
                self.attempts
                    .map(|a| a.to_string())
                    .unwrap_or_else(|| "?".into())
            ),
            (None, None) => "QStash gave up delivering (no status reported)".into(),
        }
    }
}

/// The result of recording a QStash failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureRecorded {
    /// A new dead letter.
    Recorded {
        /// Its row id.
        dead_letter_id: i64,
        /// The outbox event it belongs to, if known.
        outbox_id: Option<i64>,
    },
    /// The same failure was already recorded (QStash retried the callback).
    Duplicate,
}

/// Records a QStash failure callback as a dead letter, idempotently, and marks the outbox event dead (unless it
/// was delivered after all, in which case the dead letter is stored already resolved). For an ordered head the
/// topic's dead-head policy is applied. Runs in one transaction.
pub async fn record_qstash_failure(
    conn: &mut PgConnection,
    failure: &QstashFailure,
    policy_for_topic: impl Fn(&str) -> DeadHeadPolicy,
    persistent: bool,
) -> Result<FailureRecorded, sqlx::Error> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    // The callback function's pool commits asynchronously (delivery evidence may be lost safely); a dead letter
    // may not: QStash will not call again once it got a 2xx.
    sqlx::query("SET LOCAL synchronous_commit = on")
        .persistent(persistent)
        .execute(&mut *tx)
        .await?;
    let body_json: Option<Value> = failure
        .source_body
        .as_deref()
        .and_then(|b| serde_json::from_slice(b).ok());
    let row = sqlx::query(
        r#"
        INSERT INTO dead_letters (source, natural_id, outbox_id, topic, partition_key, seq, payload, body, headers,
                                  error, status, response_body, attempts, qstash_message_id, dlq_id,
                                  raw_callback, parse_error, resolved_at)
        SELECT 'qstash', $1, coalesce(o.id, $13), coalesce(o.topic, $14), coalesce(o.partition_key, $15), o.seq,
               coalesce(o.payload, $2::jsonb), CASE WHEN o.id IS NULL AND $2::jsonb IS NULL THEN $3::bytea END,
               $4::jsonb, $5, $6, $7, $8, $9, $10, $11, $12,
               CASE WHEN o.delivered_at IS NOT NULL THEN now() END
        FROM (SELECT 1) one
        LEFT JOIN outbox o ON o.id = $13
        ON CONFLICT (source, natural_id) DO NOTHING
        RETURNING id, outbox_id, topic, seq, resolved_at IS NOT NULL AS resolved
        "#,
    )
    .persistent(persistent)
    .bind(failure.natural_id())
    .bind(body_json)
    .bind(failure.source_body.as_deref())
    .bind(failure.source_headers.as_ref())
    .bind(failure.error_text())
    .bind(failure.status)
    .bind(failure.response_body.as_deref())
    .bind(failure.attempts)
    .bind(failure.source_message_id.as_deref())
    .bind(failure.dlq_id.as_deref())
    .bind(failure.raw_callback.as_deref())
    .bind(failure.parse_error.as_deref())
    .bind(failure.outbox_id)
    .bind(failure.topic.as_deref())
    .bind(failure.partition_key.as_deref())
    .fetch_optional(&mut *tx)
    .await?;
    let Some(row) = row else {
        tx.commit().await?;
        return Ok(FailureRecorded::Duplicate);
    };
    let dead_letter_id: i64 = row.try_get("id")?;
    let outbox_id: Option<i64> = row.try_get("outbox_id")?;
    let topic: Option<String> = row.try_get("topic")?;
    let seq: Option<i64> = row.try_get("seq")?;
    let resolved: bool = row.try_get("resolved")?;
    if let (Some(id), false) = (outbox_id, resolved) {
        let error = failure.error_text();
        sqlx::query(
            "UPDATE outbox SET dead_lettered_at = now(), last_error = left($2, 2000), locked_until = NULL \
             WHERE id = $1 AND delivered_at IS NULL",
        )
        .persistent(persistent)
        .bind(id)
        .bind(&error)
        .execute(&mut *tx)
        .await?;
        if let (Some(topic), Some(_)) = (topic, seq) {
            ordering::apply_dead_head(&mut tx, id, policy_for_topic(&topic), &error, persistent)
                .await?;
        }
    }
    tx.commit().await?;
    Ok(FailureRecorded::Recorded {
        dead_letter_id,
        outbox_id,
    })
}

// ------------------------------------------------------------------------------------------------------------
// Operator side: list, show, redrive, purge (the `outbox dead-letters` commands call these; decision record 0060).
// ------------------------------------------------------------------------------------------------------------

/// Where a dead letter came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The relay gave up publishing (retry budget exhausted, or QStash refused the message).
    Relay,
    /// QStash gave up delivering (failure callback).
    Qstash,
}

impl Source {
    /// The value stored in `dead_letters.source`.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Relay => "relay",
            Source::Qstash => "qstash",
        }
    }
}

impl std::str::FromStr for Source {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "relay" => Ok(Source::Relay),
            "qstash" => Ok(Source::Qstash),
            other => Err(format!(
                "unknown dead-letter source {other:?}: expected relay or qstash"
            )),
        }
    }
}

/// Which dead letters an operation applies to. Every set field must match; an empty filter matches everything
/// (bulk redrive and purge refuse an empty filter).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Filter {
    /// Topic.
    pub topic: Option<String>,
    /// Source.
    pub source: Option<Source>,
    /// Partition key.
    pub key: Option<String>,
    /// Recorded at or after.
    pub since: Option<DateTime<Utc>>,
    /// Recorded before.
    pub until: Option<DateTime<Utc>>,
}

impl Filter {
    /// True when no field is set.
    pub fn is_empty(&self) -> bool {
        self.topic.is_none()
            && self.source.is_none()
            && self.key.is_none()
            && self.since.is_none()
            && self.until.is_none()
    }
}

/// The filter as SQL over `dead_letters d`, parameters `$1..$5`.
const FILTER_SQL: &str = "($1::text IS NULL OR d.topic = $1) AND ($2::text IS NULL OR d.source = $2) \
     AND ($3::text IS NULL OR d.partition_key = $3) AND ($4::timestamptz IS NULL OR d.created_at >= $4) \
     AND ($5::timestamptz IS NULL OR d.created_at < $5)";

/// Not redriven and not resolved: still needs an operator.
const UNHANDLED_SQL: &str = "d.redriven_at IS NULL AND d.resolved_at IS NULL";

fn bind_filter<'q>(
    q: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    f: &'q Filter,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    q.bind(f.topic.as_deref())
        .bind(f.source.map(Source::as_str))
        .bind(f.key.as_deref())
        .bind(f.since)
        .bind(f.until)
}

/// One line of `outbox dead-letters list`.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct DeadLetterSummary {
    /// Row id (the handle for show/redrive).
    pub id: i64,
    /// When it was recorded.
    pub created_at: DateTime<Utc>,
    /// `relay` or `qstash`.
    pub source: String,
    /// The outbox event, if known.
    pub outbox_id: Option<i64>,
    /// Topic, if known.
    pub topic: Option<String>,
    /// Partition key, if known.
    pub partition_key: Option<String>,
    /// Per-key sequence (ordered topics).
    pub seq: Option<i64>,
    /// Attempts made (relay: publish attempts; QStash: delivery attempts).
    pub attempts: Option<i32>,
    /// HTTP status (QStash's answer to a publish, or the consumer's answer to the last delivery).
    pub status: Option<i32>,
    /// Why it died.
    pub error: String,
    /// When it was redriven.
    pub redriven_at: Option<DateTime<Utc>>,
    /// When it turned out delivered after all.
    pub resolved_at: Option<DateTime<Utc>>,
}

impl DeadLetterSummary {
    /// `unhandled`, `redriven` or `resolved`.
    pub fn state(&self) -> &'static str {
        state_of(self.redriven_at, self.resolved_at)
    }
}

fn state_of(redriven: Option<DateTime<Utc>>, resolved: Option<DateTime<Utc>>) -> &'static str {
    match (redriven, resolved) {
        (Some(_), _) => "redriven",
        (None, Some(_)) => "resolved",
        (None, None) => "unhandled",
    }
}

/// A page request for [`list`].
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    /// Which dead letters.
    pub filter: Filter,
    /// Also list dead letters already redriven or resolved.
    pub include_handled: bool,
    /// Only ids greater than this (the cursor of the previous page).
    pub after: Option<i64>,
    /// Page size.
    pub limit: u32,
}

/// One page of dead letters, oldest first.
#[derive(Debug, Clone, Serialize)]
pub struct Page {
    /// The dead letters.
    pub items: Vec<DeadLetterSummary>,
    /// Pass as `after` for the next page; `None` when this was the last page.
    pub next_after: Option<i64>,
}

/// Lists dead letters by id (oldest first), one page at a time.
pub async fn list(conn: &mut PgConnection, q: &ListQuery) -> Result<Page, sqlx::Error> {
    let limit = q.limit.clamp(1, 10_000);
    let sql = format!(
        "SELECT d.id, d.created_at, d.source, d.outbox_id, d.topic, d.partition_key, d.seq, d.attempts, d.status, \
                d.error, d.redriven_at, d.resolved_at \
         FROM dead_letters d \
         WHERE {FILTER_SQL} AND ($6 OR ({UNHANDLED_SQL})) AND d.id > $7 \
         ORDER BY d.id LIMIT {}",
        limit + 1
    );
    let rows = bind_filter(sqlx::query(sqlx::AssertSqlSafe(sql)), &q.filter)
        .bind(q.include_handled)
        .bind(q.after.unwrap_or(0))
        .fetch_all(&mut *conn)
        .await?;
    let mut items = rows
        .iter()
        .map(<DeadLetterSummary as sqlx::FromRow<_>>::from_row)
        .collect::<Result<Vec<_>, _>>()?;
    let more = items.len() > limit as usize;
    items.truncate(limit as usize);
    let next_after = if more {
        items.last().map(|d| d.id)
    } else {
        None
    };
    Ok(Page { items, next_after })
}

/// Everything stored about one dead letter.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct DeadLetter {
    /// Row id.
    pub id: i64,
    /// `relay` or `qstash`.
    pub source: String,
    /// `'<outbox id>/<lease token>'` (relay) or QStash's `dlqId`.
    pub natural_id: String,
    /// The outbox event, if known.
    pub outbox_id: Option<i64>,
    /// Topic.
    pub topic: Option<String>,
    /// Partition key.
    pub partition_key: Option<String>,
    /// Per-key sequence.
    pub seq: Option<i64>,
    /// The event payload, when it is JSON.
    pub payload: Option<Value>,
    /// The raw body when it is not JSON.
    pub body: Option<Vec<u8>>,
    /// Relay: the event's headers (`traceparent`, …); QStash: the original message's HTTP headers.
    pub headers: Option<Value>,
    /// Why it died.
    pub error: String,
    /// HTTP status.
    pub status: Option<i32>,
    /// The last response body (QStash's refusal, or the consumer's answer).
    pub response_body: Option<String>,
    /// Attempts made.
    pub attempts: Option<i32>,
    /// QStash's message id.
    pub qstash_message_id: Option<String>,
    /// QStash's DLQ id.
    pub dlq_id: Option<String>,
    /// A failure-callback body that could not be parsed, as received.
    pub raw_callback: Option<Vec<u8>>,
    /// Why it could not be parsed.
    pub parse_error: Option<String>,
    /// Recorded at.
    pub created_at: DateTime<Utc>,
    /// Redriven at.
    pub redriven_at: Option<DateTime<Utc>>,
    /// Resolved (delivered after all) at.
    pub resolved_at: Option<DateTime<Utc>>,
}

impl DeadLetter {
    /// `unhandled`, `redriven` or `resolved`.
    pub fn state(&self) -> &'static str {
        state_of(self.redriven_at, self.resolved_at)
    }
}

/// One dead letter by id.
pub async fn get(conn: &mut PgConnection, id: i64) -> Result<Option<DeadLetter>, sqlx::Error> {
    sqlx::query_as::<_, DeadLetter>(
        "SELECT id, source, natural_id, outbox_id, topic, partition_key, seq, payload, body, headers, error, status, \
                response_body, attempts, qstash_message_id, dlq_id, raw_callback, parse_error, created_at, \
                redriven_at, resolved_at \
         FROM dead_letters WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(&mut *conn)
    .await
}

/// The current state of a dead letter's outbox event (for `show`).
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct EventState {
    /// Outbox id.
    pub id: i64,
    /// Per-key sequence now (NULL after an out-of-order redrive).
    pub seq: Option<i64>,
    /// Publish attempts of the current round.
    pub attempts: i32,
    /// Redrives so far.
    pub redrive_count: i32,
    /// Accepted by QStash at.
    pub dispatched_at: Option<DateTime<Utc>>,
    /// Delivery evidence at.
    pub delivered_at: Option<DateTime<Utc>>,
    /// Dead at.
    pub dead_lettered_at: Option<DateTime<Utc>>,
    /// Last error.
    pub last_error: Option<String>,
    /// The key's `done_seq` (ordered topics with an active key row).
    pub key_done_seq: Option<i64>,
    /// The event that blocks the key, if any.
    pub key_blocked_by: Option<i64>,
}

impl EventState {
    /// `pending`, `dispatched`, `delivered` or `dead`.
    pub fn state(&self) -> &'static str {
        if self.delivered_at.is_some() {
            "delivered"
        } else if self.dead_lettered_at.is_some() {
            "dead"
        } else if self.dispatched_at.is_some() {
            "dispatched"
        } else {
            "pending"
        }
    }
}

/// The outbox row of an event and its key's state; `None` when the row is gone (pruned).
pub async fn event_state(
    conn: &mut PgConnection,
    outbox_id: i64,
) -> Result<Option<EventState>, sqlx::Error> {
    sqlx::query_as::<_, EventState>(
        "SELECT o.id, o.seq, o.attempts, o.redrive_count, o.dispatched_at, o.delivered_at, o.dead_lettered_at, \
                o.last_error, k.done_seq AS key_done_seq, k.blocked_id AS key_blocked_by \
         FROM outbox o LEFT JOIN outbox_keys k ON o.seq IS NOT NULL AND k.topic = o.topic \
                                              AND k.partition_key = o.partition_key \
         WHERE o.id = $1",
    )
    .bind(outbox_id)
    .fetch_optional(&mut *conn)
    .await
}

/// How to redrive.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RedriveOptions {
    /// Allow redriving an ordered event its key has already moved past, as an **unordered** event (its sequence
    /// is dropped: it will be applied after later events of its key). Without it such a redrive is refused.
    pub out_of_order: bool,
}

/// Where a redriven event goes relative to its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RedriveOrder {
    /// An unordered topic's event.
    Unordered,
    /// An ordered event, still in order: it is its key's head again (the key's block, if it was this event's,
    /// is cleared and everything behind it follows in order), or it waits behind earlier events of its key.
    InOrder {
        /// Its sequence.
        seq: i64,
        /// The key was blocked by this event and is free again.
        key_unblocked: bool,
    },
    /// An ordered event its key had moved past, republished as an unordered event (`--out-of-order`).
    OutOfOrder {
        /// The sequence it had.
        former_seq: i64,
    },
}

/// What a successful redrive did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Redriven {
    /// The dead letter.
    pub dead_letter_id: i64,
    /// The event (same id: the consumer's dedupe key).
    pub outbox_id: i64,
    /// Topic.
    pub topic: String,
    /// Partition key.
    pub partition_key: String,
    /// Order semantics.
    pub order: RedriveOrder,
    /// The outbox row was gone (pruned) and was re-inserted from the dead letter.
    pub reinserted: bool,
    /// The event's redrive count now.
    pub redrive_count: i32,
    /// The QStash deduplication id the relay will use (`outbox-<id>-r<n>`).
    pub dedup_id: String,
    /// Other unhandled dead letters of the same event, marked redriven too (one event can die more than once
    /// before anyone looks, e.g. a relay dead letter and a QStash one).
    pub also_marked: Vec<i64>,
}

/// Why a dead letter was not redriven.
#[derive(Debug, thiserror::Error)]
pub enum RedriveError {
    /// No such dead letter.
    #[error("dead letter #{0} does not exist (list them with `outbox dead-letters list`)")]
    NotFound(i64),
    /// Redriven before.
    #[error(
        "dead letter #{id} was already redriven at {at}; if the event failed again, it has a newer dead letter \
         (`outbox dead-letters list --topic …`) — redrive that one"
    )]
    AlreadyRedriven {
        /// Dead letter.
        id: i64,
        /// When.
        at: DateTime<Utc>,
    },
    /// The event was delivered after all.
    #[error(
        "dead letter #{id}: event #{outbox_id} was delivered after all (at {at}); nothing to redrive — purge the dead \
         letter if you no longer need it"
    )]
    Delivered {
        /// Dead letter.
        id: i64,
        /// Event.
        outbox_id: i64,
        /// When.
        at: DateTime<Utc>,
    },
    /// Not linked to an event.
    #[error(
        "dead letter #{id} is not linked to an outbox event (the failure callback carried no x-outbox-id{}): it \
         cannot be redriven. Inspect it with `outbox dead-letters show {id}`, republish by hand if needed, then purge it",
        if *.parse_error { "; its raw body could not be parsed" } else { "" }
    )]
    NoOutboxId {
        /// Dead letter.
        id: i64,
        /// The callback could not be parsed.
        parse_error: bool,
    },
    /// The outbox row is gone and the dead letter lacks what a re-insert needs.
    #[error(
        "dead letter #{id}: event #{outbox_id}'s outbox row is gone (pruned) and the dead letter has no {missing} to \
         rebuild it from; inspect it with `outbox dead-letters show {id}` and republish by hand"
    )]
    CannotRebuild {
        /// Dead letter.
        id: i64,
        /// Event.
        outbox_id: i64,
        /// What is missing: `JSON payload`, `topic`, `partition key`.
        missing: &'static str,
    },
    /// The event is live again (another dead letter of it was redriven).
    #[error(
        "dead letter #{id}: event #{outbox_id} is not dead any more (it is {state}: redriven through another dead \
         letter?); nothing to do"
    )]
    NotDead {
        /// Dead letter.
        id: i64,
        /// Event.
        outbox_id: i64,
        /// `pending` or `dispatched`.
        state: &'static str,
    },
    /// An ordered event its key has moved past: refused without `out_of_order`.
    #[error(
        "dead letter #{id}: event #{outbox_id} (topic {topic:?}, key {key:?}, seq {seq}) is in the middle of its key: \
         {why}. Redriving it now would deliver it AFTER later events of the same key. If the consumer can take that, \
         redrive it with --out-of-order: it is republished as an unordered event (its sequence is dropped, so the \
         consumer's per-key order check does not refuse it as late)"
    )]
    OutOfOrder {
        /// Dead letter.
        id: i64,
        /// Event.
        outbox_id: i64,
        /// Topic.
        topic: String,
        /// Key.
        key: String,
        /// Its sequence.
        seq: i64,
        /// Why it is a middle event.
        why: String,
    },
    /// A bulk operation needs at least one filter.
    #[error(
        "a bulk operation needs at least one filter (--topic, --source, --key, --since, --until), so that it cannot \
         touch every dead letter by accident"
    )]
    FilterRequired,
    /// A database error.
    #[error("database error: {0} (is Postgres reachable? the operation is safe to retry)")]
    Database(#[from] sqlx::Error),
}

impl RedriveError {
    /// True for an ordered event refused because `out_of_order` was not set.
    pub fn is_out_of_order(&self) -> bool {
        matches!(self, RedriveError::OutOfOrder { .. })
    }
}

#[derive(sqlx::FromRow)]
struct DlRow {
    id: i64,
    source: String,
    outbox_id: Option<i64>,
    topic: Option<String>,
    partition_key: Option<String>,
    seq: Option<i64>,
    payload: Option<Value>,
    headers: Option<Value>,
    error: String,
    parse_error: Option<String>,
    raw_callback: Option<Vec<u8>>,
    redriven_at: Option<DateTime<Utc>>,
    resolved_at: Option<DateTime<Utc>>,
}

#[derive(sqlx::FromRow)]
struct OutboxRow {
    topic: String,
    partition_key: String,
    seq: Option<i64>,
    dispatched_at: Option<DateTime<Utc>>,
    delivered_at: Option<DateTime<Utc>>,
    dead_lettered_at: Option<DateTime<Utc>>,
    last_error: Option<String>,
}

/// The event headers (`traceparent`, correlation id, schema version) of a dead letter, for re-inserting a pruned
/// event: a relay dead letter stores the event's own headers; a QStash one the original HTTP headers
/// (`{name: [values]}`, forwarded ones possibly prefixed `Upstash-Forward-`), to which the failure callback adds
/// the signed envelope's headers and schema version.
pub fn event_headers_of(source: &str, headers: Option<&Value>) -> EventHeaders {
    let Some(h) = headers else {
        return EventHeaders::default();
    };
    let mut out = if source == "relay" {
        serde_json::from_value::<EventHeaders>(h.clone()).unwrap_or_default()
    } else {
        let find = |name: &str| -> Option<String> {
            let forwarded = format!("upstash-forward-{name}");
            h.as_object()?.iter().find_map(|(k, v)| {
                if k.eq_ignore_ascii_case(name) || k.eq_ignore_ascii_case(&forwarded) {
                    match v {
                        Value::String(s) => Some(s.clone()),
                        Value::Array(a) => a.iter().find_map(Value::as_str).map(str::to_owned),
                        _ => None,
                    }
                } else {
                    None
                }
            })
        };
        EventHeaders {
            traceparent: find(contract::TRACEPARENT),
            correlation_id: find(contract::CORRELATION_ID),
            schema_version: find(contract::legacy::SCHEMA_VERSION)
                .and_then(|v| v.trim().parse().ok()),
        }
    };
    // Whatever does not pass the producer's rules is dropped rather than blocking the redrive.
    if out
        .traceparent
        .as_deref()
        .is_some_and(|t| !is_traceparent(t))
    {
        out.traceparent = None;
    }
    if out.correlation_id.as_deref().is_some_and(|c| {
        c.is_empty() || c.len() > 256 || !c.bytes().all(|b| (0x21..=0x7e).contains(&b))
    }) {
        out.correlation_id = None;
    }
    if out.schema_version == Some(0) {
        out.schema_version = None;
    }
    out
}

/// Redrives one dead letter, in one transaction (see decision record 0060 for the full contract):
///
/// * the event keeps its outbox id (the consumer's dedupe key) and its `redrive_count` goes up, so the relay
///   publishes it with a fresh QStash deduplication id (`outbox-<id>-r<n>`) that QStash's dedup window cannot
///   swallow;
/// * an existing outbox row is reset to pending (attempts 0, due now, lease and QStash message id cleared);
/// * an ordered event that is its key's head (the key is blocked by it) unblocks the key: it goes first and
///   everything behind it follows in order;
/// * an ordered event its key has moved past (a "middle" event) is refused unless
///   [`RedriveOptions::out_of_order`], which republishes it as an unordered event (sequence dropped);
/// * a pruned outbox row is re-inserted from the dead letter with the same id (unordered: a pruned ordered event
///   is by definition behind its key, so it needs `out_of_order`);
/// * the dead letter (and any other unhandled dead letter of the same event) gets `redriven_at`.
pub async fn redrive(
    conn: &mut PgConnection,
    dead_letter_id: i64,
    opts: RedriveOptions,
) -> Result<Redriven, RedriveError> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let result = redrive_in(&mut tx, dead_letter_id, opts).await;
    match result {
        Ok(r) => {
            tx.commit().await?;
            Ok(r)
        }
        Err(e) => {
            // Nothing was written; a failed rollback only leaves the connection to the pool's cleanup.
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}

async fn redrive_in(
    tx: &mut PgConnection,
    dl_id: i64,
    opts: RedriveOptions,
) -> Result<Redriven, RedriveError> {
    let d: DlRow = sqlx::query_as(
        "SELECT id, source, outbox_id, topic, partition_key, seq, payload, headers, error, parse_error, raw_callback, \
                redriven_at, resolved_at \
         FROM dead_letters WHERE id = $1 FOR UPDATE",
    )
    .bind(dl_id)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or(RedriveError::NotFound(dl_id))?;
    if let Some(at) = d.redriven_at {
        return Err(RedriveError::AlreadyRedriven { id: d.id, at });
    }
    let Some(outbox_id) = d.outbox_id else {
        return Err(RedriveError::NoOutboxId {
            id: d.id,
            parse_error: d.parse_error.is_some() || d.raw_callback.is_some(),
        });
    };
    if let Some(at) = d.resolved_at {
        return Err(RedriveError::Delivered {
            id: d.id,
            outbox_id,
            at,
        });
    }
    let row: Option<OutboxRow> = sqlx::query_as(
        "SELECT topic, partition_key, seq, dispatched_at, delivered_at, dead_lettered_at, last_error \
         FROM outbox WHERE id = $1 FOR UPDATE",
    )
    .bind(outbox_id)
    .fetch_optional(&mut *tx)
    .await?;
    let note = |was: &str| -> String {
        let was: String = was.chars().take(1800).collect();
        format!("redriven from dead letter #{} (was: {was})", d.id)
    };

    let (topic, key, order, reinserted, redrive_count) = match row {
        Some(o) => {
            if let Some(at) = o.delivered_at {
                return Err(RedriveError::Delivered {
                    id: d.id,
                    outbox_id,
                    at,
                });
            }
            if o.dead_lettered_at.is_none() {
                return Err(RedriveError::NotDead {
                    id: d.id,
                    outbox_id,
                    state: if o.dispatched_at.is_some() {
                        "dispatched"
                    } else {
                        "pending"
                    },
                });
            }
            let order = match o.seq {
                None => RedriveOrder::Unordered,
                Some(seq) => {
                    ordered_position(tx, &d, outbox_id, &o.topic, &o.partition_key, seq, opts)
                        .await?
                }
            };
            let drop_seq = matches!(order, RedriveOrder::OutOfOrder { .. });
            let count: i32 = sqlx::query_scalar(
                "UPDATE outbox SET dispatched_at = NULL, delivered_at = NULL, dead_lettered_at = NULL, attempts = 0, \
                        available_at = now(), locked_until = NULL, lease_token = NULL, qstash_message_id = NULL, \
                        last_error = $2, redrive_count = redrive_count + 1, \
                        seq = CASE WHEN $3 THEN NULL ELSE seq END \
                 WHERE id = $1 RETURNING redrive_count",
            )
            .bind(outbox_id)
            .bind(note(o.last_error.as_deref().unwrap_or(&d.error)))
            .bind(drop_seq)
            .fetch_one(&mut *tx)
            .await?;
            if let RedriveOrder::InOrder {
                key_unblocked: true,
                ..
            } = order
            {
                sqlx::query(
                    "UPDATE outbox_keys SET blocked_at = NULL, blocked_id = NULL, blocked_reason = NULL, \
                            inflight_id = NULL, inflight_since = NULL, lease_token = NULL, locked_until = NULL, \
                            available_at = now() \
                     WHERE topic = $1 AND partition_key = $2",
                )
                .bind(&o.topic)
                .bind(&o.partition_key)
                .execute(&mut *tx)
                .await?;
            }
            (o.topic, o.partition_key, order, false, count)
        }
        None => {
            let missing = |what| RedriveError::CannotRebuild {
                id: d.id,
                outbox_id,
                missing: what,
            };
            let payload = d.payload.as_ref().ok_or_else(|| missing("JSON payload"))?;
            let topic = d
                .topic
                .clone()
                .filter(|t| crate::producer::validate_topic(t).is_ok())
                .ok_or_else(|| missing("topic"))?;
            let key = d
                .partition_key
                .clone()
                .filter(|k| !k.is_empty())
                .ok_or_else(|| missing("partition key"))?;
            let order = match d.seq {
                None => RedriveOrder::Unordered,
                Some(seq) if opts.out_of_order => RedriveOrder::OutOfOrder { former_seq: seq },
                Some(seq) => {
                    return Err(RedriveError::OutOfOrder {
                        id: d.id,
                        outbox_id,
                        topic,
                        key,
                        seq,
                        why: "its outbox row was pruned, so its key has moved on; it can only be re-inserted \
                              as an unordered event"
                            .into(),
                    });
                }
            };
            let earlier: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM dead_letters WHERE outbox_id = $1 AND redriven_at IS NOT NULL",
            )
            .bind(outbox_id)
            .fetch_one(&mut *tx)
            .await?;
            let count = i32::try_from(earlier + 1).unwrap_or(i32::MAX);
            let headers = serde_json::to_value(event_headers_of(&d.source, d.headers.as_ref()))
                .unwrap_or_else(|_| Value::Object(Default::default()));
            sqlx::query(
                "INSERT INTO outbox (id, topic, partition_key, seq, payload, headers, redrive_count, last_error) \
                 OVERRIDING SYSTEM VALUE VALUES ($1, $2, $3, NULL, $4, $5, $6, $7)",
            )
            .bind(outbox_id)
            .bind(&topic)
            .bind(&key)
            .bind(payload)
            .bind(&headers)
            .bind(count)
            .bind(note(&d.error))
            .execute(&mut *tx)
            .await?;
            (topic, key, order, true, count)
        }
    };

    let marked: Vec<i64> = sqlx::query_scalar(
        "UPDATE dead_letters SET redriven_at = now() \
         WHERE id = $1 OR (outbox_id = $2 AND redriven_at IS NULL AND resolved_at IS NULL) RETURNING id",
    )
    .bind(d.id)
    .bind(outbox_id)
    .fetch_all(&mut *tx)
    .await?;
    let mut also_marked: Vec<i64> = marked.into_iter().filter(|i| *i != d.id).collect();
    also_marked.sort_unstable();
    tracing::info!(dead_letter_id = d.id, outbox_id, topic = %topic, key = %key, order = ?order, reinserted,
        redrive_count, "dead letter redriven");
    Ok(Redriven {
        dead_letter_id: d.id,
        outbox_id,
        topic,
        partition_key: key,
        order,
        reinserted,
        redrive_count,
        dedup_id: contract::dedup_id(outbox_id, redrive_count),
        also_marked,
    })
}

/// Where an ordered event stands in its key: in order (head, or behind earlier unfinished events) or a middle
/// event (the key is past it, gone, or blocked by another event at its place). Locks the key row.
async fn ordered_position(
    tx: &mut PgConnection,
    d: &DlRow,
    outbox_id: i64,
    topic: &str,
    key: &str,
    seq: i64,
    opts: RedriveOptions,
) -> Result<RedriveOrder, RedriveError> {
    let k: Option<(i64, Option<i64>)> = sqlx::query_as(
        "SELECT done_seq, blocked_id FROM outbox_keys WHERE topic = $1 AND partition_key = $2 FOR UPDATE",
    )
    .bind(topic)
    .bind(key)
    .fetch_optional(&mut *tx)
    .await?;
    let why = match k {
        Some((done, blocked)) if done == seq - 1 && blocked.is_none_or(|b| b == outbox_id) => {
            // The key's head (blocked by it, or stuck on it): unblock, it goes first.
            return Ok(RedriveOrder::InOrder {
                seq,
                key_unblocked: true,
            });
        }
        Some((done, _)) if done < seq - 1 => {
            // Earlier events of the key are not finished: it simply waits for its turn.
            return Ok(RedriveOrder::InOrder {
                seq,
                key_unblocked: false,
            });
        }
        Some((done, Some(b))) if done == seq - 1 => {
            format!("its key is blocked by another event (#{b})")
        }
        Some((done, _)) => format!(
            "its key has moved past it (sequence {done} is finished; this event is {seq}), so later events were \
             already delivered"
        ),
        None => "its key has no pending work any more (every later event is finished)".to_owned(),
    };
    if opts.out_of_order {
        Ok(RedriveOrder::OutOfOrder { former_seq: seq })
    } else {
        Err(RedriveError::OutOfOrder {
            id: d.id,
            outbox_id,
            topic: topic.to_owned(),
            key: key.to_owned(),
            seq,
            why,
        })
    }
}

/// The outcome of one dead letter in a bulk redrive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum BulkOutcome {
    /// Redriven.
    Redriven(Redriven),
    /// Left as it is (with why): a middle event without `out_of_order`, an event that is live again, a dead letter
    /// that cannot be redriven.
    Skipped {
        /// Dead letter.
        dead_letter_id: i64,
        /// A middle ordered event (would need `--out-of-order`).
        out_of_order: bool,
        /// Why.
        reason: String,
    },
    /// A database error on this item (the others go on).
    Failed {
        /// Dead letter.
        dead_letter_id: i64,
        /// The error.
        error: String,
    },
}

/// Totals of a bulk redrive.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct BulkReport {
    /// Redriven.
    pub redriven: u64,
    /// Skipped (of which `out_of_order` would need `--out-of-order`).
    pub skipped: u64,
    /// Middle events skipped.
    pub out_of_order: u64,
    /// Failed.
    pub failed: u64,
}

/// Counts the unhandled dead letters a filter matches (what a bulk redrive would try).
pub async fn count_unhandled(conn: &mut PgConnection, filter: &Filter) -> Result<i64, sqlx::Error> {
    let sql = format!("SELECT count(*) FROM dead_letters d WHERE {FILTER_SQL} AND {UNHANDLED_SQL}");
    let row = bind_filter(sqlx::query(sqlx::AssertSqlSafe(sql)), filter)
        .fetch_one(&mut *conn)
        .await?;
    row.try_get(0)
}

/// Redrives every unhandled dead letter matching `filter` (at least one field set), oldest first, each in its
/// own transaction; dead letters recorded after the start are left alone. `on_item` sees each outcome as it
/// happens (progress).
pub async fn redrive_matching(
    pool: &sqlx::PgPool,
    filter: &Filter,
    opts: RedriveOptions,
    mut on_item: impl FnMut(&BulkOutcome),
) -> Result<BulkReport, RedriveError> {
    if filter.is_empty() {
        return Err(RedriveError::FilterRequired);
    }
    let mut conn = pool.acquire().await?;
    let upto: i64 = sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM dead_letters")
        .fetch_one(&mut *conn)
        .await?;
    let sql = format!(
        "SELECT d.id FROM dead_letters d WHERE {FILTER_SQL} AND {UNHANDLED_SQL} AND d.id > $6 AND d.id <= $7 \
         ORDER BY d.id LIMIT 500"
    );
    let mut report = BulkReport::default();
    let mut after = 0i64;
    loop {
        let ids: Vec<i64> = bind_filter(sqlx::query(sqlx::AssertSqlSafe(sql.clone())), filter)
            .bind(after)
            .bind(upto)
            .fetch_all(&mut *conn)
            .await?
            .iter()
            .map(|r| r.try_get(0))
            .collect::<Result<_, _>>()?;
        let Some(last) = ids.last().copied() else {
            break;
        };
        after = last;
        for id in ids {
            let outcome = match redrive(&mut conn, id, opts).await {
                Ok(r) => {
                    report.redriven += 1;
                    BulkOutcome::Redriven(r)
                }
                Err(RedriveError::Database(e)) => {
                    report.failed += 1;
                    BulkOutcome::Failed {
                        dead_letter_id: id,
                        error: e.to_string(),
                    }
                }
                Err(e) => {
                    report.skipped += 1;
                    let out_of_order = e.is_out_of_order();
                    report.out_of_order += u64::from(out_of_order);
                    BulkOutcome::Skipped {
                        dead_letter_id: id,
                        out_of_order,
                        reason: e.to_string(),
                    }
                }
            };
            on_item(&outcome);
        }
    }
    Ok(report)
}

/// The condition that keeps a dead letter from being purged: it is unhandled and its event blocks an ordered
/// key (purging it would leave a blocked key with nothing to redrive).
const BLOCKING_SQL: &str = "(d.redriven_at IS NULL AND d.resolved_at IS NULL AND d.outbox_id IS NOT NULL \
     AND EXISTS (SELECT 1 FROM outbox_keys k WHERE k.blocked_id = d.outbox_id))";

/// What a purge would do / did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PurgeCounts {
    /// Dead letters deleted (or that would be).
    pub deleted: i64,
    /// Matching dead letters kept because their event blocks an ordered key (redrive them instead).
    pub kept_blocking: i64,
}

/// Counts what [`purge`] would delete.
pub async fn count_purge(
    conn: &mut PgConnection,
    filter: &Filter,
    handled_only: bool,
) -> Result<PurgeCounts, sqlx::Error> {
    let sql = format!(
        "SELECT count(*) FILTER (WHERE NOT {BLOCKING_SQL}), count(*) FILTER (WHERE {BLOCKING_SQL}) \
         FROM dead_letters d WHERE {FILTER_SQL} AND (NOT $6 OR NOT ({UNHANDLED_SQL}))"
    );
    let row = bind_filter(sqlx::query(sqlx::AssertSqlSafe(sql)), filter)
        .bind(handled_only)
        .fetch_one(&mut *conn)
        .await?;
    Ok(PurgeCounts {
        deleted: row.try_get(0)?,
        kept_blocking: row.try_get(1)?,
    })
}

/// Deletes the dead letters matching `filter` (at least one field set; `handled_only`: only redriven or resolved
/// ones), in batches of `batch`, calling `on_batch` with the running total. **The outbox rows are not touched**:
/// a dead event stays in `outbox` (dead) until `outbox prune` removes it. Dead letters whose event blocks an
/// ordered key are kept (counted in `kept_blocking`): redrive them instead.
pub async fn purge(
    pool: &sqlx::PgPool,
    filter: &Filter,
    handled_only: bool,
    batch: u32,
    mut on_batch: impl FnMut(i64),
) -> Result<PurgeCounts, RedriveError> {
    if filter.is_empty() {
        return Err(RedriveError::FilterRequired);
    }
    let mut conn = pool.acquire().await?;
    let kept = count_purge(&mut conn, filter, handled_only)
        .await?
        .kept_blocking;
    let sql = format!(
        "DELETE FROM dead_letters WHERE id IN (SELECT d.id FROM dead_letters d \
         WHERE {FILTER_SQL} AND (NOT $6 OR NOT ({UNHANDLED_SQL})) AND NOT {BLOCKING_SQL} \
         ORDER BY d.id LIMIT {} FOR UPDATE SKIP LOCKED)",
        batch.clamp(1, 100_000)
    );
    let mut deleted = 0i64;
    loop {
        let n = bind_filter(sqlx::query(sqlx::AssertSqlSafe(sql.clone())), filter)
            .bind(handled_only)
            .execute(&mut *conn)
            .await?
            .rows_affected();
        if n == 0 {
            break;
        }
        deleted += n as i64;
        on_batch(deleted);
    }
    tracing::info!(deleted, kept_blocking = kept, "dead letters purged");
    Ok(PurgeCounts {
        deleted,
        kept_blocking: kept,
    })
}
