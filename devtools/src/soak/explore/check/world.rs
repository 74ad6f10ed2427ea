//! What the run left behind ([`World`]), as the checker reads it: each subscriber's applications, the outbox's
//! copies, the dead letters and the ordered lanes from the database, and the dev server's DLQ and lost messages.

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

/// One application by a subscriber's consumer (`soak_applied`).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Applied {
    pub ord: i64,
    pub outbox_id: i64,
    pub topic: String,
    pub partition_key: Option<String>,
    pub seq: Option<i64>,
    pub n: i64,
    pub subscriber: String,
    pub applied_at: DateTime<Utc>,
}

/// One outbox row (a copy of an event for one subscriber).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct CopyRow {
    pub id: i64,
    pub topic: String,
    pub partition_key: String,
    pub subscriber: String,
    pub n: Option<i64>,
    pub created_at: DateTime<Utc>,
    pub dispatched_at: Option<DateTime<Utc>>,
    pub delivered_at: Option<DateTime<Utc>>,
    pub dead_lettered_at: Option<DateTime<Utc>>,
}

/// One dead letter.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct DeadRow {
    pub id: i64,
    pub source: String,
    pub outbox_id: Option<i64>,
    pub topic: Option<String>,
    pub subscriber: String,
    pub n: Option<i64>,
    pub error: String,
    pub qstash_message_id: Option<String>,
    pub created_at: DateTime<Utc>,
    pub redriven_at: Option<DateTime<Utc>>,
    pub resolved_at: Option<DateTime<Utc>>,
}

impl DeadRow {
    pub(super) fn open(&self) -> bool {
        self.redriven_at.is_none() && self.resolved_at.is_none()
    }
}

/// One ordered lane.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Lane {
    pub topic: String,
    pub partition_key: String,
    pub subscriber: String,
    pub blocked: bool,
    pub waiting: bool,
    /// The rest, as one line for reports.
    pub state: String,
}

/// What the run left behind.
#[derive(Debug, Default)]
pub struct World {
    pub applied: Vec<Applied>,
    pub copies: Vec<CopyRow>,
    pub dead: Vec<DeadRow>,
    pub lanes: Vec<Lane>,
    /// Copies in messages QStash gave up on after faults (not refused by the consumer), by the dev server's DLQ.
    pub given_up: BTreeSet<i64>,
    /// Messages the dev server lost on purpose.
    pub lost_messages: BTreeSet<String>,
    /// The pipeline drained before the bound.
    pub drained: bool,
}

impl World {
    /// Reads the database's part.
    pub async fn read(db: &PgPool) -> Result<World, sqlx::Error> {
        let applied = sqlx::query_as(
            "SELECT ord, outbox_id, topic, partition_key, seq, n, subscriber, applied_at FROM soak_applied ORDER BY ord",
        )
        .fetch_all(db)
        .await?;
        let copies = sqlx::query_as(
            "SELECT id, topic, partition_key, subscriber, (payload->>'n')::bigint AS n, created_at, dispatched_at, \
                    delivered_at, dead_lettered_at FROM outbox ORDER BY id",
        )
        .fetch_all(db)
        .await?;
        let dead = sqlx::query_as(
            "SELECT id, source, outbox_id, topic, subscriber, (payload->>'n')::bigint AS n, error, qstash_message_id, \
                    created_at, redriven_at, resolved_at FROM dead_letters ORDER BY id",
        )
        .fetch_all(db)
        .await?;
        let lanes = sqlx::query_as(
            "SELECT topic, partition_key, subscriber, blocked_at IS NOT NULL AS blocked, \
                    available_at = 'infinity' AS waiting, \
                    format('done_seq %s, available_at %s, locked_until %s, inflight_id %s, blocked_id %s', \
                           done_seq, available_at, locked_until, inflight_id, blocked_id) AS state \
             FROM outbox_keys",
        )
        .fetch_all(db)
        .await?;
        Ok(World {
            applied,
            copies,
            dead,
            lanes,
            ..World::default()
        })
    }

    /// Adds the dev server's part: the copies of the messages in its DLQ that it gave up on (not those the
    /// consumer refused with a 4xx), and the messages it lost.
    pub fn with_dev_server(mut self, dlq: &[qstash_dev::DlqEntryInfo], lost: Vec<String>) -> World {
        self.given_up = outbox_testkit::given_up::given_up(dlq)
            .iter()
            .filter(|m| !m.refused_by_the_consumer())
            .flat_map(|m| m.events.iter().copied())
            .collect();
        self.lost_messages = lost.into_iter().collect();
        self
    }
}
