//! The explorer's own reads that judge an action, with SQL of its own: the retained events a replay owes, and
//! how many of the rows an action must not touch are gone.

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};

use super::state::Operator;
use crate::soak::explore::retry::retry;
use crate::soak::explore::schedule::TOPICS;

impl Operator {
    /// The events of `topic` written at or after `since` (by the producers' own clock) that some copy in the
    /// outbox still holds.
    pub(super) async fn retained(
        &self,
        topic: usize,
        since: DateTime<Utc>,
    ) -> Result<BTreeSet<u64>, sqlx::Error> {
        let held: Vec<i64> = sqlx::query_scalar(
            "SELECT DISTINCT (payload->>'n')::bigint FROM outbox WHERE topic = $1 AND created_at >= $2",
        )
        .bind(TOPICS[topic].name())
        .bind(since)
        .fetch_all(&self.db)
        .await?;
        let held: BTreeSet<u64> = held.into_iter().map(|n| n as u64).collect();
        let h = self.history();
        Ok(h.written
            .iter()
            .filter(|w| w.topic == topic && w.start >= since && held.contains(&w.n))
            .map(|w| w.n)
            .collect())
    }

    /// How many of the outbox rows `ids` are gone (`None`: Postgres did not answer).
    pub(super) async fn gone(&self, ids: &[i64]) -> Option<i64> {
        let left: i64 = retry(|| {
            sqlx::query_scalar("SELECT count(*) FROM outbox WHERE id = ANY($1)")
                .bind(ids)
                .fetch_one(&self.db)
        })
        .await
        .ok()?;
        Some(ids.len() as i64 - left)
    }
}
