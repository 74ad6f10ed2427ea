//! Recording: what QStash gave up on becomes a dead letter ([`record_qstash_failure`], called by the failure
//! callback; for a batched message [`record_qstash_batch_failure`], one dead letter per failed event). The relay's own dead letters are not written here: its settle statement writes them in the same
//! statement that marks the event dead ([`crate::relay::settle`]), so an event can never be dead without one.

use crate::ids::DeadLetterId;
use serde_json::Value;
use sha2::{Digest, Sha256};
use sqlx::{PgConnection, Row};

use crate::config::DeadHeadPolicy;
use crate::db::Statements;
use crate::ids::{OutboxId, PartitionKey, TopicName};
use crate::ordering;

/// What QStash told us about a message it gave up on (parsed from the failure-callback body), or as much of
/// it as could be parsed.
#[derive(Debug, Clone, Default)]
pub struct QstashFailure {
    /// QStash's DLQ id (`dlqId`): the natural id of the dead letter.
    pub dlq_id: Option<String>,
    /// Our outbox id, from the forwarded `x-outbox-id` header. Kept on the dead letter even when the outbox row
    /// is gone (pruned after dispatch while QStash was still retrying).
    pub outbox_id: Option<OutboxId>,
    /// The topic, from the original message's headers (`x-outbox-topic`) or its URL; used when the outbox row
    /// is gone.
    pub topic: Option<TopicName>,
    /// The partition key (decoded `x-outbox-key` of the original message); used when the outbox row is gone.
    pub partition_key: Option<PartitionKey>,
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
    /// The event is one of a batch (decision record 0027): its natural id is `<dlqId>/<outbox id>`, one dead
    /// letter per event of the message.
    pub batch_member: bool,
    /// What the consumer said about this event (its per-event verdict), added to the error.
    pub event_error: Option<String>,
    /// The named subscriber the message was for (its signed envelope's `subscriber`; `None`: the default one);
    /// used when the outbox row is gone (a removal deleted the copy while QStash still held it).
    pub subscriber: Option<String>,
    /// The event the copy is of (its envelope's `event`), for the dedupe-row lookup when the row is gone.
    pub event_id: Option<OutboxId>,
}

