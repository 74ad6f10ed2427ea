//! Guarantee 3 — **per-key order where promised.**
//!
//! For a topic declared [`crate::Topic::ordered`], a consumer applies the events of one partition key in commit
//! order, even with several relays, retries, backoff and QStash's own retries (decision record 0003). The
//! contract has three parts, and this module holds the SQL of each:
//!
//! 1. **Producer: sequence = commit order.** Each ordered event takes the next number of its key from
//!    `outbox_sequences` with `INSERT … ON CONFLICT DO UPDATE` (inside [`crate::producer`]'s one statement).
//!    That row lock is held until the producer's transaction ends, so a second producer on the same key waits:
//!    numbers are handed out in commit order with no gaps. (Identity order would not do: T1 takes id 10, T2
//!    takes id 11, T2 commits first.)
//! 2. **Relay: one message per key in flight, gated on delivery evidence.** The relay claims *keys*
//!    (`outbox_keys`, `FOR UPDATE SKIP LOCKED`, see [`CLAIM_HEADS_SQL`]): the head (`seq = done_seq + 1`) of a key
//!    that is due, not leased, not awaiting evidence and not blocked, and with `RELAY_DELIVERY_BATCH` > 1 the
//!    consecutive pending events behind it ([`CLAIM_RUNS_SQL`], decision record 0014), all in one message. It is
//!    published with a delivery callback; [`record_delivery_batch`] (called by the callback receiver on a 2xx, over
//!    the message's events, in one statement) advances `done_seq` over them and frees the key once. The key awaits
//!    the evidence of the message's last event (`inflight_id`). A dead head blocks the key or is skipped, per topic
//!    ([`crate::config::DeadHeadPolicy`]); events claimed behind it go back to pending.
//! 3. **Consumer: sequence check.** [`check_consumer_sequence`] runs inside the consumer's dedupe transaction and
//!    refuses an event older than one already applied.
//!
//! *Head*, *dead head* and *delivery evidence* are defined in the repository's `docs/glossary.md`.

use sqlx::{PgConnection, Row};

use crate::config::DeadHeadPolicy;
use crate::db::Statements;
use crate::ids::{OutboxId, PartitionKey, TopicName};

/// The `RETURNING` list of every claim, the columns `ClaimedEvent::from_row` reads (`crate::relay::claim`): the
/// ordered claims below, the unordered one and the fair one (`crate::fairness`) share it, so a column of a claimed
/// event is added to all of them at once.
macro_rules! claimed_columns {
    () => {
        "RETURNING o.id, o.topic, o.partition_key, o.subscriber, o.seq, o.payload::text AS payload, o.headers, \
         o.attempts, o.created_at, o.redrive_count + o.republish_count AS dedup_generation, o.last_error, \
         o.lease_token, coalesce(o.event_id, o.id) AS event_id, o.fairness_key"
    };
}
pub(crate) use claimed_columns;

/// The part both ordered claims share: take a fencing token, lock up to `{limit}` due, unblocked keys (`SKIP
/// LOCKED`) and lease each key that has a due head with it (see [`CLAIM_HEADS_SQL`]).
macro_rules! claim_keys_sql {
    () => {
        r#"
WITH tok AS (SELECT nextval('{schema}.outbox_lease_token_seq') AS t),
keys AS (
    UPDATE {schema}.outbox_keys k
    SET (available_at, lease_token, locked_until) = (
        SELECT CASE WHEN h.id IS NULL THEN now() + interval '1 second'
                    WHEN h.available_at > now() THEN h.available_at
                    ELSE now() + make_interval(secs => $1) END,
               CASE WHEN h.id IS NOT NULL AND h.available_at <= now() THEN (SELECT t FROM tok) ELSE k.lease_token END,
               CASE WHEN h.id IS NOT NULL AND h.available_at <= now()
                    THEN now() + make_interval(secs => $1) ELSE k.locked_until END
        FROM (SELECT 1) one
        LEFT JOIN {schema}.outbox h ON h.topic = k.topic AND h.partition_key = k.partition_key
                          AND h.subscriber = k.subscriber AND h.seq = k.done_seq + 1
                          AND h.dead_lettered_at IS NULL AND h.delivered_at IS NULL
                          -- A paused tenant's head is not claimed: the key waits, checked again each second.
                          AND NOT EXISTS (SELECT 1 FROM {schema}.outbox_paused_keys p
                                          WHERE p.fairness_key = h.fairness_key))
    WHERE k.ctid = ANY (ARRAY(
        SELECT ctid FROM {schema}.outbox_keys
        WHERE blocked_at IS NULL AND available_at <= now()
        ORDER BY available_at
        LIMIT {limit}
        FOR UPDATE SKIP LOCKED))
    RETURNING k.topic, k.partition_key, k.subscriber, k.done_seq, k.lease_token
)"#
    };
}

