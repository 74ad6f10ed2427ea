//! The soak's application: its event payload, the consumer's handler (records every application in
//! `soak_applied`, which has no unique constraint so a double apply shows; rejects poison events as permanent) and
//! its table.

use outbox::consumer::{Event, Handler, HandlerError, Registry};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

use super::{ORDERED, POISON_REASON, UNORDERED};

/// A soak event's payload.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SoakPayload {
    /// The producer's number of this event.
    pub n: u64,
    /// The consumer rejects it as permanent.
    pub poison: bool,
}

/// The consumer's handler: records the application (no unique constraint: a double apply shows) or rejects a
/// poison event as permanent.
pub struct Apply;

impl Handler<SoakPayload> for Apply {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        event: &Event<SoakPayload>,
    ) -> Result<(), HandlerError> {
        if event.payload.poison {
            return Err(HandlerError::permanent(POISON_REASON));
        }
        event.statements.query(
            "INSERT INTO soak_applied (outbox_id, topic, partition_key, seq, n) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(event.meta.outbox_id)
        .bind(&event.meta.topic)
        .bind(event.meta.key.as_deref())
        .bind(event.meta.seq)
        .bind(event.payload.n as i64)
        .execute(conn)
        .await?;
        Ok(())
    }
}

/// The soak consumer's topics.
pub fn registry() -> Registry {
    Registry::new()
        .on(ORDERED.name(), Apply)
        .on(UNORDERED.name(), Apply)
}

const SOAK_TABLE: &str = "CREATE TABLE soak_applied (
    ord           bigserial   PRIMARY KEY,   -- application order (commit order is close enough per key: one key's
                                              -- events are applied one after the other)
    outbox_id     bigint      NOT NULL,      -- no unique constraint: a double apply must be visible
    topic         text        NOT NULL,
    partition_key text,
    seq           bigint,
    n             bigint      NOT NULL,
    applied_at    timestamptz NOT NULL DEFAULT now()
)";

/// Creates the soak consumer's table, `soak_applied` (in a database the library's migrations ran on).
pub async fn create_table(db: &PgPool) -> anyhow::Result<()> {
    sqlx::query(SOAK_TABLE).execute(db).await?;
    Ok(())
}
