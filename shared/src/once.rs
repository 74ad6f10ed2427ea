//! Guarantee 2 — **no side effect is applied twice.**
//!
//! QStash delivers at least once (and the relay republishes after an ambiguous publish or a lost delivery
//! callback), so a consumer sees the same event more than once. Applying it is made idempotent by these steps:
//!
//! 1. `BEGIN`;
//! 2. `INSERT INTO processed_messages (consumer, message_id) … ON CONFLICT DO NOTHING` — **first**, before any
//!    side effect. A concurrent duplicate blocks on the primary-key index until the first transaction ends: if
//!    that one commits, the insert finds the conflict (zero rows) and the duplicate does nothing; if it rolls
//!    back, the duplicate's insert succeeds and it does the work itself;
//! 3. the work, on the **same** connection inside the same transaction;
//! 4. `COMMIT` — the dedupe row and the side effects become visible together, or (error, crash, timeout)
//!    neither does and the next delivery applies the event.
//!
//! The dedupe key is the **event's id** (the signed envelope's `event`, else its outbox `id`), never QStash's
//! message id: a republish or a DLQ redrive gets a new QStash message id but is still the same event; and never a
//! copy's own row id: with fan-out, a replay or a subscriber added again makes new copies of an event the
//! subscriber may have applied already (decision record 0070). The namespace is the consumer's `CONSUMER_NAME`,
//! one per subscriber. A failed commit is ambiguous (it may have
//! committed): the caller answers 5xx, and the redelivery finds the row and answers "duplicate".
//!
//! The consumer runtime (`consumer::handle_event`) applies every delivery — one event, or a batch of several in
//! one message (decision record 0027) — with these steps for all its events inside one transaction: step 2 for
//! every event at once ([`claim_all`], one statement), then each event's work inside its own `SAVEPOINT` (a single
//! event needs none), so an event that fails is undone alone and the events before it still commit; the dedupe
//! rows of the events that did not commit are removed before the commit ([`forget`]), so their next delivery
//! applies them. [`handle_once`] is the same guarantee for one piece of work of your own, outside the consumer
//! runtime (it is not the consumer's path).
//!
//! Keep `processed_messages` rows longer than any redelivery horizon (QStash retries span a day, redrives can be
//! later): the relay's housekeeping prunes them after `PROCESSED_TTL_HOURS` (default 7 days). *Dedupe row* and
//! the other terms are defined in the repository's `docs/glossary.md`.

use std::collections::HashSet;

use sqlx::PgConnection;

use crate::db::{Db, Statements};
use crate::ids::OutboxId;

/// What [`handle_once`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Once<T> {
    /// First time: the work ran and committed with the dedupe row.
    Applied(T),
    /// The message was already processed (committed earlier, possibly by a concurrent call): nothing ran.
    Duplicate,
}

/// A [`handle_once`] failure; nothing was committed in either case.
#[derive(Debug, thiserror::Error)]
pub enum OnceError<E> {
    /// Beginning the transaction, the dedupe insert or the commit failed (transient; a failed commit is
    /// ambiguous and is resolved by the next delivery).
    #[error("database error while recording the processed message")]
    Database(#[source] sqlx::Error),
    /// The work returned an error; the transaction (dedupe row included) was rolled back.
    #[error("the work failed and was rolled back")]
    Work(E),
}

/// The dedupe insert (step 2 of the module docs).
pub const DEDUPE_SQL: &str = "INSERT INTO {schema}.processed_messages (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING";

/// Runs `work` at most once per `(consumer, message_id)`: dedupe row first, then the work in the same
/// transaction, then commit. `db` is the database handle (its [`crate::db::Statements`] mode goes to the dedupe
/// insert; use [`Db::query`] for the work's own statements).
///
/// ```no_run
/// # async fn f(db: outbox::db::Db) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox::once::{handle_once, Once};
/// let amount = 42_i64;
/// let outcome = handle_once(&db, "billing", "1234", async |conn: &mut sqlx::PgConnection| {
///     db.query("INSERT INTO payments (invoice_id, amount_cents) VALUES ('i-1', $1)")
///         .bind(amount)
///         .execute(&mut *conn)
///         .await?;
///     Ok::<_, sqlx::Error>(())
/// })
/// .await?;
/// assert!(matches!(outcome, Once::Applied(()) | Once::Duplicate));
/// # Ok(()) }
/// ```
pub async fn handle_once<T, E, F>(
    db: &Db,
    consumer: &str,
    message_id: &str,
    work: F,
) -> Result<Once<T>, OnceError<E>>
where
    F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
{
    let mut tx = db.pool().begin().await.map_err(OnceError::Database)?;
    let inserted = db
        .query(crate::schema::q(DEDUPE_SQL))
        .bind(consumer)
        .bind(message_id)
        .execute(&mut *tx)
        .await
        .map_err(OnceError::Database)?
        .rows_affected();
    if inserted == 0 {
        // Already processed; end the (empty) transaction.
        tx.rollback().await.map_err(OnceError::Database)?;
        return Ok(Once::Duplicate);
    }
    match work(&mut tx).await {
        Ok(value) => {
            tx.commit().await.map_err(OnceError::Database)?;
            Ok(Once::Applied(value))
        }
        Err(e) => {
            // A failed rollback leaves the connection to the pool's cleanup; the work's error is what matters.
            if let Err(rb) = tx.rollback().await {
                tracing::warn!(error = %rb, "rollback after a failed handler did not complete");
            }
            Err(OnceError::Work(e))
        }
    }
}

/// The relay's reading of [`DedupeKey`] in SQL, for outbox row `$o` (a table alias): whether its subscriber's
/// consumer applied it — a dedupe row in the namespace `$ns` (the parameter holding `CONSUMER_NAME`) for the
/// default subscriber's copies, in the subscriber's own name otherwise, under the copy's event id or, for a row
/// written before decision record 0070, the copy's own id. One text for every statement that asks (the applied
/// sweep, the reconciler), so the rule has one home. Expands to a string literal for `concat!`.
macro_rules! applied_sql {
    ($o:literal, $ns:literal) => {
        concat!(
            "EXISTS (SELECT 1 FROM {schema}.processed_messages pm WHERE pm.consumer = CASE WHEN ",
            $o,
            ".subscriber = '' THEN ",
            $ns,
            " ELSE ",
            $o,
            ".subscriber END AND pm.message_id IN (coalesce(",
            $o,
            ".event_id, ",
            $o,
            ".id)::text, ",
            $o,
            ".id::text))"
        )
    };
}
pub(crate) use applied_sql;

/// Which dedupe row stands for an event delivered in a copy ([`claim_all`]): the event's id, the same in every copy
/// of it (decision record 0070), and the copy's own outbox id, the key of rows written before that decision (kept
/// `PROCESSED_TTL_HOURS`, so a copy applied under its own id before an upgrade is still recognised after it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DedupeKey {
    /// The event: the dedupe row's `message_id`.
    pub event: OutboxId,
    /// The copy delivered (equal to `event` for the event's first copy).
    pub copy: OutboxId,
}

