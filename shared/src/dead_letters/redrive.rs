//! Redrive: a dead letter goes back through the outbox with the same outbox id (the consumer's dedupe key) and a
//! fresh QStash deduplication id; ordered heads unblock their key, middle events only with
//! [`RedriveOptions::out_of_order`] (decision record 0060). [`redrive`] does one dead letter, [`redrive_matching`]
//! every unhandled one a filter matches.

use crate::ids::DeadLetterId;
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgConnection;

use super::event_headers_of;
use crate::contract;
use crate::ids::{OutboxId, PartitionKey, TopicName};

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
    pub dead_letter_id: DeadLetterId,
    /// The event (same id: the consumer's dedupe key).
    pub outbox_id: OutboxId,
    pub topic: TopicName,
    pub partition_key: PartitionKey,
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
    pub also_marked: Vec<DeadLetterId>,
}

/// Why a dead letter was not redriven.
#[derive(Debug, thiserror::Error)]
pub enum RedriveError {
    /// No such dead letter.
    #[error("dead letter #{0} does not exist (list them with `outbox dead-letters list`)")]
    NotFound(DeadLetterId),
    /// Redriven before.
    #[error(
        "dead letter #{id} was already redriven at {at}; if the event failed again, it has a newer dead letter \
         (`outbox dead-letters list --topic …`) — redrive that one"
    )]
    AlreadyRedriven {
        /// Dead letter.
        id: DeadLetterId,
        at: DateTime<Utc>,
    },
    /// The event was delivered after all.
    #[error(
        "dead letter #{id}: event #{outbox_id} was delivered after all (at {at}); nothing to redrive — purge the dead \
         letter if you no longer need it"
    )]
    Delivered {
        /// Dead letter.
        id: DeadLetterId,
        outbox_id: OutboxId,
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
        id: DeadLetterId,
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
        id: DeadLetterId,
        outbox_id: OutboxId,
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
        id: DeadLetterId,
        outbox_id: OutboxId,
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
        id: DeadLetterId,
        outbox_id: OutboxId,
        topic: TopicName,
        key: PartitionKey,
        seq: i64,
        /// Why it is a middle event.
        why: String,
    },
    /// A bulk redrive needs at least one filter.
    #[error(
        "a bulk redrive needs at least one filter (--topic, --subscriber, --source, --key, --since, --until), so \
         that it cannot touch every dead letter by accident"
    )]
    FilterRequired,
    #[error("database error: {0} (is Postgres reachable? the operation is safe to retry)")]
    Database(#[from] sqlx::Error),
}

