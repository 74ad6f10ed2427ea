//! Querying, for `outbox dead-letters list` and `show` and the counts the CLI prints before a bulk operation:
//! [`list`] (filters, paging by id cursor), [`get`], [`event_state`], [`count_unhandled`]; and
//! [`event_headers_of`], which reads an event's headers back from what a dead letter stored.

use crate::ids::DeadLetterId;
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::{PgConnection, Row};

use super::{FILTER_SQL, Filter, UNHANDLED_SQL, bind_filter};
use crate::contract;
use crate::ids::{OutboxId, PartitionKey, TopicName};
use crate::producer::EventHeaders;
use crate::telemetry::spans::is_traceparent;

/// One line of `outbox dead-letters list`.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct DeadLetterSummary {
    /// Row id (the handle for show/redrive).
    pub id: DeadLetterId,
    /// When it was recorded.
    pub created_at: DateTime<Utc>,
    /// `relay` or `qstash`.
    pub source: String,
    /// The outbox event, if known.
    pub outbox_id: Option<OutboxId>,
    pub topic: Option<TopicName>,
    /// Partition key, if known.
    pub partition_key: Option<PartitionKey>,
    /// Whose delivery it was (`''`: the default subscriber; see `crate::subscribers`).
    pub subscriber: String,
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
    /// When it turned out done after all (see `resolution`).
    pub resolved_at: Option<DateTime<Utc>>,
    /// How it turned out done: `delivered` (delivery evidence came later) or `applied` (QStash gave up, but the
    /// consumer's dedupe row shows the event applied: every response was lost on the way back).
    pub resolution: Option<String>,
}

impl DeadLetterSummary {
    /// `unhandled`, `redriven`, `resolved` (delivered after all) or `applied` (the consumer applied it although
    /// QStash gave up). Only `unhandled` needs an operator.
    pub fn state(&self) -> &'static str {
        state_of(
            self.redriven_at,
            self.resolved_at,
            self.resolution.as_deref(),
        )
    }
}

fn state_of(
    redriven: Option<DateTime<Utc>>,
    resolved: Option<DateTime<Utc>>,
    resolution: Option<&str>,
) -> &'static str {
    match (redriven, resolved, resolution) {
        (Some(_), _, _) => "redriven",
        (None, Some(_), Some("applied")) => "applied",
        (None, Some(_), Some("withdrawn")) => "withdrawn",
        (None, Some(_), _) => "resolved",
        (None, None, _) => "unhandled",
    }
}

/// Which of the dead letters a filter matches a listing shows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Listing {
    /// The unhandled ones only (neither redriven nor resolved).
    #[default]
    Unhandled,
    /// All of them, handled ones too.
    All,
}

/// A page request for [`list`].
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    pub filter: Filter,
    /// The unhandled dead letters only, or all.
    pub listing: Listing,
    /// Only ids greater than this (the cursor of the previous page).
    pub after: Option<DeadLetterId>,
    /// Page size.
    pub limit: u32,
}

/// One page of dead letters, oldest first.
#[derive(Debug, Clone, Serialize)]
pub struct Page {
    pub items: Vec<DeadLetterSummary>,
    /// Pass as `after` for the next page; `None` when this was the last page.
    pub next_after: Option<DeadLetterId>,
}

/// Lists dead letters by id (oldest first), one page at a time.
pub async fn list(conn: &mut PgConnection, q: &ListQuery) -> Result<Page, sqlx::Error> {
    let limit = q.limit.clamp(1, 10_000);
    let schema = crate::schema::current().quoted();
    let sql = format!(
        "SELECT d.id, d.created_at, d.source, d.outbox_id, d.topic, d.partition_key, d.subscriber, d.seq, d.attempts, \
                d.status, d.error, d.redriven_at, d.resolved_at, d.resolution \
         FROM {schema}.dead_letters d \
         WHERE {FILTER_SQL} AND ($10 OR ({UNHANDLED_SQL})) AND d.id > $11 \
         ORDER BY d.id LIMIT {}",
        limit + 1
    );
    let rows = bind_filter(sqlx::query(sqlx::AssertSqlSafe(sql)), &q.filter)
        .bind(q.listing == Listing::All)
        .bind(q.after.unwrap_or(DeadLetterId(0)))
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
    pub id: DeadLetterId,
    /// `relay` or `qstash`.
    pub source: String,
    /// `'<outbox id>/<lease token>'` (relay) or QStash's `dlqId`.
    pub natural_id: String,
    /// The outbox event, if known.
    pub outbox_id: Option<OutboxId>,
    pub topic: Option<TopicName>,
    pub partition_key: Option<PartitionKey>,
    /// Whose delivery it was (`''`: the default subscriber; see `crate::subscribers`).
    pub subscriber: String,
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
    pub attempts: Option<i32>,
    /// QStash's message id.
    pub qstash_message_id: Option<String>,
    /// QStash's DLQ id.
    pub dlq_id: Option<String>,
    /// A failure-callback body that could not be parsed, as received.
    pub raw_callback: Option<Vec<u8>>,
    /// Why it could not be parsed.
    pub parse_error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub redriven_at: Option<DateTime<Utc>>,
    /// Resolved at: the event turned out done after all (see `resolution`).
    pub resolved_at: Option<DateTime<Utc>>,
    /// `delivered` (delivery evidence came later) or `applied` (the consumer's dedupe row shows it applied).
    pub resolution: Option<String>,
}

impl DeadLetter {
    /// `unhandled`, `redriven`, `resolved` or `applied`, as [`DeadLetterSummary::state`].
    pub fn state(&self) -> &'static str {
        state_of(
            self.redriven_at,
            self.resolved_at,
            self.resolution.as_deref(),
        )
    }
}