/// Step 2 for several events in the caller's transaction, in one statement: inserts the dedupe rows of the events
/// of `keys` and returns, per key in the order given, `true` when its event's row was inserted now (first time:
/// apply it) or `false` when it existed (a duplicate: do nothing; also a repeat of an event earlier in the slice,
/// and a copy whose own id has a row from before decision record 0070). The rows are inserted in sorted order, so
/// two transactions claiming overlapping batches wait for each other instead of deadlocking; a concurrent
/// duplicate blocks until the other transaction ends, as in step 2. Rows of events that end up not applied must
/// be removed with [`forget`] before the commit.
pub(crate) async fn claim_all(
    conn: &mut PgConnection,
    consumer: &str,
    keys: &[DedupeKey],
    statements: Statements,
) -> Result<Vec<bool>, sqlx::Error> {
    let mut sorted: Vec<String> = keys.iter().map(|k| k.event.to_string()).collect();
    sorted.sort_unstable();
    sorted.dedup();
    let inserted: Vec<String> = statements
        .query_scalar(crate::schema::q(
            "INSERT INTO {schema}.processed_messages (consumer, message_id) \
             SELECT $1, m FROM unnest($2::text[]) WITH ORDINALITY AS u(m, i) ORDER BY i \
             ON CONFLICT DO NOTHING RETURNING message_id",
        ))
        .bind(consumer)
        .bind(&sorted)
        .fetch_all(&mut *conn)
        .await?;
    let mut fresh: HashSet<OutboxId> = inserted
        .iter()
        .filter_map(|m| m.parse::<i64>().ok().map(OutboxId))
        .collect();
    // A copy other than the event's first, new under the event's id: a row under its own id (written before the
    // key was the event) means it was applied all the same. None to look for without fan-out.
    let older: Vec<String> = keys
        .iter()
        .filter(|k| k.copy != k.event && fresh.contains(&k.event))
        .map(|k| k.copy.to_string())
        .collect();
    if !older.is_empty() {
        let applied: Vec<String> = statements
            .query_scalar(crate::schema::q(
                "SELECT message_id FROM {schema}.processed_messages \
                 WHERE consumer = $1 AND message_id = ANY($2::text[])",
            ))
            .bind(consumer)
            .bind(&older)
            .fetch_all(&mut *conn)
            .await?;
        for copy in applied {
            if let Some(k) = keys.iter().find(|k| k.copy.to_string() == copy) {
                fresh.remove(&k.event);
            }
        }
    }
    // `remove`: the first occurrence of an event is the one to apply; a repeat is a duplicate.
    Ok(keys.iter().map(|k| fresh.remove(&k.event)).collect())
}

/// Removes dedupe rows [`claim_all`] inserted in this transaction for events that were not applied (failed, not
/// attempted), so that their next delivery applies them.
pub(crate) async fn forget(
    conn: &mut PgConnection,
    consumer: &str,
    events: &[OutboxId],
    statements: Statements,
) -> Result<(), sqlx::Error> {
    if events.is_empty() {
        return Ok(());
    }
    let texts: Vec<String> = events.iter().map(OutboxId::to_string).collect();
    statements
        .query(crate::schema::q(
            "DELETE FROM {schema}.processed_messages WHERE consumer = $1 AND message_id = ANY($2::text[])",
        ))
        .bind(consumer)
        .bind(&texts)
        .execute(&mut *conn)
        .await?;
    Ok(())
}
