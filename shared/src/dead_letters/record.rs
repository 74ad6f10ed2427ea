//! Recording: what QStash gave up on becomes a dead letter ([`record_qstash_failure`], called by the failure
//! callback). The relay's own dead letters are not written here: its settle statement writes them in the same
//! statement that marks the event dead ([`crate::relay::settle`]), so an event can never be dead without one.

use serde_json::Value;
use sha2::{Digest, Sha256};
use sqlx::{PgConnection, Row};

use crate::config::DeadHeadPolicy;
use crate::ordering;

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
            // QStash reports status 0 when no attempt got a response (network errors, timeouts).
            (Some(0), None) => format!(
                "QStash gave up after {} attempt(s); no response (network errors or timeouts)",
                self.attempts
                    .map(|a| a.to_string())
                    .unwrap_or_else(|| "?".into())
            ),
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
        dead_letter_id: i64,
        /// The outbox event it belongs to, if known.
        outbox_id: Option<i64>,
    },
    /// The same failure was already recorded (QStash retried the callback).
    Duplicate,
}

/// Records a QStash failure callback as a dead letter, idempotently, and marks the outbox event dead; for an
/// ordered head the topic's dead-head policy is applied. Runs in one transaction.
///
/// Two cases are not failures, and the dead letter is stored already resolved, so it is not counted as
/// unresolved, cannot be redriven, and does not block its key:
/// - `delivered`: delivery evidence for the event arrived first.
/// - `applied`: the dedupe row of `consumer` (the `CONSUMER_NAME` namespace in `processed_messages`) shows the
///   event applied. QStash gives up on a message whose every response was lost after the consumer committed
///   (timeouts, a dropped connection); the event is done all the same, and is recorded as delivered here, which
///   also moves an ordered key on. This needs the consumer's dedupe table in the outbox's database, as this
///   project deploys it; with a consumer elsewhere the dead letter stays unresolved and a redrive of it is
///   answered "duplicate" by that consumer.
pub async fn record_qstash_failure(
    conn: &mut PgConnection,
    failure: &QstashFailure,
    policy_for_topic: impl Fn(&str) -> DeadHeadPolicy,
    consumer: &str,
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
        crate::schema::q(r#"
        INSERT INTO {schema}.dead_letters (source, natural_id, outbox_id, topic, partition_key, seq, payload, body, headers,
                                  error, status, response_body, attempts, qstash_message_id, dlq_id,
                                  raw_callback, parse_error, resolved_at, resolution)
        SELECT 'qstash', $1, coalesce(o.id, $13), coalesce(o.topic, $14), coalesce(o.partition_key, $15), o.seq,
               coalesce(o.payload, $2::jsonb), CASE WHEN o.id IS NULL AND $2::jsonb IS NULL THEN $3::bytea END,
               $4::jsonb, $5, $6, $7, $8, $9, $10, $11, $12,
               CASE WHEN o.delivered_at IS NOT NULL OR applied.yes THEN now() END,
               CASE WHEN o.delivered_at IS NOT NULL THEN 'delivered' WHEN applied.yes THEN 'applied' END
        FROM (SELECT 1) one
        LEFT JOIN {schema}.outbox o ON o.id = $13
        CROSS JOIN LATERAL (
            SELECT $13::bigint IS NOT NULL AND EXISTS (
                SELECT 1 FROM {schema}.processed_messages pm
                WHERE pm.consumer = $16 AND pm.message_id = $13::bigint::text
            ) AS yes
        ) applied
        ON CONFLICT (source, natural_id) DO NOTHING
        RETURNING id, outbox_id, topic, seq, resolution
        "#),
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
    .bind(consumer)
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
    let resolution: Option<String> = row.try_get("resolution")?;
    match (outbox_id, resolution.as_deref()) {
        // Applied: done, as if its delivery evidence had come (marks it delivered, moves an ordered key on).
        (Some(id), Some("applied")) => {
            ordering::record_delivery(&mut tx, id, persistent).await?;
        }
        (Some(id), None) => {
            let error = failure.error_text();
            sqlx::query(
                crate::schema::q("UPDATE {schema}.outbox SET dead_lettered_at = now(), last_error = left($2, 2000), locked_until = NULL \
                 WHERE id = $1 AND delivered_at IS NULL"),
            )
            .persistent(persistent)
            .bind(id)
            .bind(&error)
            .execute(&mut *tx)
            .await?;
            if let (Some(topic), Some(_)) = (topic, seq) {
                ordering::apply_dead_head(
                    &mut tx,
                    id,
                    policy_for_topic(&topic),
                    &error,
                    persistent,
                )
                .await?;
            }
        }
        _ => {}
    }
    tx.commit().await?;
    Ok(FailureRecorded::Recorded {
        dead_letter_id,
        outbox_id,
    })
}
