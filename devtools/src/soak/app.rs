//! The soak's application: its event payload, the consumer's handler (records every application in
//! `soak_applied`, which has no unique constraint so a double apply shows; rejects poison events as permanent) and
//! its tables.
//!
//! The schedule explorer ([`super::explore`]) runs one consumer per subscriber with the same handler: each records
//! its own subscriber's name with every application, reads `soak_control` (poison cured up to an event number,
//! a slowness of its own) and rejects only the poison meant for it.

use std::time::Duration;

use outbox::consumer::{Event, Handler, HandlerError, Registry};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

use super::topics::{ORDERED, POISON_REASON, UNORDERED};

/// A soak event's payload.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SoakPayload {
    /// The producer's number of this event (the explorer: unique per write attempt, the event's identity in its
    /// checker).
    pub n: u64,
    /// The consumer rejects it as permanent (every subscriber).
    pub poison: bool,
    /// The subscribers (stored names, `""` the default one) whose consumer rejects it as permanent until it is
    /// cured (`soak_control`, `cured`); the explorer's poison.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub poison_for: Vec<String>,
}

/// The consumer's handler: records the application (no unique constraint: a double apply shows) or rejects a
/// poison event as permanent.
#[derive(Debug, Clone, Default)]
pub struct Apply {
    /// The subscriber this consumer is (stored name: `""` the default one), recorded with each application.
    pub subscriber: String,
    /// Reads `soak_control` for every event (the explorer's consumers): curable poison and slowness.
    pub controlled: bool,
}

impl Handler<SoakPayload> for Apply {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        event: &Event<SoakPayload>,
    ) -> Result<(), HandlerError> {
        let p = &event.payload;
        if p.poison {
            return Err(HandlerError::permanent(POISON_REASON));
        }
        if self.controlled {
            let (slow_ms, cured): (i64, i64) = event
                .statements
                .query_as(
                    "SELECT coalesce((SELECT value FROM soak_control WHERE name = 'slow:' || $1), 0), \
                            coalesce((SELECT value FROM soak_control WHERE name = 'cured'), -1)",
                )
                .bind(&self.subscriber)
                .fetch_one(&mut *conn)
                .await?;
            if slow_ms > 0 {
                tokio::time::sleep(Duration::from_millis(slow_ms as u64)).await;
            }
            if p.poison_for.contains(&self.subscriber) && p.n as i64 > cured {
                return Err(HandlerError::permanent(POISON_REASON));
            }
        }
        event
            .statements
            .query(
                "INSERT INTO soak_applied (outbox_id, topic, partition_key, seq, n, subscriber) \
             VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(event.meta.outbox_id)
            .bind(&event.meta.topic)
            .bind(event.meta.key.as_deref())
            .bind(event.meta.seq)
            .bind(p.n as i64)
            .bind(&self.subscriber)
            .execute(conn)
            .await?;
        Ok(())
    }
}

/// The soak consumer's topics.
pub fn registry() -> Registry {
    Registry::new()
        .on(ORDERED.name(), Apply::default())
        .on(UNORDERED.name(), Apply::default())
}

/// A consumer of `topics` that records its applications as `apply.subscriber`'s.
pub fn registry_for<'a>(topics: impl IntoIterator<Item = &'a str>, apply: &Apply) -> Registry {
    topics
        .into_iter()
        .fold(Registry::new(), |r, t| r.on(t, apply.clone()))
}

const SOAK_TABLE: &str = "CREATE TABLE soak_applied (
    ord           bigserial   PRIMARY KEY,   -- application order (commit order is close enough per key: one key's
                                              -- events are applied one after the other)
    outbox_id     bigint      NOT NULL,      -- no unique constraint: a double apply must be visible
    topic         text        NOT NULL,
    partition_key text,
    seq           bigint,
    n             bigint      NOT NULL,
    subscriber    text        NOT NULL DEFAULT '',  -- which subscriber's consumer applied it
    applied_at    timestamptz NOT NULL DEFAULT clock_timestamp()
)";

/// What the explorer tells its consumers: `cured` (poison events up to this number are accepted), `slow:<name>`
/// (milliseconds subscriber `<name>`'s handler sleeps per event).
const CONTROL_TABLE: &str =
    "CREATE TABLE soak_control (name text PRIMARY KEY, value bigint NOT NULL)";

/// Creates the soak consumer's tables, `soak_applied` and `soak_control` (in a database the library's migrations
/// ran on).
pub async fn create_table(db: &PgPool) -> anyhow::Result<()> {
    sqlx::query(SOAK_TABLE).execute(db).await?;
    sqlx::query(CONTROL_TABLE).execute(db).await?;
    Ok(())
}