/// The relay's claim of ordered key heads, in one short statement: lock up to `{limit}` due, unblocked keys
/// (`SKIP LOCKED`: two relays never hold the same key), find each key's head (`seq = done_seq + 1`), lease key
/// and head with one fencing token, count the attempt. `$1` is the lease in seconds. The batch size is a
/// literal spliced in once at start: with a `LIMIT $n` parameter Postgres may switch to a generic plan that
/// ignores the limit (a `claim_outbox` SQL function written with a `LIMIT` parameter ran ~3.5× slower for that
/// reason).
///
/// The head row itself only gets its attempt, token, `locked_until` and (once) `first_claimed_at` (no indexed
/// column), so with the table's fill factor the update can stay on its page without touching any index (a HOT
/// update); the key row carries the lease that matters. A head that is delayed pushes its key to the head's time. Keys without a visible head (a producer is still
/// open, or the key went idle) are pushed back by a second so they cannot fill every claim; idle ones are
/// deleted by [`release_idle_key`] and housekeeping.
pub(crate) const CLAIM_HEADS_SQL: &str = concat!(
    claim_keys_sql!(),
    r#"
UPDATE {schema}.outbox o
SET attempts = o.attempts + 1,
    first_claimed_at = coalesce(o.first_claimed_at, now()),
    lease_token = k.lease_token,
    locked_until = now() + make_interval(secs => $1)
FROM keys k
WHERE k.lease_token = (SELECT t FROM tok)
  AND o.topic = k.topic AND o.partition_key = k.partition_key AND o.subscriber = k.subscriber
  AND o.seq = k.done_seq + 1
"#,
    claimed_columns!(),
    "\n"
);

/// [`CLAIM_HEADS_SQL`] for delivery batches (decision record 0014), used when some topic has
/// `RELAY_DELIVERY_BATCH` > 1: lock up to `{limit}` due, unblocked keys (`SKIP LOCKED`: two relays never hold the same key), find each key's head
/// (`seq = done_seq + 1`), lease the key, the head and up to `n - 1` following events (`done_seq + 2 …`, as long
/// as they are contiguous, not dead-lettered and not delivered) with one fencing token, and count each row's
/// attempt. `n` is the key's topic's most events per message: `$2`/`$3` are the topics with their own `n`
/// (parallel arrays), `$4` the `n` of every other topic; `$1` is the lease in seconds; `{limit}` as in
/// [`CLAIM_HEADS_SQL`]. The run is found with one range scan of `outbox_key_seq_idx` per key and updated by `id`
/// (not by `ctid`, which repeats across the outbox's partitions). With every `n = 1` it claims what [`CLAIM_HEADS_SQL`] claims, but the relay
/// then uses that one: it was not measurably slower, yet not measurably as fast either on a shared machine.
pub const CLAIM_RUNS_SQL: &str = concat!(
    claim_keys_sql!(),
    r#",
run AS (
    SELECT r.row_id
    FROM keys k
    CROSS JOIN LATERAL (
        SELECT o.id AS row_id, o.seq, row_number() OVER (ORDER BY o.seq) AS rn
        FROM {schema}.outbox o
        WHERE o.topic = k.topic AND o.partition_key = k.partition_key AND o.subscriber = k.subscriber
          AND o.seq > k.done_seq
          AND o.seq <= k.done_seq + coalesce(
                (SELECT b.n FROM unnest($2::text[], $3::int[]) AS b(topic, n) WHERE b.topic = k.topic LIMIT 1), $4::int)
          AND o.dead_lettered_at IS NULL AND o.delivered_at IS NULL) r
    WHERE k.lease_token = (SELECT t FROM tok)
      AND r.seq = k.done_seq + r.rn
)
UPDATE {schema}.outbox o
SET attempts = o.attempts + 1,
    first_claimed_at = coalesce(o.first_claimed_at, now()),
    lease_token = (SELECT t FROM tok),
    locked_until = now() + make_interval(secs => $1)
FROM run
WHERE o.id = run.row_id
"#,
    claimed_columns!(),
    "\n"
);

