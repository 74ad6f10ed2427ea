//! The smallest application on the outbox: one topic, one handler, one table. The README's "Using it from your
//! code" shows this file; `tests/end_to_end.rs` runs it through the whole pipeline.

use outbox::consumer::{Event, Handler, HandlerError, Registry};
use outbox::{EnqueueError, NewEvent, Topic, enqueue};
use serde::{Deserialize, Serialize};
use sqlx::migrate::Migrator;
use sqlx::{PgConnection, PgPool};

/// Your tables, run after `outbox::MIGRATOR` on the same database; each ignores the other's versions.
pub static MIGRATOR: Migrator = Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("./migrations")
};

/// Any order between events (`Topic::ordered` keeps per-key order).
pub const SIGNUPS: Topic = Topic::unordered("signups");

/// The event's payload (JSON).
#[derive(Debug, Serialize, Deserialize)]
pub struct SignedUp {
    pub user_id: i64,
    pub email: String,
}

/// Producer: the row and its event commit together, or neither does.
pub async fn sign_up(pool: &PgPool, tenant: &str, email: &str) -> Result<i64, EnqueueError> {
    let mut tx = pool.begin().await?;
    let user_id: i64 =
        sqlx::query_scalar("INSERT INTO signups (tenant, email) VALUES ($1, $2) RETURNING id")
            .bind(tenant)
            .bind(email)
            .fetch_one(&mut *tx)
            .await?;
    let payload = SignedUp {
        user_id,
        email: email.to_owned(),
    };
    // Your own metadata travels as headers, signed like the payload (also `.traceparent(..)`, …).
    let event = NewEvent::new(&SIGNUPS, user_id.to_string(), &payload)?.header("tenant", tenant);
    enqueue(&mut tx, event).await?;
    tx.commit().await?;
    Ok(user_id)
}

/// Consumer: applied once per event, in the transaction that records it as handled.
pub struct SendWelcome;

impl Handler<SignedUp> for SendWelcome {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        event: &Event<SignedUp>,
    ) -> Result<(), HandlerError> {
        let Some(tenant) = event.header("tenant") else {
            return Err(HandlerError::permanent("no tenant header")); // 489: dead letter, no retries
        };
        let welcomed = event
            .statements
            .query("UPDATE signups SET welcomed_at = now() WHERE id = $1 AND tenant = $2")
            .bind(event.payload.user_id)
            .bind(tenant)
            .execute(conn)
            .await?; // a database error: retried, or dead-lettered when the data is at fault
        if welcomed.rows_affected() == 0 {
            return Err(HandlerError::permanent("no such signup for this tenant"));
        }
        Ok(())
    }
}

/// What the consumer function runs (`functions/consumer/src/main.rs`).
pub fn registry() -> Registry {
    Registry::new().on(SIGNUPS.name(), SendWelcome)
}
