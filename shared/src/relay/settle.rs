//! Settling a claim, one statement per piece of whole messages (decision record 0018) — dispatched rows, retries with per-row jittered
//! backoff, dead letters into `dead_letters`, and the ordered keys' state — every write fenced on the row's lease
//! token. A relay whose lease was taken over (it was too slow, another relay re-claimed) changes nothing: its
//! rows no longer carry its token, so the statement matches zero rows for them. Without the fence, such a
//! "zombie" relay would overwrite the newer attempt's outcome (mark dispatched what failed, or the reverse).
//!
//! A dispatched or dead row is no longer waiting to be published again: the reconciler's deadline for that
//! (`republish_by`, [`crate::accounting`]) is cleared with it.
//!
//! An ordered key's message may carry several events (decision record 0014): every row of it is settled with the
//! message's outcome, the key's state follows its head (the row with `seq = done_seq + 1`), and a dispatched run
//! leaves the key awaiting evidence with `inflight_id` = the run's LAST event (the one whose evidence ends it).

use std::time::Duration;

use sqlx::{PgConnection, Row};

use crate::db::Statements;
use crate::ids::OutboxId;

/// What to record for one claimed event.
#[derive(Debug, Clone, PartialEq)]
pub enum Settlement {
    /// QStash accepted it.
    Dispatched {
        /// QStash's message id.
        message_id: String,
    },
    /// Try again after `delay`.
    Retry {
        /// Backoff.
        delay: Duration,
        error: String,
    },
    /// Give up: a dead letter.
    Dead {
        error: String,
        /// HTTP status from QStash, if any.
        status: Option<u16>,
        /// Skip the head of an ordered key instead of blocking it.
        skip_key: bool,
    },
    /// Give the claim back as if it had never been made: QStash was unavailable as a whole (an outage, decision
    /// record 0012), which says nothing about the event, so the attempt counted at claim is returned, the row is
    /// due again and its ordered key is freed. `last_error` is left alone: the outage row holds the error.
    Release,
}

/// One row to settle.
#[derive(Debug, Clone)]
pub struct SettleItem {
    /// Outbox id.
    pub id: OutboxId,
    /// The lease token the relay claimed it with.
    pub lease_token: i64,
    pub settlement: Settlement,
}

/// Counts of rows actually changed (fenced-out rows are not counted).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SettleCounts {
    pub dispatched: u64,
    /// Scheduled for retry.
    pub retried: u64,
    pub dead: u64,
    /// Given back without spending an attempt (QStash outage).
    pub released: u64,
}

impl SettleCounts {
    /// Rows settled in total.
    pub fn total(&self) -> u64 {
        self.dispatched + self.retried + self.dead + self.released
    }

    /// Adds another settle's counts (a cycle settled in pieces).
    pub fn add(&mut self, other: SettleCounts) {
        self.dispatched += other.dispatched;
        self.retried += other.retried;
        self.dead += other.dead;
        self.released += other.released;
    }
}

const SETTLE_SQL: &str = r#"
WITH s AS (
    SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::int[], $4::float8[], $5::text[], $6::text[], $7::int[], $8::bool[])
        AS s(id, token, outcome, delay_secs, error, message_id, status, skip_key)
),
upd AS (
    UPDATE {schema}.outbox o SET
        attempts          = CASE WHEN s.outcome = 3 THEN greatest(o.attempts - 1, 0) ELSE o.attempts END,
        dispatched_at     = CASE WHEN s.outcome = 0 THEN coalesce(o.dispatched_at, now()) ELSE o.dispatched_at END,
        qstash_message_id = coalesce(s.message_id, o.qstash_message_id),
        available_at      = CASE WHEN s.outcome = 1 THEN now() + make_interval(secs => s.delay_secs)
                                 WHEN s.outcome = 3 THEN least(o.available_at, now())
                                 ELSE o.available_at END,
        dead_lettered_at  = CASE WHEN s.outcome = 2 THEN now() ELSE o.dead_lettered_at END,
        last_error        = CASE WHEN s.outcome IN (0, 3) THEN o.last_error ELSE left(s.error, 2000) END,
        republish_by      = CASE WHEN s.outcome IN (0, 2) THEN NULL ELSE o.republish_by END,
        locked_until      = NULL
    FROM s
    WHERE o.id = s.id AND o.lease_token = s.token
      AND (s.outcome = 0 OR o.delivered_at IS NULL)
    RETURNING o.id, o.topic, o.partition_key, o.subscriber, o.seq, o.payload, o.headers, o.attempts,
              o.qstash_message_id, s.token, s.outcome, s.delay_secs, s.error, s.status, s.skip_key
),
dead AS (
    INSERT INTO {schema}.dead_letters (source, natural_id, outbox_id, topic, partition_key, subscriber, seq, payload,
                              headers, error, status, response_body, attempts, qstash_message_id)
    SELECT 'relay', u.id || '/' || u.token, u.id, u.topic, u.partition_key, u.subscriber, u.seq, u.payload,
           u.headers, u.error, u.status, CASE WHEN u.status IS NOT NULL THEN u.error END, u.attempts,
           u.qstash_message_id
    FROM upd u WHERE u.outcome = 2
    ON CONFLICT (source, natural_id) DO NOTHING
),
last AS (
    SELECT DISTINCT ON (u.token, u.topic, u.partition_key, u.subscriber)
           u.token, u.topic, u.partition_key, u.subscriber, u.id
    FROM upd u WHERE u.seq IS NOT NULL AND u.outcome = 0
    ORDER BY u.token, u.topic, u.partition_key, u.subscriber, u.seq DESC
),
keys AS (
    UPDATE {schema}.outbox_keys k SET
        inflight_id    = CASE WHEN u.outcome = 0 THEN coalesce(l.id, u.id) WHEN u.outcome = 3 THEN k.inflight_id END,
        inflight_since = CASE WHEN u.outcome = 0 THEN now() WHEN u.outcome = 3 THEN k.inflight_since END,
        available_at   = CASE WHEN u.outcome = 0 THEN now() + make_interval(secs => $9)
                              WHEN u.outcome = 1 THEN now() + make_interval(secs => u.delay_secs)
                              ELSE now() END,
        done_seq       = CASE WHEN u.outcome = 2 AND u.skip_key THEN u.seq ELSE k.done_seq END,
        blocked_at     = CASE WHEN u.outcome = 2 AND NOT u.skip_key THEN now() ELSE k.blocked_at END,
        blocked_id     = CASE WHEN u.outcome = 2 AND NOT u.skip_key THEN u.id ELSE k.blocked_id END,
        blocked_reason = CASE WHEN u.outcome = 2 AND NOT u.skip_key THEN left(u.error, 1000) ELSE k.blocked_reason END,
        lease_token    = NULL,
        locked_until   = NULL
    FROM upd u LEFT JOIN last l ON l.token = u.token AND l.topic = u.topic AND l.partition_key = u.partition_key
                               AND l.subscriber = u.subscriber
    WHERE u.seq IS NOT NULL AND k.topic = u.topic AND k.partition_key = u.partition_key
      AND k.subscriber = u.subscriber AND k.lease_token = u.token AND k.done_seq = u.seq - 1
)
SELECT count(*) FILTER (WHERE outcome = 0) AS dispatched,
       count(*) FILTER (WHERE outcome = 1) AS retried,
       count(*) FILTER (WHERE outcome = 2) AS dead,
       count(*) FILTER (WHERE outcome = 3) AS released