/// What [`record_delivery`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryRecorded {
    /// The event is now marked delivered; for an ordered head the key moved on.
    Recorded {
        /// The key advanced (ordered head); `false` for unordered events or repeated evidence.
        key_advanced: bool,
    },
    /// No outbox row with that id (pruned, or not ours).
    UnknownEvent,
}

/// Records delivery evidence (a QStash callback with a 2xx status) for an outbox event: marks it delivered and,
/// if it is its key's head, advances the key so the relay can publish the next event at once. Idempotent:
/// repeated evidence changes nothing. Evidence also clears a block the event itself caused (it was delivered
/// after all) and resolves its relay dead letter. The one-event case of [`record_delivery_batch`].
pub async fn record_delivery(
    conn: &mut PgConnection,
    outbox_id: OutboxId,
    statements: Statements,
) -> Result<DeliveryRecorded, sqlx::Error> {
    let batch = record_delivery_batch(conn, &[outbox_id], statements).await?;
    if batch.found.is_empty() {
        return Ok(DeliveryRecorded::UnknownEvent);
    }
    Ok(DeliveryRecorded::Recorded {
        key_advanced: batch.keys_advanced > 0,
    })
}

/// What [`record_delivery_batch`] did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BatchDeliveryRecorded {
    /// The ids that have an outbox row (now marked delivered), ascending.
    pub found: Vec<OutboxId>,
    /// The ids without one (pruned, or not ours), in the order given.
    pub unknown: Vec<OutboxId>,
    /// Keys whose `done_seq` moved (each once, to the end of the contiguous run of delivered events).
    pub keys_advanced: usize,
}