/// One dead letter by id (a [`DeadLetterId`], or the bare number: never an event's [`crate::OutboxId`]).
pub async fn get(
    conn: &mut PgConnection,
    id: impl Into<DeadLetterId>,
) -> Result<Option<DeadLetter>, sqlx::Error> {
    let id = id.into();
    sqlx::query_as::<_, DeadLetter>(
        crate::schema::q("SELECT id, source, natural_id, outbox_id, topic, partition_key, subscriber, seq, payload, body, headers, error, status, \
                response_body, attempts, qstash_message_id, dlq_id, raw_callback, parse_error, created_at, \
                redriven_at, resolved_at, resolution \
         FROM {schema}.dead_letters WHERE id = $1"),
    )
    .bind(id)
    .fetch_optional(&mut *conn)
    .await
}

/// The current state of a dead letter's outbox event (for `show`).
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct EventState {
    /// Outbox id.
    pub id: OutboxId,
    /// Per-key sequence now (NULL after an out-of-order redrive).
    pub seq: Option<i64>,
    /// Publish attempts of the current round.
    pub attempts: i32,
    pub redrive_count: i32,
    /// Accepted by QStash at.
    pub dispatched_at: Option<DateTime<Utc>>,
    /// Delivery evidence at.
    pub delivered_at: Option<DateTime<Utc>>,
    pub dead_lettered_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    /// The key's `done_seq` (ordered topics with an active key row).
    pub key_done_seq: Option<i64>,
    /// The event that blocks the key, if any.
    pub key_blocked_by: Option<OutboxId>,
}

impl EventState {
    /// `pending`, `dispatched`, `delivered` or `dead`.
    pub fn state(&self) -> &'static str {
        outbox_state(self.delivered_at, self.dead_lettered_at, self.dispatched_at)
    }
}

/// An outbox row's state from its timestamps: `delivered`, `dead`, `dispatched` (accepted by QStash, no outcome
/// yet) or `pending`.
pub(crate) fn outbox_state(
    delivered_at: Option<DateTime<Utc>>,
    dead_lettered_at: Option<DateTime<Utc>>,
    dispatched_at: Option<DateTime<Utc>>,
) -> &'static str {
    if delivered_at.is_some() {
        "delivered"
    } else if dead_lettered_at.is_some() {
        "dead"
    } else if dispatched_at.is_some() {
        "dispatched"
    } else {
        "pending"
    }
}

/// The outbox row of an event and its key's state; `None` when the row is gone (pruned).
pub async fn event_state(
    conn: &mut PgConnection,
    outbox_id: OutboxId,
) -> Result<Option<EventState>, sqlx::Error> {
    sqlx::query_as::<_, EventState>(
        crate::schema::q("SELECT o.id, o.seq, o.attempts, o.redrive_count, o.dispatched_at, o.delivered_at, o.dead_lettered_at, \
                o.last_error, k.done_seq AS key_done_seq, k.blocked_id AS key_blocked_by \
         FROM {schema}.outbox o LEFT JOIN {schema}.outbox_keys k ON o.seq IS NOT NULL AND k.topic = o.topic \
                                              AND k.partition_key = o.partition_key \
                                              AND k.subscriber = o.subscriber \
         WHERE o.id = $1"),
    )
    .bind(outbox_id)
    .fetch_optional(&mut *conn)
    .await
}

/// Counts the unhandled dead letters a filter matches (what a bulk redrive would try).
pub async fn count_unhandled(conn: &mut PgConnection, filter: &Filter) -> Result<i64, sqlx::Error> {
    let schema = crate::schema::current().quoted();
    let sql = format!(
        "SELECT count(*) FROM {schema}.dead_letters d WHERE {FILTER_SQL} AND {UNHANDLED_SQL}"
    );
    let row = bind_filter(sqlx::query(sqlx::AssertSqlSafe(sql)), filter)
        .fetch_one(&mut *conn)
        .await?;
    row.try_get(0)
}

/// The event headers (`traceparent`, correlation id, schema version, user headers) of a dead letter, for
/// re-inserting a pruned event: a relay dead letter stores the event's own headers; a QStash one the original HTTP
/// headers (`{name: [values]}`, forwarded ones possibly prefixed `Upstash-Forward-`), to which the failure
/// callback adds the signed envelope's headers and schema version. User headers are recovered from a relay dead
/// letter only: in a QStash one they are mixed with the message's HTTP headers.
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
            // The original message's headers do not say which names were the producer's own.
            user: Default::default(),
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
    out.user = std::mem::take(&mut out.user)
        .into_iter()
        .filter_map(|(name, value)| {
            let name = crate::headers::normalize_name(&name).ok()?;
            crate::headers::check_value(&value).ok()?;
            Some((name, value))
        })
        .collect();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relay_dead_letter_gives_back_the_user_headers_that_pass_the_rules() {
        let stored = serde_json::json!({
            "correlation_id": "req-9",
            "user": {"tenant": "acme", "x-outbox-id": "7", "bad": "a\nb"},
        });
        let h = event_headers_of("relay", Some(&stored));
        assert_eq!(h.correlation_id.as_deref(), Some("req-9"));
        assert_eq!(
            h.user.into_iter().collect::<Vec<_>>(),
            [("tenant".to_owned(), "acme".to_owned())],
            "a reserved name or a control character is dropped, not re-inserted"
        );
        // A QStash dead letter mixes them with the message's HTTP headers: none are recovered.
        let qstash = serde_json::json!({"Content-Type": ["application/json"], "tenant": ["acme"]});
        assert!(event_headers_of("qstash", Some(&qstash)).user.is_empty());
    }
}