FROM upd
"#;

/// The settle statement's parameter arrays (`$1`–`$8`), one element per item. `outcome`: 0 dispatched, 1 retry,
/// 2 dead, 3 release.
struct Columns<'a> {
    ids: Vec<OutboxId>,
    tokens: Vec<i64>,
    outcomes: Vec<i32>,
    delays: Vec<f64>,
    errors: Vec<Option<&'a str>>,
    message_ids: Vec<Option<&'a str>>,
    statuses: Vec<Option<i32>>,
    skips: Vec<bool>,
}

impl<'a> Columns<'a> {
    fn of(items: &'a [SettleItem]) -> Self {
        let n = items.len();
        let mut c = Columns {
            ids: Vec::with_capacity(n),
            tokens: Vec::with_capacity(n),
            outcomes: Vec::with_capacity(n),
            delays: Vec::with_capacity(n),
            errors: Vec::with_capacity(n),
            message_ids: Vec::with_capacity(n),
            statuses: Vec::with_capacity(n),
            skips: Vec::with_capacity(n),
        };
        for it in items {
            let (outcome, delay, error, message_id, status, skip) = match &it.settlement {
                Settlement::Dispatched { message_id } => {
                    (0, 0.0, None, Some(message_id.as_str()), None, false)
                }
                Settlement::Retry { delay, error } => (
                    1,
                    delay.as_secs_f64(),
                    Some(error.as_str()),
                    None,
                    None,
                    false,
                ),
                Settlement::Dead {
                    error,
                    status,
                    skip_key,
                } => (
                    2,
                    0.0,
                    Some(error.as_str()),
                    None,
                    status.map(i32::from),
                    *skip_key,
                ),
                Settlement::Release => (3, 0.0, None, None, None, false),
            };
            c.ids.push(it.id);
            c.tokens.push(it.lease_token);
            c.outcomes.push(outcome);
            c.delays.push(delay);
            c.errors.push(error);
            c.message_ids.push(message_id);
            c.statuses.push(status);
            c.skips.push(skip);
        }
        c
    }
}

/// Settles `items` in one statement (a cycle calls it once per piece of whole messages: `pipeline.rs`).
/// `evidence_timeout`: how long an accepted ordered head may wait
/// for its delivery callback before it is published again.
pub async fn settle(
    conn: &mut PgConnection,
    items: &[SettleItem],
    evidence_timeout: Duration,
    statements: Statements,
) -> Result<SettleCounts, sqlx::Error> {
    if items.is_empty() {
        return Ok(SettleCounts::default());
    }
    let cols = Columns::of(items);
    let q = statements
        .query(crate::schema::q(SETTLE_SQL))
        .bind(&cols.ids)
        .bind(&cols.tokens)
        .bind(&cols.outcomes)
        .bind(&cols.delays)
        .bind(&cols.errors)
        .bind(&cols.message_ids)
        .bind(&cols.statuses)
        .bind(&cols.skips)
        .bind(evidence_timeout.as_secs_f64());
    let row = statements.run(conn, async |c| q.fetch_one(c).await).await?;
    let get = |c: &str| -> Result<u64, sqlx::Error> { Ok(row.try_get::<i64, _>(c)?.max(0) as u64) };
    Ok(SettleCounts {
        dispatched: get("dispatched")?,
        retried: get("retried")?,
        dead: get("dead")?,
        released: get("released")?,
    })
}