/// The batch evidence statement: mark every event delivered, resolve their dead letters, and move each ordered
/// key once over the contiguous run `done_seq + 1 …` of delivered events — the given ones and any of the key
/// delivered before (a sequence counts when every sequence between `done_seq` and it is delivered: `seq -
/// done_seq` = how many delivered ones lie in `(done_seq, seq]`).
const RECORD_DELIVERY_BATCH_SQL: &str = r#"
WITH ev AS (
    UPDATE {schema}.outbox
    SET delivered_at = coalesce(delivered_at, now()),
        dispatched_at = coalesce(dispatched_at, now()),
        dead_lettered_at = NULL,
        locked_until = NULL
    WHERE id = ANY ($1::bigint[])
    RETURNING id, topic, partition_key, subscriber, seq
),
resolved AS (
    UPDATE {schema}.dead_letters d SET resolved_at = coalesce(d.resolved_at, now()),
                           resolution = coalesce(d.resolution, 'delivered')
    FROM ev WHERE d.outbox_id = ev.id
),
-- The delivered sequences of each key the message touched: its events, and those of the key delivered earlier
-- past done_seq (evidence that came out of order: after a crash lost a relay's asynchronous settle, the next event
-- can be delivered and recorded before the one before it; moving only over this message's events would leave the
-- key waiting forever at a sequence that is already delivered).
delivered AS (
    SELECT topic, partition_key, subscriber, seq FROM ev WHERE seq IS NOT NULL
    UNION
    SELECT o.topic, o.partition_key, o.subscriber, o.seq
    FROM {schema}.outbox o
    JOIN {schema}.outbox_keys k
      ON k.topic = o.topic AND k.partition_key = o.partition_key AND k.subscriber = o.subscriber
    WHERE (o.topic, o.partition_key, o.subscriber)
          IN (SELECT DISTINCT topic, partition_key, subscriber FROM ev WHERE seq IS NOT NULL)
      AND o.seq > k.done_seq AND o.delivered_at IS NOT NULL
),
runs AS (
    SELECT k.topic, k.partition_key, k.subscriber, k.done_seq AS old_done,
           (SELECT max(e.seq) FROM delivered e
             WHERE e.topic = k.topic AND e.partition_key = k.partition_key AND e.subscriber = k.subscriber
               AND e.seq > k.done_seq
               AND e.seq - k.done_seq = (SELECT count(*) FROM delivered e2
                                         WHERE e2.topic = k.topic AND e2.partition_key = k.partition_key
                                           AND e2.subscriber = k.subscriber
                                           AND e2.seq > k.done_seq AND e2.seq <= e.seq)) AS new_done
    FROM {schema}.outbox_keys k
    WHERE (k.topic, k.partition_key, k.subscriber)
          IN (SELECT DISTINCT topic, partition_key, subscriber FROM ev WHERE seq IS NOT NULL)
),
advanced AS (
    UPDATE {schema}.outbox_keys k
    SET done_seq = r.new_done, available_at = now(), inflight_id = NULL, inflight_since = NULL,
        lease_token = NULL, locked_until = NULL,
        blocked_at = NULL, blocked_id = NULL, blocked_reason = NULL
    FROM runs r
    WHERE r.new_done IS NOT NULL AND k.topic = r.topic AND k.partition_key = r.partition_key
      AND k.subscriber = r.subscriber AND k.done_seq = r.old_done
      AND (k.blocked_at IS NULL OR k.blocked_id IN (SELECT id FROM ev))
    RETURNING k.topic, k.partition_key, k.subscriber, k.done_seq
)
SELECT (SELECT coalesce(array_agg(id ORDER BY id), '{}') FROM ev) AS found, a.topic, a.partition_key,
       a.subscriber, a.done_seq,
       EXISTS (SELECT 1 FROM {schema}.outbox n
               WHERE n.topic = a.topic AND n.partition_key = a.partition_key AND n.subscriber = a.subscriber
                 AND n.seq = a.done_seq + 1)
           AS has_next
FROM (SELECT 1) one LEFT JOIN advanced a ON true
"#;

/// Records delivery evidence for the events of one message (a batch, decision record 0027) in **one** statement:
/// every event marked delivered, their dead letters resolved, each ordered key's `done_seq` advanced over the
/// contiguous run of these events that follows it, and the key freed once. Recording them one at a time would
/// free the key after the first, and the relay would republish the next ones. Idempotent like
/// [`record_delivery`] (its one-event case).
pub async fn record_delivery_batch(
    conn: &mut PgConnection,
    outbox_ids: &[OutboxId],
    statements: Statements,
) -> Result<BatchDeliveryRecorded, sqlx::Error> {
    if outbox_ids.is_empty() {
        return Ok(BatchDeliveryRecorded::default());
    }
    let rows = statements
        .run(conn, async |c| {
            statements
                .query(crate::schema::q(RECORD_DELIVERY_BATCH_SQL))
                .bind(outbox_ids)
                .fetch_all(c)
                .await
        })
        .await?;
    let mut out = BatchDeliveryRecorded::default();
    let mut idle = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        if i == 0 {
            out.found = row.try_get("found")?;
        }
        let advanced: Option<TopicName> = row.try_get("topic")?;
        if let Some(topic) = advanced {
            out.keys_advanced += 1;
            // Only a key with no visible next event can be idle: then try to release it (a second statement that
            // a busy key never pays for).
            let has_next: Option<bool> = row.try_get("has_next")?;
            if has_next != Some(true) {
                let key: PartitionKey = row.try_get("partition_key")?;
                let subscriber: String = row.try_get("subscriber")?;
                let done: i64 = row.try_get("done_seq")?;
                idle.push((topic, key, subscriber, done));
            }
        }
    }
    for (topic, key, subscriber, done) in idle {
        release_idle_key(conn, &topic, &key, &subscriber, done, statements).await?;
    }
    out.unknown = outbox_ids
        .iter()
        .copied()
        .filter(|id| out.found.binary_search(id).is_err())
        .collect();
    Ok(out)
}