impl RedriveError {
    /// True for an ordered event refused because `out_of_order` was not set.
    pub fn is_out_of_order(&self) -> bool {
        matches!(self, RedriveError::OutOfOrder { .. })
    }
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
///   is by definition behind its key, so it needs `out_of_order`), its first claim unknown (`-infinity`): the
///   reconciler never publishes it again on its own (an existing row keeps its first claim, [`crate::accounting`]);
/// * the dead letter (and any other unhandled dead letter of the same event) gets `redriven_at`.
pub async fn redrive(
    conn: &mut PgConnection,
    dead_letter_id: impl Into<DeadLetterId>,
    opts: RedriveOptions,
) -> Result<Redriven, RedriveError> {
    let dead_letter_id = dead_letter_id.into();
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

/// Redrives one dead letter inside `tx`; the steps below, in this order.
async fn redrive_in(
    tx: &mut PgConnection,
    dead_letter_id: DeadLetterId,
    opts: RedriveOptions,
) -> Result<Redriven, RedriveError> {
    let (dead_letter, outbox_id) = lock_dead_letter(tx, dead_letter_id).await?;
    let requeued = match lock_outbox_row(tx, outbox_id).await? {
        Some(row) => reset_outbox_row(tx, &dead_letter, outbox_id, row, opts).await?,
        None => reinsert_pruned_event(tx, &dead_letter, outbox_id, opts).await?,
    };
    let also_marked = mark_redriven(tx, dead_letter.id, outbox_id).await?;
    let Requeued {
        topic,
        partition_key,
        order,
        reinserted,
        redrive_count,
    } = requeued;
    tracing::info!(dead_letter_id = dead_letter_id.get(), outbox_id = outbox_id.get(), topic = %topic, key = %partition_key, order = ?order, reinserted,
        redrive_count, "dead letter redriven");
    Ok(Redriven {
        dead_letter_id,
        outbox_id,
        topic,
        partition_key,
        order,
        reinserted,
        redrive_count,
        dedup_id: contract::dedup_id(outbox_id, redrive_count),
        also_marked,
    })
}

/// The dead letter being redriven, as far as a redrive reads it.
#[derive(sqlx::FromRow)]
struct DeadLetterRow {
    id: DeadLetterId,
    source: String,
    outbox_id: Option<OutboxId>,
    topic: Option<TopicName>,
    partition_key: Option<PartitionKey>,
    subscriber: String,
    seq: Option<i64>,
    payload: Option<Value>,
    headers: Option<Value>,
    error: String,
    parse_error: Option<String>,
    raw_callback: Option<Vec<u8>>,
    redriven_at: Option<DateTime<Utc>>,
    resolved_at: Option<DateTime<Utc>>,
}

/// The outbox row of the event being redriven.
#[derive(sqlx::FromRow)]
struct OutboxRow {
    topic: TopicName,
    partition_key: PartitionKey,
    subscriber: String,
    seq: Option<i64>,
    dispatched_at: Option<DateTime<Utc>>,
    delivered_at: Option<DateTime<Utc>>,
    dead_lettered_at: Option<DateTime<Utc>>,
    last_error: Option<String>,
}

/// Where the event is now: back in the outbox, pending.
struct Requeued {
    topic: TopicName,
    partition_key: PartitionKey,
    order: RedriveOrder,
    reinserted: bool,
    redrive_count: i32,
}

/// Step 1: locks the dead letter and refuses one that cannot be redriven (unknown, redriven before, linked to no
/// event, or resolved: delivered after all). Returns it with its event's outbox id.
async fn lock_dead_letter(
    tx: &mut PgConnection,
    dead_letter_id: DeadLetterId,
) -> Result<(DeadLetterRow, OutboxId), RedriveError> {
    let dead_letter: DeadLetterRow = sqlx::query_as(
        crate::schema::q("SELECT id, source, outbox_id, topic, partition_key, subscriber, seq, payload, headers, error, parse_error, raw_callback, \
                redriven_at, resolved_at \
         FROM {schema}.dead_letters WHERE id = $1 FOR UPDATE"),
    )
    .bind(dead_letter_id)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or(RedriveError::NotFound(dead_letter_id))?;
    if let Some(at) = dead_letter.redriven_at {
        return Err(RedriveError::AlreadyRedriven {
            id: dead_letter.id,
            at,
        });
    }
    let Some(outbox_id) = dead_letter.outbox_id else {
        return Err(RedriveError::NoOutboxId {
            id: dead_letter.id,
            parse_error: dead_letter.parse_error.is_some() || dead_letter.raw_callback.is_some(),
        });
    };
    if let Some(at) = dead_letter.resolved_at {
        return Err(RedriveError::Delivered {
            id: dead_letter.id,
            outbox_id,
            at,
        });
    }
    Ok((dead_letter, outbox_id))
}

/// Step 2: locks the event's outbox row; `None` when it was pruned.
async fn lock_outbox_row(
    tx: &mut PgConnection,
    outbox_id: OutboxId,
) -> Result<Option<OutboxRow>, sqlx::Error> {
    sqlx::query_as(
        crate::schema::q("SELECT topic, partition_key, subscriber, seq, dispatched_at, delivered_at, dead_lettered_at, last_error \
         FROM {schema}.outbox WHERE id = $1 FOR UPDATE"),
    )
    .bind(outbox_id)
    .fetch_optional(&mut *tx)
    .await
}

/// Step 3a, the outbox row is there: refuses an event that is not dead (delivered after all, or live again), finds
/// its place in its key, resets the row to pending with the redrive count up (an out-of-order event loses its
/// sequence), and unblocks the key when the event was its blocked head.
async fn reset_outbox_row(
    tx: &mut PgConnection,
    dead_letter: &DeadLetterRow,
    outbox_id: OutboxId,
    row: OutboxRow,
    opts: RedriveOptions,
) -> Result<Requeued, RedriveError> {
    if let Some(at) = row.delivered_at {
        return Err(RedriveError::Delivered {
            id: dead_letter.id,
            outbox_id,
            at,
        });
    }
    if row.dead_lettered_at.is_none() {
        return Err(RedriveError::NotDead {
            id: dead_letter.id,
            outbox_id,
            state: if row.dispatched_at.is_some() {
                "dispatched"
            } else {
                "pending"
            },
        });
    }
    let order = match row.seq {
        None => RedriveOrder::Unordered,
        Some(seq) => ordered_position(tx, dead_letter.id, outbox_id, &row, seq, opts).await?,
    };
    let drop_seq = matches!(order, RedriveOrder::OutOfOrder { .. });
    let redrive_count: i32 = sqlx::query_scalar(
        crate::schema::q("UPDATE {schema}.outbox SET dispatched_at = NULL, delivered_at = NULL, dead_lettered_at = NULL, attempts = 0, \
                available_at = now(), locked_until = NULL, lease_token = NULL, qstash_message_id = NULL, \
                last_error = $2, redrive_count = redrive_count + 1, \
                seq = CASE WHEN $3 THEN NULL ELSE seq END \
         WHERE id = $1 RETURNING redrive_count"),
    )
    .bind(outbox_id)
    .bind(redrive_note(dead_letter.id, row.last_error.as_deref().unwrap_or(&dead_letter.error)))
    .bind(drop_seq)
    .fetch_one(&mut *tx)
    .await?;
    if let RedriveOrder::InOrder {
        key_unblocked: true,
        ..
    } = order
    {
        unblock_key(tx, &row.topic, &row.partition_key, &row.subscriber).await?;
    }
    Ok(Requeued {
        topic: row.topic,
        partition_key: row.partition_key,
        order,
        reinserted: false,
        redrive_count,
    })
}

/// Step 3b, the outbox row was pruned: re-inserts the event from the dead letter with the same id, as an unordered
/// event (a pruned ordered event is behind its key by definition, so it needs `out_of_order`). Its redrive count
/// continues from the event's earlier redrives.
async fn reinsert_pruned_event(
    tx: &mut PgConnection,
    dead_letter: &DeadLetterRow,
    outbox_id: OutboxId,
    opts: RedriveOptions,
) -> Result<Requeued, RedriveError> {
    let missing = |what| RedriveError::CannotRebuild {
        id: dead_letter.id,
        outbox_id,
        missing: what,
    };
    let payload = dead_letter
        .payload
        .as_ref()
        .ok_or_else(|| missing("JSON payload"))?;
    let topic = dead_letter
        .topic
        .clone()
        .filter(|t| crate::producer::validate_topic(t).is_ok())
        .ok_or_else(|| missing("topic"))?;
    let key = dead_letter
        .partition_key
        .clone()
        .filter(|k| !k.is_empty())
        .ok_or_else(|| missing("partition key"))?;
    let order = match dead_letter.seq {
        None => RedriveOrder::Unordered,
        Some(seq) if opts.out_of_order => RedriveOrder::OutOfOrder { former_seq: seq },
        Some(seq) => {
            return Err(RedriveError::OutOfOrder {
                id: dead_letter.id,
                outbox_id,
                topic,
                key,
                seq,
                why: "its outbox row was pruned, so its key has moved on; it can only be re-inserted as an \
                      unordered event"
                    .into(),
            });
        }
    };
    let earlier: i64 = sqlx::query_scalar(
        crate::schema::q("SELECT count(*) FROM {schema}.dead_letters WHERE outbox_id = $1 AND redriven_at IS NOT NULL"),
    )
    .bind(outbox_id)
    .fetch_one(&mut *tx)
    .await?;
    let redrive_count = i32::try_from(earlier + 1).unwrap_or(i32::MAX);
    let headers = serde_json::to_value(event_headers_of(
        &dead_letter.source,
        dead_letter.headers.as_ref(),
    ))
    .unwrap_or_else(|_| Value::Object(Default::default()));
    sqlx::query(
        crate::schema::q("INSERT INTO {schema}.outbox (id, topic, partition_key, seq, payload, headers, redrive_count, last_error, subscriber, \
                                    first_claimed_at) \
         OVERRIDING SYSTEM VALUE VALUES ($1, $2, $3, NULL, $4, $5, $6, $7, $8, '-infinity')"),
    )
    .bind(outbox_id)
    .bind(&topic)
    .bind(&key)
    .bind(payload)
    .bind(&headers)
    .bind(redrive_count)
    .bind(redrive_note(dead_letter.id, &dead_letter.error))
    .bind(&dead_letter.subscriber)
    .execute(&mut *tx)
    .await?;
    Ok(Requeued {
        topic,
        partition_key: key,
        order,
        reinserted: true,
        redrive_count,
    })
}

/// The event's `last_error` after a redrive: where it came from, and (shortened) why it had died.
fn redrive_note(dead_letter_id: DeadLetterId, was: &str) -> String {
    let was: String = was.chars().take(1800).collect();
    format!("redriven from dead letter #{dead_letter_id} (was: {was})")
}

/// Where an ordered event stands in its key: in order (head, or behind earlier unfinished events) or a middle
/// event (the key is past it, gone, or blocked by another event at its place), in the lane of its subscriber.
/// Locks the key row.
async fn ordered_position(
    tx: &mut PgConnection,
    dead_letter_id: DeadLetterId,
    outbox_id: OutboxId,
    row: &OutboxRow,
    seq: i64,
    opts: RedriveOptions,
) -> Result<RedriveOrder, RedriveError> {
    let (topic, key) = (&row.topic, &row.partition_key);
    let k: Option<(i64, Option<OutboxId>)> = sqlx::query_as(crate::schema::q(
        "SELECT done_seq, blocked_id FROM {schema}.outbox_keys \
                          WHERE topic = $1 AND partition_key = $2 AND subscriber = $3 FOR UPDATE",
    ))
    .bind(topic)
    .bind(key)
    .bind(&row.subscriber)
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
            id: dead_letter_id,
            outbox_id,
            topic: topic.clone(),
            key: key.clone(),
            seq,
            why,
        })
    }
}

