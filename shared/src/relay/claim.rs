//! Claiming: one short, committed statement per kind of topic. Never holds a row lock across the network: the
//! claim commits before anything is published, and its lease (`available_at = locked_until = now() + lease`)
//! keeps other relays away until it expires. Attempts are counted here, at claim time, so an event that kills
//! the relay still uses up its budget (counted only on failure, an event that crashes the relay would be retried
//! forever, since no failure is ever recorded for it). The first claim of an event is kept too
//! (`first_claimed_at`): the earliest time any consumer can have applied it, which bounds when the reconciler may
//! publish it again (`crate::accounting`).

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};

use std::sync::Arc;

use crate::db::Statements;
use crate::fairness::{Cursor, FAIR_CLAIM_SQL, KEYS_PER_CLAIM};
use crate::ids::{KeyLease, OutboxId, PartitionKey, TopicName};
use crate::ordering::{CLAIM_HEADS_SQL, CLAIM_RUNS_SQL};
use crate::producer::EventHeaders;

/// The unordered claim. `$1` = lease seconds; `{limit}` is spliced in once (see [`CLAIM_HEADS_SQL`] on why). Rows
/// are found again by `id`, never by `ctid`: the outbox is partitioned, and a row address repeats from one
/// partition to the next (decision record 0067).
pub const CLAIM_UNORDERED_SQL: &str = concat!(
    r#"
WITH tok AS (SELECT nextval('{schema}.outbox_lease_token_seq') AS t)
UPDATE {schema}.outbox o
SET attempts = o.attempts + 1,
    first_claimed_at = coalesce(o.first_claimed_at, now()),
    lease_token = (SELECT t FROM tok),
    locked_until = now() + make_interval(secs => $1),
    available_at = now() + make_interval(secs => $1)
WHERE o.id = ANY (ARRAY(
    SELECT id FROM {schema}.outbox
    WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL AND seq IS NULL AND available_at <= now()
    ORDER BY available_at, id
    LIMIT {limit}
    FOR UPDATE SKIP LOCKED))
"#,
    crate::ordering::claimed_columns!(),
    "\n"
);

/// An event a relay holds under lease.
#[derive(Debug, Clone)]
pub struct ClaimedEvent {
    /// Outbox id.
    pub id: OutboxId,
    pub topic: TopicName,
    pub partition_key: PartitionKey,
    /// The subscriber this copy of the event is for (`''`: the default one, `CONSUMER_URL`; see
    /// [`crate::subscribers`]).
    pub subscriber: String,
    /// Per-key sequence (ordered topics).
    pub seq: Option<i64>,
    /// JSON payload text.
    pub payload: String,
    /// Trace context and friends.
    pub headers: EventHeaders,
    /// Attempts including this one.
    pub attempts: i32,
    /// When the producer wrote it.
    pub created_at: DateTime<Utc>,
    /// Redrives plus reconciler republishes so far: part of the QStash deduplication id, so a publish the
    /// operator or the reconciler asked for is never swallowed by QStash's deduplication window.
    pub dedup_generation: i32,
    /// The previous attempt's error.
    pub last_error: Option<String>,
    /// The fencing token of this lease.
    pub lease_token: i64,
    /// The event this row is a copy of (its first copy's id; [`ClaimedEvent::id`] itself for the first copy): a
    /// replayed copy is recognised by it ([`crate::subscribers::Destinations::replayed`]).
    pub event_id: OutboxId,
    /// Who the event belongs to for fairness (`''`: no key; [`crate::fairness`]).
    pub fairness_key: String,
}

impl ClaimedEvent {
    /// The lease an ordered event was claimed under: its topic, its key, its subscriber and the claim's fencing token, shared by
    /// the key's run in this claim. `None` for an unordered event (its lease is the row's alone).
    pub fn key_lease(&self) -> Option<KeyLease> {
        self.seq.map(|_| KeyLease {
            topic: self.topic.clone(),
            key: self.partition_key.clone(),
            subscriber: self.subscriber.clone(),
            token: self.lease_token,
        })
    }