/// Deletes a key's relay state when it has no more events (`done_seq` = the producer's `last_seq`). Only done
/// while holding the key's `outbox_sequences` row lock (`SKIP LOCKED`: a producer that holds it is about to add
/// an event, so the key stays active); a producer that later re-creates the row knows every earlier event is
/// finished. Returns whether the row was deleted.
pub(crate) async fn release_idle_key(
    conn: &mut PgConnection,
    topic: &TopicName,
    key: &PartitionKey,
    subscriber: &str,
    done_seq: i64,
    statements: Statements,
) -> Result<bool, sqlx::Error> {
    let deleted = statements
        .execute(
            conn,
            statements
                .query(crate::schema::q(
                    r#"
        DELETE FROM {schema}.outbox_keys k
        WHERE k.topic = $1 AND k.partition_key = $2 AND k.done_seq = $3 AND k.subscriber = $4
          AND k.blocked_at IS NULL AND k.inflight_id IS NULL
          AND (k.locked_until IS NULL OR k.locked_until < now())
          AND EXISTS (
              SELECT 1 FROM {schema}.outbox_sequences s
              WHERE s.topic = k.topic AND s.partition_key = k.partition_key AND s.last_seq = k.done_seq
              FOR UPDATE SKIP LOCKED)
        "#,
                ))
                .bind(topic)
                .bind(key)
                .bind(done_seq)
                .bind(subscriber),
        )
        .await?;
    Ok(deleted > 0)
}

/// Applies the topic's dead-head policy after an ordered event died (relay budget, permanent publish error, or
/// QStash gave up): `Block` stops the key until an operator acts; `Skip` moves the key past the event. Only acts
/// if the event is its key's current head. Returns whether the key changed.
pub(crate) async fn apply_dead_head(
    conn: &mut PgConnection,
    outbox_id: OutboxId,
    policy: DeadHeadPolicy,
    reason: &str,
    statements: Statements,
) -> Result<bool, sqlx::Error> {
    let sql = match policy {
        DeadHeadPolicy::Block => {
            r#"
            UPDATE {schema}.outbox_keys k
            SET blocked_at = now(), blocked_id = o.id, blocked_reason = left($2, 1000),
                inflight_id = NULL, inflight_since = NULL, lease_token = NULL, locked_until = NULL
            FROM {schema}.outbox o
            WHERE o.id = $1 AND o.seq IS NOT NULL AND k.topic = o.topic AND k.partition_key = o.partition_key
              AND k.subscriber = o.subscriber AND k.done_seq = o.seq - 1
            "#
        }
        DeadHeadPolicy::Skip => {
            r#"
            UPDATE {schema}.outbox_keys k
            SET done_seq = o.seq, available_at = now(),
                inflight_id = NULL, inflight_since = NULL, lease_token = NULL, locked_until = NULL
            FROM {schema}.outbox o
            WHERE o.id = $1 AND o.seq IS NOT NULL AND k.topic = o.topic AND k.partition_key = o.partition_key
              AND k.subscriber = o.subscriber AND k.done_seq = o.seq - 1 AND $2::text IS NOT NULL
            "#
        }
    };
    let n = statements
        .execute(
            conn,
            statements
                .query(crate::schema::q(sql))
                .bind(outbox_id)
                .bind(reason),
        )
        .await?;
    Ok(n > 0)
}