/// The key's head is redriven: it goes first again, everything behind it follows in order.
async fn unblock_key(
    tx: &mut PgConnection,
    topic: &TopicName,
    key: &PartitionKey,
    subscriber: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        crate::schema::q("UPDATE {schema}.outbox_keys SET blocked_at = NULL, blocked_id = NULL, blocked_reason = NULL, \
                inflight_id = NULL, inflight_since = NULL, lease_token = NULL, locked_until = NULL, \
                available_at = now() \
         WHERE topic = $1 AND partition_key = $2 AND subscriber = $3"),
    )
    .bind(topic)
    .bind(key)
    .bind(subscriber)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Step 4: marks the dead letter redriven, and every other unhandled dead letter of the same event with it (one
/// event can die more than once before anyone looks); returns those others' ids.
async fn mark_redriven(
    tx: &mut PgConnection,
    dead_letter_id: DeadLetterId,
    outbox_id: OutboxId,
) -> Result<Vec<DeadLetterId>, sqlx::Error> {
    let marked: Vec<DeadLetterId> = sqlx::query_scalar(
        crate::schema::q("UPDATE {schema}.dead_letters SET redriven_at = now() \
         WHERE id = $1 OR (outbox_id = $2 AND redriven_at IS NULL AND resolved_at IS NULL) RETURNING id"),
    )
    .bind(dead_letter_id)
    .bind(outbox_id)
    .fetch_all(&mut *tx)
    .await?;
    let mut also_marked: Vec<DeadLetterId> = marked
        .into_iter()
        .filter(|i| *i != dead_letter_id)
        .collect();
    also_marked.sort_unstable();
    Ok(also_marked)
}