    fn from_row(r: &PgRow) -> Result<Self, sqlx::Error> {
        // Headers were validated by the producer; anything unreadable is dropped rather than blocking the event.
        let headers: sqlx::types::Json<EventHeaders> = r
            .try_get("headers")
            .unwrap_or(sqlx::types::Json(EventHeaders::default()));
        Ok(ClaimedEvent {
            id: r.try_get("id")?,
            topic: r.try_get("topic")?,
            partition_key: r.try_get("partition_key")?,
            subscriber: r.try_get("subscriber")?,
            seq: r.try_get("seq")?,
            payload: r.try_get("payload")?,
            headers: headers.0,
            attempts: r.try_get("attempts")?,
            created_at: r.try_get("created_at")?,
            dedup_generation: r.try_get("dedup_generation")?,
            last_error: r.try_get("last_error")?,
            lease_token: r.try_get("lease_token")?,
            event_id: r.try_get("event_id")?,
            fairness_key: r.try_get("fairness_key")?,
        })
    }
}

#[cfg(test)]
impl ClaimedEvent {
    /// A claimed event for unit tests: attempt 1 of a never-redriven event with an empty JSON object as payload, no
    /// headers and no previous error.
    pub(crate) fn for_test(
        id: i64,
        topic: &str,
        key: &str,
        seq: Option<i64>,
        lease_token: i64,
    ) -> Self {
        ClaimedEvent {
            id: OutboxId(id),
            topic: topic.into(),
            partition_key: key.into(),
            subscriber: String::new(),
            seq,
            payload: "{}".into(),
            headers: EventHeaders::default(),
            attempts: 1,
            created_at: DateTime::UNIX_EPOCH,
            dedup_generation: 0,
            last_error: None,
            lease_token,
            event_id: OutboxId(id),
            fairness_key: String::new(),
        }
    }
}

/// The two claim statements with the batch size spliced in, and the ordered claim's events per key.
#[derive(Debug, Clone)]
pub struct ClaimStatements {
    batch_size: u32,
    unordered: String,
    ordered: String,
    statements: Statements,
    /// Topics with their own events-per-message (`$2`, `$3` of [`CLAIM_RUNS_SQL`]).
    batch_topics: Vec<String>,
    batch_ns: Vec<i32>,
    /// Everyone else's (`$4`).
    batch_default: i32,
    /// The ordered statement is [`CLAIM_RUNS_SQL`] (it takes `$2`–`$4`).
    runs: bool,
    /// The fair unordered claim ([`crate::fairness::FAIR_CLAIM_SQL`]) and where its next walk starts; `None`: the
    /// unfair one, oldest first ([`CLAIM_UNORDERED_SQL`], `RELAY_FAIR_CLAIMS=false`).
    fair: Option<(String, Arc<Cursor>)>,
}

impl ClaimStatements {
    /// Builds the statements for a batch size; ordered keys are claimed one event at a time (the head) until
    /// [`ClaimStatements::with_delivery_batching`] says otherwise.
    pub fn new(batch_size: u32, statements: Statements) -> Self {
        let limit = batch_size.to_string();
        ClaimStatements {
            batch_size,
            unordered: crate::schema::sql(CLAIM_UNORDERED_SQL).replace("{limit}", &limit),
            ordered: crate::schema::sql(CLAIM_HEADS_SQL).replace("{limit}", &limit),
            statements,
            batch_topics: Vec::new(),
            batch_ns: Vec::new(),
            batch_default: 1,
            runs: false,
            fair: None,
        }
    }

    /// Shares each unordered claim among the fairness keys with waiting events ([`crate::fairness`]).
    pub fn with_fair_claims(mut self, fair: bool) -> Self {
        self.fair = fair.then(|| {
            let cursor = Cursor::new(KEYS_PER_CLAIM.min(self.batch_size));
            let sql = crate::schema::sql(FAIR_CLAIM_SQL)
                .replace("{limit}", &self.batch_size.to_string())
                .replace("{keys}", &cursor.keys().to_string());
            (sql, Arc::new(cursor))
        });
        self
    }