/// The consumer's view of an event's place in its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SequenceCheck {
    /// Newer than anything applied for the key: apply it.
    InOrder,
    /// Older than (or equal to) an event already applied for the key: refuse.
    Late {
        /// The last sequence the consumer applied for the key.
        last_applied: i64,
    },
}

/// Records `seq` as the last applied sequence of `(consumer, topic, key)` if it is newer; must run in the same
/// transaction as the dedupe row and the side effects (so a rollback forgets it too).
pub(crate) async fn check_consumer_sequence(
    conn: &mut PgConnection,
    consumer: &str,
    topic: &TopicName,
    key: &PartitionKey,
    seq: i64,
    statements: Statements,
) -> Result<SequenceCheck, sqlx::Error> {
    let sql = crate::schema::q(
        r#"
        WITH up AS (
            INSERT INTO {schema}.consumer_sequences AS c (consumer, topic, partition_key, last_seq)
            VALUES ($1, $2, $3, $4)
            ON CONFLICT (consumer, topic, partition_key)
            DO UPDATE SET last_seq = excluded.last_seq, updated_at = now()
            WHERE c.last_seq < excluded.last_seq
            RETURNING last_seq
        )
        SELECT (SELECT count(*) FROM up) AS applied,
               (SELECT last_seq FROM {schema}.consumer_sequences
                 WHERE consumer = $1 AND topic = $2 AND partition_key = $3) AS last_seq
        "#,
    );
    let row = statements
        .run(conn, async |c| {
            statements
                .query(sql)
                .bind(consumer)
                .bind(topic)
                .bind(key)
                .bind(seq)
                .fetch_one(c)
                .await
        })
        .await?;
    let applied: i64 = row.try_get("applied")?;
    if applied > 0 {
        Ok(SequenceCheck::InOrder)
    } else {
        let last: Option<i64> = row.try_get("last_seq")?;
        Ok(SequenceCheck::Late {
            last_applied: last.unwrap_or(seq),
        })
    }
}

/// Moves a consumer's last applied sequence for a key to `seq` (never back), in the transaction that applied the
/// events up to `seq`. For the later events of a batch: the first event of the key went through
/// [`check_consumer_sequence`], which locked the key's row for the rest of the transaction, and the consumer
/// compared the following events' sequences with it; this records the last one applied.
pub(crate) async fn advance_consumer_sequence(
    conn: &mut PgConnection,
    consumer: &str,
    topic: &TopicName,
    key: &PartitionKey,
    seq: i64,
    statements: Statements,
) -> Result<(), sqlx::Error> {
    statements
        .query(crate::schema::q(
            "UPDATE {schema}.consumer_sequences SET last_seq = $4, updated_at = now() \
             WHERE consumer = $1 AND topic = $2 AND partition_key = $3 AND last_seq < $4",
        ))
        .bind(consumer)
        .bind(topic)
        .bind(key)
        .bind(seq)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Records a failed delivery attempt reported by a QStash callback (non-2xx status) on the event, so operators
/// see why a key is waiting. The key stays gated: QStash is still retrying.
pub async fn record_failed_attempt(
    conn: &mut PgConnection,
    outbox_id: OutboxId,
    description: &str,
    statements: Statements,
) -> Result<bool, sqlx::Error> {
    let n = statements
        .execute(
            conn,
            statements
                .query(crate::schema::q(
                    "UPDATE {schema}.outbox SET last_error = left($2, 2000) \
                     WHERE id = $1 AND delivered_at IS NULL AND dead_lettered_at IS NULL",
                ))
                .bind(outbox_id)
                .bind(description),
        )
        .await?;
    Ok(n > 0)
}