impl QstashFailure {
    /// The natural id: the `dlqId`, else a hash of the raw callback (so a retried callback is still idempotent).
    pub fn natural_id(&self) -> String {
        if let Some(id) = self.dlq_id.as_deref().filter(|s| !s.is_empty()) {
            return match (self.batch_member, self.outbox_id) {
                (true, Some(event)) => format!("{id}/{event}"),
                _ => id.to_owned(),
            };
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
        let text = self.message_error_text();
        match &self.event_error {
            Some(e) => format!("{text}; the consumer said about this event: {e}"),
            None => text,
        }
    }

    fn message_error_text(&self) -> String {
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
        dead_letter_id: DeadLetterId,
        /// The outbox event it belongs to, if known.
        outbox_id: Option<OutboxId>,
    },
    /// The event already had an unresolved dead letter (another QStash message of the same event gave up: a
    /// batch formed again after a relay died, a republish): this failure was merged into it — its natural id
    /// remembered, its attempts added, its reason appended — so the event keeps one dead letter, redriven once.
    Merged {
        dead_letter_id: DeadLetterId,
        outbox_id: OutboxId,
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
/// - `applied`: the dedupe row of `consumer` (the `CONSUMER_NAME` namespace in `processed_messages`; for a named
///   subscriber's copy, the subscriber's name, see [`crate::subscribers`]) shows the event applied. QStash gives up on a message whose every response was lost after the consumer committed
///   (timeouts, a dropped connection); the event is done all the same, and is recorded as delivered here, which
///   also moves an ordered key on. This needs the consumer's dedupe table in the outbox's database, as this
///   project deploys it; with a consumer elsewhere the dead letter stays unresolved and a redrive of it is
///   answered "duplicate" by that consumer.
pub async fn record_qstash_failure(
    conn: &mut PgConnection,
    failure: &QstashFailure,
    policy_for_topic: impl Fn(&str) -> DeadHeadPolicy,
    consumer: &str,
    statements: Statements,
) -> Result<FailureRecorded, sqlx::Error> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    // The callback function's pool commits asynchronously (delivery evidence may be lost safely); a dead letter
    // may not: QStash will not call again once it got a 2xx.
    statements
        .query("SET LOCAL synchronous_commit = on")
        .execute(&mut *tx)
        .await?;
    let natural_id = failure.natural_id();
    if let Some(outbox_id) = failure.outbox_id {
        lock_event_row(&mut tx, outbox_id, statements).await?;
        let merge = merge_into_open(
            &mut tx,
            outbox_id,
            &natural_id,
            failure,
            consumer,
            statements,
        )
        .await?;
        if let Some(recorded) = merge.recorded(outbox_id) {
            tx.commit().await?;
            return Ok(recorded);
        }
    }
    let Some(inserted) =
        insert_dead_letter(&mut tx, &natural_id, failure, consumer, statements).await?
    else {
        tx.commit().await?;
        return Ok(FailureRecorded::Duplicate);
    };
    match (inserted.outbox_id, inserted.resolution.as_deref()) {
        // Applied: done, as if its delivery evidence had come (marks it delivered, moves an ordered key on).
        (Some(id), Some("applied")) => {
            ordering::record_delivery(&mut tx, id, statements).await?;
        }
        (Some(id), None) => {
            let error = failure.error_text();
            mark_dead(&mut tx, id, &error, statements).await?;
            if let (Some(topic), Some(_)) = (inserted.topic, inserted.seq) {
                let policy = policy_for_topic(&topic);
                ordering::apply_dead_head(&mut tx, id, policy, &error, statements).await?;
            }
        }
        _ => {}
    }
    tx.commit().await?;
    Ok(FailureRecorded::Recorded {
        dead_letter_id: inserted.id,
        outbox_id: inserted.outbox_id,
    })
}

/// Locks the event's row as the dead-lettering update will. A removal deleting this copy concurrently has then
/// either committed (the statements that follow see no row: a withdrawn copy) or waits for this transaction (and
/// then keeps the copy, dead-lettered). Without it, the insert could see the row the removal was deleting and
/// leave an open dead letter for a copy that no longer exists.
async fn lock_event_row(
    tx: &mut PgConnection,
    outbox_id: OutboxId,
    statements: Statements,
) -> Result<(), sqlx::Error> {
    statements
        .query(crate::schema::q(
            "SELECT 1 FROM {schema}.outbox WHERE id = $1 FOR NO KEY UPDATE",
        ))
        .bind(outbox_id)
        .fetch_optional(&mut *tx)
        .await?;
    Ok(())
}

/// The dead letter of a QStash failure, from the outbox row when it is still there (else from what the callback
/// said), stored already resolved when the event turns out delivered, applied (a dedupe row of `$16`, or of the
/// copy's subscriber) or withdrawn; nothing when the natural id was recorded before.
const INSERT_SQL: &str = r#"
        INSERT INTO {schema}.dead_letters (source, natural_id, outbox_id, topic, partition_key, subscriber, seq,
                                  payload, body, headers,
                                  error, status, response_body, attempts, qstash_message_id, dlq_id,
                                  raw_callback, parse_error, resolved_at, resolution)
        SELECT 'qstash', $1, coalesce(o.id, $13), coalesce(o.topic, $14), coalesce(o.partition_key, $15),
               coalesce(o.subscriber, $17, ''), o.seq,
               coalesce(o.payload, $2::jsonb), CASE WHEN o.id IS NULL AND $2::jsonb IS NULL THEN $3::bytea END,
               $4::jsonb, $5, $6, $7, $8, $9, $10, $11, $12,
               CASE WHEN o.delivered_at IS NOT NULL OR applied.yes OR withdrawn.yes THEN now() END,
               CASE WHEN o.delivered_at IS NOT NULL THEN 'delivered' WHEN applied.yes THEN 'applied'
                    WHEN withdrawn.yes THEN 'withdrawn' END
        FROM (SELECT 1) one
        LEFT JOIN {schema}.outbox o ON o.id = $13
        CROSS JOIN LATERAL (
            SELECT $13::bigint IS NOT NULL AND EXISTS (
                SELECT 1 FROM {schema}.processed_messages pm
                WHERE pm.consumer = CASE WHEN coalesce(o.subscriber, $17, '') = '' THEN $16
                                         ELSE coalesce(o.subscriber, $17) END
                  AND pm.message_id IN (coalesce(o.event_id, $18::bigint, $13::bigint)::text, $13::bigint::text)
            ) AS yes
        ) applied
        -- A named subscriber's copy whose row is gone: its removal deleted it while QStash still held the message
        -- (a named subscriber's copies leave the outbox only by its removal, or by retention once done, which
        -- `applied` sees first). Not owed any more: recorded, resolved.
        CROSS JOIN LATERAL (
            SELECT $13::bigint IS NOT NULL AND o.id IS NULL AND coalesce($17, '') <> '' AS yes
        ) withdrawn
        ON CONFLICT (source, natural_id) DO NOTHING
        RETURNING id, outbox_id, topic, seq, resolution
        "#;

/// What [`insert_dead_letter`] wrote.
struct Inserted {
    /// The new dead letter's id.
    id: DeadLetterId,
    /// The event it belongs to, if known.
    outbox_id: Option<OutboxId>,
    topic: Option<String>,
    /// The event's sequence (an ordered head).
    seq: Option<i64>,
    /// Why it was stored resolved (`delivered`, `applied`, `withdrawn`); `None`: open.
    resolution: Option<String>,
}

/// Inserts the dead letter of `failure` under `natural_id` ([`INSERT_SQL`]); `None` when it was recorded before.
async fn insert_dead_letter(
    tx: &mut PgConnection,
    natural_id: &str,
    failure: &QstashFailure,
    consumer: &str,
    statements: Statements,
) -> Result<Option<Inserted>, sqlx::Error> {
    let body_json: Option<Value> = failure
        .source_body
        .as_deref()
        .and_then(|b| serde_json::from_slice(b).ok());
    let row = statements
        .query(crate::schema::q(INSERT_SQL))
        .bind(natural_id)
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
        .bind(failure.subscriber.as_deref())
        .bind(failure.event_id)
        .fetch_optional(&mut *tx)
        .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    Ok(Some(Inserted {
        id: row.try_get("id")?,
        outbox_id: row.try_get("outbox_id")?,
        topic: row.try_get("topic")?,
        seq: row.try_get("seq")?,
        resolution: row.try_get("resolution")?,
    }))
}

/// Marks the outbox event dead with `error` (unless it was delivered meanwhile) and ends its lease.
async fn mark_dead(
    tx: &mut PgConnection,
    id: OutboxId,
    error: &str,
    statements: Statements,
) -> Result<(), sqlx::Error> {
    statements.query(
        crate::schema::q("UPDATE {schema}.outbox SET dead_lettered_at = now(), last_error = left($2, 2000), locked_until = NULL \
         WHERE id = $1 AND delivered_at IS NULL"),
    )
    .bind(id)
    .bind(error)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// What [`merge_into_open`] found.
enum Merge {
    /// This failure (its natural id) was merged into an open dead letter before: a retried callback.
    Seen,
    /// Merged now into this open dead letter.
    Into(DeadLetterId),
    /// No open dead letter to merge into (or the event is done after all): record a dead letter of its own.
    None,
}

impl Merge {
    /// What recording ends with when the failure was merged (or seen merged before); `None`: record it.
    fn recorded(self, outbox_id: OutboxId) -> Option<FailureRecorded> {
        match self {
            Merge::Seen => Some(FailureRecorded::Duplicate),
            Merge::Into(dead_letter_id) => Some(FailureRecorded::Merged {
                dead_letter_id,
                outbox_id,
            }),
            Merge::None => None,
        }
    }
}

/// One unresolved dead letter per event (decision record 0015): a failure of an event that already has one
/// (unhandled: neither resolved nor redriven) is merged into it, unless the event turned out done (delivered, or
/// the dedupe row of `consumer` shows it applied: then the new dead letter is recorded resolved, as always). The
/// event's dead letters are serialised by a transaction-level advisory lock on its id, so two callbacks for two
/// messages of one event cannot both find none.
const MERGE_SQL: &str = r#"
WITH seen AS (
    SELECT 1 FROM {schema}.dead_letters WHERE outbox_id = $1 AND $2 = ANY (merged_ids)
), open AS (
    SELECT d.id FROM {schema}.dead_letters d
    WHERE d.outbox_id = $1 AND d.resolved_at IS NULL AND d.redriven_at IS NULL AND d.natural_id <> $2
      AND NOT EXISTS (SELECT 1 FROM seen)
      AND NOT EXISTS (SELECT 1 FROM {schema}.outbox o WHERE o.id = $1 AND o.delivered_at IS NOT NULL)
      AND NOT EXISTS (SELECT 1 FROM {schema}.processed_messages pm
                      WHERE pm.consumer = coalesce((SELECT nullif(o.subscriber, '') FROM {schema}.outbox o
                                                    WHERE o.id = $1), $3)
                        AND pm.message_id IN (coalesce((SELECT o.event_id FROM {schema}.outbox o WHERE o.id = $1),
                                                       $1::bigint)::text,
                                              $1::bigint::text))
    ORDER BY d.id
    LIMIT 1
), merged AS (
    UPDATE {schema}.dead_letters d
    SET merged_ids = array_append(d.merged_ids, $2),
        merged_count = d.merged_count + 1,
        attempts = CASE WHEN d.attempts IS NULL AND $4::int IS NULL THEN NULL
                        ELSE coalesce(d.attempts, 0) + coalesce($4::int, 0) END,
        error = left(d.error || ' | then: ' || $5, 8000),
        status = coalesce($6, d.status),
        response_body = coalesce($7, d.response_body)
    FROM open WHERE d.id = open.id
    RETURNING d.id
)
SELECT EXISTS (SELECT 1 FROM seen) AS seen, (SELECT id FROM merged) AS merged_id
"#;

async fn merge_into_open(
    tx: &mut PgConnection,
    outbox_id: OutboxId,
    natural_id: &str,
    failure: &QstashFailure,
    consumer: &str,
    statements: Statements,
) -> Result<Merge, sqlx::Error> {
    statements
        .query("SELECT pg_advisory_xact_lock(28514, ($1 % 2147483647)::int4)")
        .bind(outbox_id)
        .execute(&mut *tx)
        .await?;
    let row = statements
        .query(crate::schema::q(MERGE_SQL))
        .bind(outbox_id)
        .bind(natural_id)
        .bind(consumer)
        .bind(failure.attempts)
        .bind(failure.error_text())
        .bind(failure.status)
        .bind(failure.response_body.as_deref())
        .fetch_one(&mut *tx)
        .await?;
    let seen: bool = row.try_get("seen")?;
    let merged: Option<DeadLetterId> = row.try_get("merged_id")?;
    Ok(match (seen, merged) {
        (true, _) => Merge::Seen,
        (false, Some(id)) => Merge::Into(id),
        (false, None) => Merge::None,
    })
}

/// One event of a batched message QStash gave up on, and what to do with it (decided by the failure callback from
/// the consumer's per-event verdicts, decision record 0027).
#[derive(Debug, Clone)]
pub struct BatchMember {
    /// The event's own failure (natural id `<dlqId>/<outbox id>`, its payload, its error).
    pub failure: QstashFailure,
    /// Ordered (the event has a sequence).
    pub ordered: bool,
    /// The consumer named it `failed`, or (no readable verdict) it is the one the rules pick: a dead letter.
    pub dead: bool,
}

/// What [`record_qstash_batch_failure`] did, per outbox id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchFailureRecorded {
    /// Applied by the consumer (a dedupe row of `consumer`): recorded as delivered.
    pub delivered: Vec<OutboxId>,
    /// New dead letters `(dead letter id, outbox id)`.
    pub dead_letters: Vec<(DeadLetterId, OutboxId)>,
    /// Dead letters recorded before (QStash retried the callback).
    pub duplicates: Vec<OutboxId>,
    /// Failures merged into the event's open dead letter `(dead letter id, outbox id)`.
    pub merged: Vec<(DeadLetterId, OutboxId)>,
    /// Unordered events not applied and not dead: due again for the relay.
    pub requeued: Vec<OutboxId>,
    /// Ordered events not applied and not dead: left alone (they wait behind the dead head, or the relay
    /// republishes them when the key moves on).
    pub left: Vec<OutboxId>,
}

/// The outbox ids among `ids` whose dedupe rows show them applied: in the namespace `consumer`
/// (`CONSUMER_NAME`) for the default subscriber's copies, in the subscriber's name for a named subscriber's
/// ([`crate::subscribers`]); under the copy's event, or its own id for a row from before decision record 0070.
pub async fn applied_ids(
    conn: &mut PgConnection,
    consumer: &str,
    ids: &[OutboxId],
    statements: Statements,
) -> Result<Vec<OutboxId>, sqlx::Error> {
    let texts: Vec<String> = ids.iter().map(OutboxId::to_string).collect();
    let q = statements
        .query_scalar(crate::schema::q(
            "SELECT t.id FROM unnest($2::text[]) AS t(id) \
             LEFT JOIN {schema}.outbox o ON o.id = t.id::bigint \
             WHERE EXISTS (SELECT 1 FROM {schema}.processed_messages pm \
                           WHERE pm.message_id IN (coalesce(o.event_id::text, t.id), t.id) \
                             AND pm.consumer = coalesce(nullif(o.subscriber, ''), $1))",
        ))
        .bind(consumer)
        .bind(&texts);
    let applied: Vec<String> = statements.run(conn, async |c| q.fetch_all(c).await).await?;
    Ok(applied
        .iter()
        .filter_map(|s| s.parse::<i64>().ok().map(OutboxId))
        .collect())
}

/// Records QStash's failure of a **batched** message (several events), in one transaction (decision record
/// 0027), per event in envelope order:
///
/// 1. applied (a dedupe row of `consumer` exists) → recorded as delivered, all in one statement
///    ([`ordering::record_delivery_batch`]: an ordered key moves once, over the applied run);
/// 2. `dead` → its own dead letter ([`record_qstash_failure`] with natural id `<dlqId>/<outbox id>`; the topic's
///    dead-head policy as for one event);
/// 3. the others: ordered → left alone; unordered → due again for the relay (`dispatched_at`, lease and QStash
///    message id cleared, available now), unless it was published again since (another QStash message id).
pub async fn record_qstash_batch_failure(
    conn: &mut PgConnection,
    members: &[BatchMember],
    policy_for_topic: impl Fn(&str) -> DeadHeadPolicy,
    consumer: &str,
    statements: Statements,
) -> Result<BatchFailureRecorded, sqlx::Error> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    statements
        .query("SET LOCAL synchronous_commit = on")
        .execute(&mut *tx)
        .await?;
    let ids: Vec<OutboxId> = members.iter().filter_map(|m| m.failure.outbox_id).collect();
    let applied = applied_ids(&mut tx, consumer, &ids, statements).await?;
    let mut out = BatchFailureRecorded::default();
    for m in members {
        let Some(id) = m.failure.outbox_id else {
            continue;
        };
        if applied.contains(&id) {
            out.delivered.push(id);
        }
    }
    if !out.delivered.is_empty() {
        ordering::record_delivery_batch(&mut tx, &out.delivered, statements).await?;
    }
    let mut requeue = Vec::new();
    for m in members {
        let Some(id) = m.failure.outbox_id else {
            continue;
        };
        if out.delivered.contains(&id) {
            continue;
        }
        if m.dead {
            match record_qstash_failure(
                &mut tx,
                &m.failure,
                &policy_for_topic,
                consumer,
                statements,
            )
            .await?
            {
                FailureRecorded::Recorded { dead_letter_id, .. } => {
                    out.dead_letters.push((dead_letter_id, id))
                }
                FailureRecorded::Merged { dead_letter_id, .. } => {
                    out.merged.push((dead_letter_id, id))
                }
                FailureRecorded::Duplicate => out.duplicates.push(id),
            }
        } else if m.ordered {
            out.left.push(id);
        } else {
            requeue.push(id);
        }
    }
    if !requeue.is_empty() {
        let source_message_id = members
            .first()
            .and_then(|m| m.failure.source_message_id.as_deref());
        out.requeued = statements.query_scalar(crate::schema::q(
            "UPDATE {schema}.outbox SET dispatched_at = NULL, available_at = now(), lease_token = NULL, \
             locked_until = NULL, qstash_message_id = NULL \
             WHERE id = ANY ($1::bigint[]) AND seq IS NULL AND delivered_at IS NULL AND dead_lettered_at IS NULL \
               AND ($2::text IS NULL OR qstash_message_id IS NULL OR qstash_message_id = $2) \
             RETURNING id",
        ))
        .bind(&requeue)
        .bind(source_message_id)
        .fetch_all(&mut *tx)
        .await?;
        out.requeued.sort_unstable();
    }
    tx.commit().await?;
    Ok(out)
}