    /// Claims up to each topic's events-per-message of an ordered key at once (its head and the consecutive
    /// pending events behind it, decision record 0014) with [`CLAIM_RUNS_SQL`]; without batching (every `n` is
    /// 1) the heads-only [`CLAIM_HEADS_SQL`] stays.
    pub fn with_delivery_batching(mut self, batching: &crate::config::DeliveryBatching) -> Self {
        if !batching.any_batching() {
            return self;
        }
        self.runs = true;
        self.ordered =
            crate::schema::sql(CLAIM_RUNS_SQL).replace("{limit}", &self.batch_size.to_string());
        self.batch_default = batching.default_n.clamp(1, i32::MAX as u32) as i32;
        self.batch_topics = batching.topics.iter().map(|(t, _)| t.clone()).collect();
        self.batch_ns = batching
            .topics
            .iter()
            .map(|(_, n)| (*n).clamp(1, i32::MAX as u32) as i32)
            .collect();
        self
    }

    /// Rows per claim of each kind.
    pub fn batch_size(&self) -> u32 {
        self.batch_size
    }

    /// The unordered claim's SQL.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // `internals::RelaySteps`
    pub fn unordered_sql(&self) -> &str {
        match &self.fair {
            Some((sql, _)) => sql,
            None => &self.unordered,
        }
    }

    /// The ordered claim's SQL.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // `internals::RelaySteps`
    pub fn ordered_sql(&self) -> &str {
        &self.ordered
    }

    /// Claims due unordered events.
    pub async fn claim_unordered(
        &self,
        conn: &mut PgConnection,
        lease_secs: f64,
    ) -> Result<Vec<ClaimedEvent>, sqlx::Error> {
        let Some((sql, cursor)) = &self.fair else {
            return self.run(conn, &self.unordered, lease_secs, false).await;
        };
        let start = cursor.start();
        let q = self
            .statements
            .query(sqlx::AssertSqlSafe(sql.clone()))
            .bind(lease_secs)
            .bind(start);
        let rows = self
            .statements
            .run(conn, async |c| q.fetch_all(c).await)
            .await?;
        let walked: (i64, Option<String>) = match rows.first() {
            Some(r) => (r.try_get("walked")?, r.try_get("walked_last")?),
            None => (0, None),
        };
        cursor.advance(walked.0, walked.1.as_deref());
        rows.iter().map(ClaimedEvent::from_row).collect()
    }

    /// Claims the heads of due, unblocked ordered keys, each with up to its topic's events-per-message minus
    /// one consecutive pending events behind it, all under the key's one lease token. Rows of a key come back in
    /// sequence order.
    pub async fn claim_ordered(
        &self,
        conn: &mut PgConnection,
        lease_secs: f64,
    ) -> Result<Vec<ClaimedEvent>, sqlx::Error> {
        let mut events = self.run(conn, &self.ordered, lease_secs, true).await?;
        events.sort_by(|a, b| {
            (&a.topic, &a.partition_key, a.seq).cmp(&(&b.topic, &b.partition_key, b.seq))
        });
        Ok(events)
    }

    async fn run(
        &self,
        conn: &mut PgConnection,
        sql: &str,
        lease_secs: f64,
        ordered: bool,
    ) -> Result<Vec<ClaimedEvent>, sqlx::Error> {
        let mut q = self
            .statements
            .query(sqlx::AssertSqlSafe(sql.to_owned()))
            .bind(lease_secs);
        if ordered && self.runs {
            q = q
                .bind(&self.batch_topics)
                .bind(&self.batch_ns)
                .bind(self.batch_default);
        }
        let rows = self
            .statements
            .run(conn, async |c| q.fetch_all(c).await)
            .await?;
        rows.iter().map(ClaimedEvent::from_row).collect()
    }
}
