//! The poison cured, and the dead-letter actions, as `outbox dead-letters redrive` and `purge` run them with a
//! filter (every second one through the console instead): the dead letters read before and after with SQL of the
//! explorer's own, and any taken outside the selection recorded.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use chrono::{DateTime, Utc};
use outbox::dead_letters::{self, Filter, PurgeError, RedriveError, RedriveOptions};

use super::state::Operator;
use crate::soak::explore::console::Bulk;
use crate::soak::explore::history::Outcome;
use crate::soak::explore::retry::{Failure, attempt, retry};
use crate::soak::explore::schedule::{SUBSCRIBERS, Selection, TOPICS};

/// A dead letter as the selection checks read it.
#[derive(Debug, Clone, PartialEq)]
struct DeadLetterRow {
    /// The event's number (from the payload the dead letter keeps).
    n: Option<i64>,
    topic: Option<String>,
    subscriber: String,
    key: Option<String>,
    error: String,
    redriven: bool,
}

impl Operator {
    pub(super) async fn cure(&mut self) -> Outcome {
        let upto = self.next_n.load(Ordering::SeqCst).saturating_sub(1);
        let at = Utc::now();
        let r = retry(|| {
            sqlx::query(
                "INSERT INTO soak_control (name, value) VALUES ('cured', $1) \
                 ON CONFLICT (name) DO UPDATE SET value = greatest(soak_control.value, excluded.value)",
            )
            .bind(upto as i64)
            .execute(&self.db)
        })
        .await;
        match r {
            Ok(_) => {
                self.history().cures.push((at, upto));
                Outcome::Done(format!("poison up to {upto} accepted"))
            }
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }

    fn filter(sel: &Selection) -> Filter {
        Filter {
            topic: sel.topic.map(|t| TOPICS[t].name().into()),
            subscriber: sel.subscriber.map(|s| SUBSCRIBERS[s].to_owned()),
            key: sel.key.map(|k| format!("k{k}").into()),
            error: sel.poison.then(|| "poison".to_owned()),
            ..Filter::default()
        }
    }

    /// Whether a dead letter is in a selection, by the explorer's own reading of the filter.
    fn selects(sel: &Selection, d: &DeadLetterRow) -> bool {
        sel.topic
            .is_none_or(|t| d.topic.as_deref() == Some(TOPICS[t].name()))
            && sel
                .subscriber
                .is_none_or(|s| d.subscriber == SUBSCRIBERS[s])
            && sel
                .key
                .is_none_or(|k| d.key.as_deref() == Some(&format!("k{k}")))
            && (!sel.poison || d.error.to_lowercase().contains("poison"))
    }

    async fn dead_letters(&self) -> Result<BTreeMap<i64, DeadLetterRow>, sqlx::Error> {
        #[allow(clippy::type_complexity)]
        let rows: Vec<(i64, Option<i64>, Option<String>, String, Option<String>, String, bool)> = sqlx::query_as(
            "SELECT id, (payload->>'n')::bigint, topic, subscriber, partition_key, error, redriven_at IS NOT NULL \
             FROM dead_letters",
        )
        .fetch_all(&self.db)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(id, n, topic, subscriber, key, error, redriven)| {
                (
                    id,
                    DeadLetterRow {
                        n,
                        topic,
                        subscriber,
                        key,
                        error,
                        redriven,
                    },
                )
            })
            .collect())
    }

    pub(super) async fn redrive(&mut self, sel: &Selection) -> Outcome {
        let filter = Self::filter(sel);
        let via_console = match self.via_console().await {
            Ok(v) => v,
            Err(e) => return Outcome::Failed(e),
        };
        let me = &*self;
        let before = match retry(|| me.dead_letters()).await {
            Ok(b) => b,
            Err(e) => return Outcome::Failed(e.to_string()),
        };
        let started = Utc::now();
        let outcome = attempt(|| async {
            if let (true, Some(console)) = (via_console, &self.console) {
                return console.bulk(Bulk::Redrive, sel).await;
            }
            match dead_letters::redrive_matching(
                &self.db,
                &filter,
                RedriveOptions::default(),
                |_| {},
            )
            .await
            {
                Ok(r) => Ok(format!(
                    "{} redriven, {} skipped, {} failed",
                    r.redriven, r.skipped, r.failed
                )),
                Err(e @ RedriveError::Database(_)) => Err(Failure::Transient(e.to_string())),
                Err(e) => Err(Failure::Refused(e.to_string())),
            }
        })
        .await;
        let me = &*self;
        if let Ok(after) = retry(|| me.dead_letters()).await {
            // Judged on the row as it is after: a dead letter recorded while the action ran (between the snapshot
            // and the redrive, or while it was retried after a failure) is the redrive's to take when it matches.
            let outside: Vec<i64> = after
                .iter()
                .filter(|(id, d)| d.redriven && before.get(id).is_none_or(|b| !b.redriven))
                .filter(|(_, d)| !Self::selects(sel, d))
                .map(|(id, _)| *id)
                .collect();
            if !outside.is_empty() {
                self.history().outside_selection.push(format!(
                    "dead-letters redrive {sel}: redrove dead letters outside the selection: {outside:?}"
                ));
            }
            let redriven: Vec<(u64, String, DateTime<Utc>)> = after
                .iter()
                .filter(|(id, d)| d.redriven && before.get(id).is_none_or(|b| !b.redriven))
                .filter_map(|(_, d)| d.n.map(|n| (n as u64, d.subscriber.clone(), started)))
                .collect();
            self.history().redriven.extend(redriven);
        }
        outcome
    }

    pub(super) async fn purge(&mut self, sel: &Selection, handled_only: bool) -> Outcome {
        let filter = Self::filter(sel);
        // The console's list offers a purge of the unhandled or of all the matching dead letters: a purge of the
        // handled ones only goes through the library.
        let via_console = match handled_only {
            true => false,
            false => match self.via_console().await {
                Ok(v) => v,
                Err(e) => return Outcome::Failed(e),
            },
        };
        let me = &*self;
        let before = match retry(|| me.dead_letters()).await {
            Ok(b) => b,
            Err(e) => return Outcome::Failed(e.to_string()),
        };
        let started = Utc::now();
        let outcome = attempt(|| async {
            if let (true, Some(console)) = (via_console, &self.console) {
                return console.bulk(Bulk::Purge, sel).await;
            }
            let scope = if handled_only {
                dead_letters::PurgeScope::Handled
            } else {
                dead_letters::PurgeScope::Any
            };
            match dead_letters::purge(&self.db, &filter, scope, 100, |_| {}).await {
                Ok(c) => Ok(format!(
                    "{} purged, {} kept (blocking)",
                    c.deleted, c.kept_blocking
                )),
                Err(e @ PurgeError::Database(_)) => Err(Failure::Transient(e.to_string())),
                Err(e) => Err(Failure::Refused(e.to_string())),
            }
        })
        .await;
        let me = &*self;
        if let Ok(after) = retry(|| me.dead_letters()).await {
            let deleted: Vec<(&i64, &DeadLetterRow)> = before
                .iter()
                .filter(|(id, _)| !after.contains_key(id))
                .collect();
            let outside: Vec<i64> = deleted
                .iter()
                .filter(|(_, d)| !Self::selects(sel, d))
                .map(|(id, _)| **id)
                .collect();
            if !outside.is_empty() {
                self.history().outside_selection.push(format!(
                    "dead-letters purge {sel}: purged dead letters outside the selection: {outside:?}"
                ));
            }
            self.history().purged.extend(
                deleted
                    .iter()
                    .filter_map(|(_, d)| d.n.map(|n| (n as u64, d.subscriber.clone()))),
            );
            // Dead letters recorded while the purge ran (after the snapshot above) that it took too: their events
            // are dead with no dead letter left, which a purge is allowed to leave (seed 122: a purge at the console
            // took two recorded 200 ms into it).
            let me = &*self;
            // (A transaction's `now()` is its start: one that began a little before the purge.)
            let since = started - chrono::Duration::seconds(10);
            if let Ok(gone) = retry(|| me.dead_without_dead_letter(since)).await {
                let taken: Vec<(u64, String)> = gone
                    .into_iter()
                    .filter(|(_, d)| Self::selects(sel, d))
                    .filter_map(|(n, d)| n.map(|n| (n as u64, d.subscriber)))
                    .collect();
                self.history().purged.extend(taken);
            }
        }
        outcome
    }

    /// Copies dead-lettered since `since` that have no dead letter at all, as the selection checks read a dead
    /// letter (their error is the copy's last error).
    async fn dead_without_dead_letter(
        &self,
        since: DateTime<Utc>,
    ) -> Result<Vec<(Option<i64>, DeadLetterRow)>, sqlx::Error> {
        #[allow(clippy::type_complexity)]
        let rows: Vec<(Option<i64>, String, String, String, Option<String>)> = sqlx::query_as(
            "SELECT (o.payload->>'n')::bigint, o.topic, o.subscriber, o.partition_key, o.last_error FROM outbox o \
             WHERE o.dead_lettered_at >= $1 \
               AND NOT EXISTS (SELECT 1 FROM dead_letters d WHERE d.outbox_id = o.id)",
        )
        .bind(since)
        .fetch_all(&self.db)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(n, topic, subscriber, key, error)| {
                (
                    n,
                    DeadLetterRow {
                        n,
                        topic: Some(topic),
                        subscriber,
                        key: Some(key),
                        error: error.unwrap_or_default(),
                        redriven: false,
                    },
                )
            })
            .collect())
    }
}
