//! The operator console's action log (`outbox_console_actions`): every state-changing action taken through the
//! console, with who took it (a token's name, or `local`), on what, and what it did.
//!
//! | Rule | Why |
//! |---|---|
//! | An action is logged by [`start`] before it runs, then completed by [`finish`] with its outcome | A failure half-way (a database error, a timeout, the console stopped) still leaves a record of what was started, and [`finish`] of what was done before it failed |
//! | A row without `finished_at` is an action that never reported back | The console (or its connection) died under way: check what it selected |

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgConnection;

use crate::ids::OutboxId;

/// An action to record.
#[derive(Debug, Clone, Serialize)]
pub struct NewAction<'a> {
    /// The token's name, or `local`.
    pub actor: &'a str,
    /// `redrive`, `redrive_bulk` or `purge`.
    pub action: &'a str,
    /// The dead letter of a single-item action.
    pub dead_letter_id: Option<i64>,
    /// Its event.
    pub outbox_id: Option<OutboxId>,
    /// A bulk action's selection (its filter).
    pub selection: Option<Value>,
}

/// A recorded action.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct Action {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub actor: String,
    pub action: String,
    pub dead_letter_id: Option<i64>,
    pub outbox_id: Option<OutboxId>,
    pub selection: Option<Value>,
    /// What it did: counts, or why it was refused or stopped; `None` until it finished.
    pub outcome: Option<Value>,
    /// When it finished; `None`: under way, or it never reported back.
    pub finished_at: Option<DateTime<Utc>>,
}

const COLUMNS: &str =
    "id, at, actor, action, dead_letter_id, outbox_id, selection, outcome, finished_at";

/// Records an action about to run (and logs it); returns its id, for [`finish`].
pub async fn start(conn: &mut PgConnection, a: &NewAction<'_>) -> Result<i64, sqlx::Error> {
    let id: i64 = sqlx::query_scalar(crate::schema::q(
        "INSERT INTO {schema}.outbox_console_actions (actor, action, dead_letter_id, outbox_id, selection) \
         VALUES ($1, $2, $3, $4, $5) RETURNING id",
    ))
    .bind(a.actor)
    .bind(a.action)
    .bind(a.dead_letter_id)
    .bind(a.outbox_id)
    .bind(&a.selection)
    .fetch_one(&mut *conn)
    .await?;
    tracing::info!(
        action_id = id,
        actor = a.actor,
        action = a.action,
        dead_letter_id = a.dead_letter_id,
        outbox_id = a.outbox_id.map(OutboxId::get),
        selection = a.selection.as_ref().map(|v| v.to_string()),
        "console action started"
    );
    Ok(id)
}

/// Completes the action [`start`] recorded: its outcome (what it did, or why it was refused or stopped, with
/// what it had done by then) and, once known, its event.
pub async fn finish(
    conn: &mut PgConnection,
    id: i64,
    outbox_id: Option<OutboxId>,
    outcome: &Value,
) -> Result<(), sqlx::Error> {
    sqlx::query(crate::schema::q(
        "UPDATE {schema}.outbox_console_actions \
         SET outcome = $2, outbox_id = coalesce($3, outbox_id), finished_at = now() WHERE id = $1",
    ))
    .bind(id)
    .bind(outcome)
    .bind(outbox_id)
    .execute(&mut *conn)
    .await?;
    tracing::info!(action_id = id, outcome = %outcome, "console action finished");
    Ok(())
}

/// The latest actions, newest first.
pub async fn recent(conn: &mut PgConnection, limit: u32) -> Result<Vec<Action>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(crate::schema::sql(&format!(
        "SELECT {COLUMNS} FROM {{schema}}.outbox_console_actions ORDER BY id DESC LIMIT $1"
    ))))
    .bind(i64::from(limit.clamp(1, 1000)))
    .fetch_all(&mut *conn)
    .await
}

/// The actions taken on one event, oldest first.
pub async fn for_event(
    conn: &mut PgConnection,
    outbox_id: OutboxId,
) -> Result<Vec<Action>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(crate::schema::sql(&format!(
        "SELECT {COLUMNS} FROM {{schema}}.outbox_console_actions WHERE outbox_id = $1 ORDER BY id LIMIT 100"
    ))))
    .bind(outbox_id)
    .fetch_all(&mut *conn)
    .await
}
