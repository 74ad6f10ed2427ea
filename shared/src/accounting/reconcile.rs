//! The reconciler: events in flight past the horizon are looked up at QStash and closed (the table in
//! [`crate::accounting`]). Bounded per invocation: at most `RELAY_RECONCILE_MAX_LOOKUPS` management API requests,
//! `RELAY_RECONCILE_MIN_INTERVAL_MS` apart, stopping at the first 429 or failure (the next invocation goes on).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde_json::{Map, Value, json};
use sqlx::Row;

use super::AccountingReport;
use crate::callbacks::{CallbackOutcome, FailureRecorder, record_failure};
use crate::config::{AccountingConfig, DeadHeadPolicy};
use crate::db::Db;
use crate::dead_letters::FailureRecorded;
use crate::qstash::{DLQ_IDS_PER_REQUEST, ManageError, QstashClient};

/// What the reconciler works with: the relay's database handle, QStash client and settings.
pub struct Reconciler<'a> {
    /// The outbox's database.
    pub db: &'a Db,
    /// The relay's QStash client (its token).
    pub client: &'a QstashClient,
    /// The accounting settings.
    pub cfg: &'a AccountingConfig,
    /// `PROCESSED_TTL_HOURS`: an event is republished only while a dedupe row of an earlier application would
    /// outlive the new message's delivery ([`AccountingConfig::republish_window`]).
    pub processed_ttl: Duration,
    /// The dead-head policy of an ordered topic (for dead letters recorded from the DLQ).
    pub policy: &'a (dyn Fn(&str) -> DeadHeadPolicy + Sync),
}

/// Why a reconciliation pass stopped early.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// A database statement failed.
    #[error("database error while reconciling")]
    Database(#[from] sqlx::Error),
    /// Recording a dead letter from the DLQ failed.
    #[error("could not record a dead letter from QStash's DLQ: {0}")]
    Record(String),
    /// A management API request failed (the pass stops; the next invocation tries again).
    #[error(transparent)]
    Lookup(#[from] ManageError),
}

/// In-flight events past the horizon not looked at recently, oldest first: `$1` horizon secs, `$2` recheck secs.
const CANDIDATES_SQL: &str = r#"
SELECT id, seq, qstash_message_id
FROM {schema}.outbox
WHERE dispatched_at IS NOT NULL AND delivered_at IS NULL AND dead_lettered_at IS NULL
  AND dispatched_at < now() - make_interval(secs => $1)
  AND (reconciled_at IS NULL OR reconciled_at < now() - make_interval(secs => $2))
ORDER BY dispatched_at, id
LIMIT $3
"#;

/// Unordered events of a message QStash does not know, still in flight under that message, published again with a
/// fresh deduplication id: `$1` ids, `$2` the message id they were asked about, `$3` the reason, `$4` the republish
/// limit, `$5` the republish window (secs, [`AccountingConfig::republish_window`]) measured from the event's first
/// claim (its creation when no claim was recorded; never for a re-inserted event, `-infinity`), which is also the
/// deadline by which a relay must have published it (`republish_by`).
const REPUBLISH_SQL: &str = r#"
UPDATE {schema}.outbox
SET dispatched_at = NULL, available_at = now(), lease_token = NULL, locked_until = NULL, qstash_message_id = NULL,
    republish_count = republish_count + 1, reconciled_at = now(), last_error = left($3, 2000),
    republish_by = coalesce(first_claimed_at, created_at) + make_interval(secs => $5)
WHERE id = ANY ($1::bigint[]) AND seq IS NULL AND dispatched_at IS NOT NULL
  AND delivered_at IS NULL AND dead_lettered_at IS NULL
  AND qstash_message_id IS NOT DISTINCT FROM $2
  AND republish_count < $4
  AND coalesce(first_claimed_at, created_at) > now() - make_interval(secs => $5)
RETURNING id
"#;

/// The unordered events of such a message that may not be published again, still in flight under it: a dead letter
/// each (source `relay`, natural id `<id>/unaccounted/<message id>`, one per message an event was lost under), and
/// only the events whose dead letter was written are marked dead, in the same statement: an event never ends dead
/// without an open dead letter; an event whose dedupe row shows it applied is left to the sweep. `$1` ids, `$2` the
/// message id, `$3` the reason, `$4` the default subscriber's dedupe namespace (`CONSUMER_NAME`).
const UNACCOUNTED_SQL: &str = concat!(
    r#"
WITH c AS (
    SELECT id, topic, partition_key, subscriber, seq, payload, headers, attempts, qstash_message_id, dispatched_at
    FROM {schema}.outbox o
    WHERE id = ANY ($1::bigint[]) AND seq IS NULL AND dispatched_at IS NOT NULL
      AND delivered_at IS NULL AND dead_lettered_at IS NULL
      AND qstash_message_id IS NOT DISTINCT FROM $2
      -- Applied after all: QStash forgets a message once a delivery succeeds, and the consumer committed before it
      -- answered, so a dedupe row written before QStash's answer to the lookup is visible here. The next sweep
      -- records it delivered.
      AND NOT "#,
    crate::once::applied_sql!("o", "$4"),
    r#"
    FOR UPDATE
), dl AS (
    INSERT INTO {schema}.dead_letters (source, natural_id, outbox_id, topic, partition_key, subscriber, seq, payload,
                                       headers, error, attempts, qstash_message_id)
    SELECT 'relay',
           c.id || '/unaccounted/' || coalesce(c.qstash_message_id,
                                               'dispatched-' || (extract(epoch FROM c.dispatched_at) * 1e6)::bigint),
           c.id, c.topic, c.partition_key, c.subscriber, c.seq, c.payload, c.headers, $3, c.attempts,
           c.qstash_message_id
    FROM c
    ON CONFLICT (source, natural_id) DO NOTHING
    RETURNING outbox_id
)
UPDATE {schema}.outbox o
SET dead_lettered_at = now(), locked_until = NULL, republish_by = NULL, last_error = left($3, 2000)
FROM dl
WHERE o.id = dl.outbox_id
RETURNING o.id
"#
);

/// Events put back to be published again whose deadline passed before a relay published them (QStash was down,
/// say): published now, a delivery could outlive the dedupe row of an earlier application. A dead letter each
/// (natural id `<id>/republish-expired/<republish count>`), written before the event is marked dead, as above;
/// rows a relay holds under a live lease are left to it. `$1` the reason, `$2` the most rows.
const EXPIRED_SQL: &str = r#"
WITH c AS (
    SELECT id, topic, partition_key, subscriber, seq, payload, headers, attempts, republish_count
    FROM {schema}.outbox
    WHERE republish_by IS NOT NULL AND republish_by < now()
      AND dispatched_at IS NULL AND delivered_at IS NULL AND dead_lettered_at IS NULL
      AND (locked_until IS NULL OR locked_until < now())
    ORDER BY republish_by
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), dl AS (
    INSERT INTO {schema}.dead_letters (source, natural_id, outbox_id, topic, partition_key, subscriber, seq, payload,
                                       headers, error, attempts)
    SELECT 'relay', c.id || '/republish-expired/' || c.republish_count, c.id, c.topic, c.partition_key,
           c.subscriber, c.seq, c.payload, c.headers, $1, c.attempts
    FROM c
    ON CONFLICT (source, natural_id) DO NOTHING
    RETURNING outbox_id
)
UPDATE {schema}.outbox o
SET dead_lettered_at = now(), republish_by = NULL, lease_token = NULL, locked_until = NULL,
    last_error = left($1, 2000)
FROM dl
WHERE o.id = dl.outbox_id
RETURNING o.id
"#;

/// Expired republishes dead-lettered per pass, at most (the next pass goes on).
const EXPIRED_PER_PASS: i64 = 1000;

/// Notes that QStash was asked about these events (they are asked again after a quarter of the horizon).
const CHECKED_SQL: &str = "UPDATE {schema}.outbox SET reconciled_at = now() \
     WHERE id = ANY ($1::bigint[]) AND delivered_at IS NULL AND dead_lettered_at IS NULL";

/// One QStash message and the in-flight events it carries.
struct Pending {
    message_id: Option<String>,
    unordered: Vec<i64>,
    ordered: Vec<i64>,
}

/// Looks up events in flight past the horizon (see the module docs), adding what it did to `report`. First,
/// whatever the lookup budget, events put back to be published again whose deadline passed unpublished become dead
/// letters ([`EXPIRED_SQL`]).
pub async fn reconcile(
    rec: &Reconciler<'_>,
    budget: Duration,
    report: &mut AccountingReport,
) -> Result<(), ReconcileError> {
    expire_republishes(rec, report).await?;
    if rec.cfg.max_lookups == 0 {
        return Ok(());
    }
    let started = Instant::now();
    let messages = candidates(rec).await?;
    if messages.is_empty() {
        return Ok(());
    }
    let mut lookups = Lookups {
        rec,
        report,
        pace: Pace::new(rec.cfg.lookup_interval),
        started,
        budget,
    };
    // 1. The DLQ, up to 100 message ids per request.
    let known: Vec<String> = messages
        .iter()
        .filter_map(|m| m.message_id.clone())
        .collect();
    let Some(dlq) = lookups.dlq(&known).await? else {
        return Ok(());
    };
    // 2. Every message not in the DLQ (and the events with no message id): does QStash still hold it?
    for m in &messages {
        if m.message_id
            .as_ref()
            .is_some_and(|id| dlq.found.contains(id))
        {
            continue;
        }
        let held = match &m.message_id {
            None => false,
            Some(id) => {
                if !dlq.looked_up.contains(id) {
                    continue;
                }
                if !lookups.may_ask() {
                    return Ok(());
                }
                lookups.pace.wait().await;
                lookups.report.lookups += 1;
                match rec.client.message(id).await {
                    Ok(found) => found.is_some(),
                    Err(e) => return stop(lookups.report, e),
                }
            }
        };
        if held {
            lookups.report.still_retrying += 1;
            let all: Vec<i64> = m.unordered.iter().chain(&m.ordered).copied().collect();
            execute_ids(rec, CHECKED_SQL, &all).await?;
        } else {
            unknown_to_qstash(rec, m, lookups.report).await?;
        }
    }
    Ok(())
}

/// What the DLQ step learnt.
struct DlqAnswers {
    /// Message ids whose DLQ lookup completed (the budget may end the step early; an id whose entry is too large
    /// to read is left out).
    looked_up: HashSet<String>,
    /// Of them, those QStash has in its DLQ.
    found: HashSet<String>,
}

/// The management API requests of one pass, within its budgets.
struct Lookups<'r, 'a> {
    rec: &'r Reconciler<'a>,
    report: &'r mut AccountingReport,
    pace: Pace,
    started: Instant,
    budget: Duration,
}

impl Lookups<'_, '_> {
    /// Whether another request fits the lookup and time budgets.
    fn may_ask(&self) -> bool {
        self.report.lookups < u64::from(self.rec.cfg.max_lookups)
            && self.started.elapsed() < self.budget
    }

    /// Asks QStash's DLQ about `ids` ([`DLQ_IDS_PER_REQUEST`] at a time, cursor-paged) and records each entry
    /// about a message asked about exactly as its failure callback would have been recorded; an entry about any
    /// other message is logged and counted, never recorded (QStash's answer is not trusted to be about the
    /// question). An answer too large to read is asked again about half the messages, down to one (whose entry
    /// is then skipped for this pass). `None`: a budget ran out (the pass ends); a failed request ends it too.
    async fn dlq(&mut self, ids: &[String]) -> Result<Option<DlqAnswers>, ReconcileError> {
        let mut answers = DlqAnswers {
            looked_up: HashSet::new(),
            found: HashSet::new(),
        };
        let mut chunks: Vec<&[String]> = ids.chunks(DLQ_IDS_PER_REQUEST).rev().collect();
        'chunks: while let Some(chunk) = chunks.pop() {
            let asked: HashSet<&str> = chunk.iter().map(String::as_str).collect();
            let mut cursor: Option<String> = None;
            loop {
                if !self.may_ask() {
                    return Ok(None);
                }
                self.pace.wait().await;
                self.report.lookups += 1;
                let page = match self.rec.client.dlq_page(chunk, cursor.as_deref()).await {
                    Ok(p) => p,
                    Err(ManageError::TooLarge { limit, .. }) => {
                        self.report.lookup_failures += 1;
                        if chunk.len() > 1 {
                            let (a, b) = chunk.split_at(chunk.len() / 2);
                            chunks.push(b);
                            chunks.push(a);
                        } else {
                            tracing::error!(message_id = %chunk[0], limit,
                                "reconciler: QStash's DLQ answer about this one message is too large to read; \
                                 it stays in flight (unaccounted) until it can be read");
                        }
                        continue 'chunks;
                    }
                    Err(e) => {
                        stop(self.report, e)?;
                        return Ok(None);
                    }
                };
                for entry in &page.messages {
                    let id = entry.get("messageId").and_then(Value::as_str);
                    match id.filter(|id| asked.contains(id)) {
                        Some(id) => {
                            answers.found.insert(id.to_owned());
                            record_entry(self.rec, entry, self.report).await?;
                        }
                        None => {
                            self.report.unasked_dlq_entries += 1;
                            let dlq_id = entry.get("dlqId").and_then(Value::as_str);
                            tracing::warn!(
                                message_id = id.unwrap_or("(none)"),
                                dlq_id = dlq_id.unwrap_or("(none)"),
                                "reconciler: QStash's DLQ answered about a message it was not asked about; \
                                 not recorded"
                            );
                        }
                    }
                }
                match page.cursor {
                    Some(c) => cursor = Some(c),
                    None => break,
                }
            }
            answers.looked_up.extend(chunk.iter().cloned());
        }
        Ok(Some(answers))
    }
}

/// Dead-letters the events put back to be published again that no relay published before their deadline.
async fn expire_republishes(
    rec: &Reconciler<'_>,
    report: &mut AccountingReport,
) -> Result<(), ReconcileError> {
    let reason = format!(
        "reconciler: published again because QStash had lost it, but no relay published it within {:.1} h of its \
         first claim; published later, a delivery could outlive the consumer's dedupe row of an earlier \
         application (PROCESSED_TTL_HOURS): not published",
        rec.cfg.republish_window(rec.processed_ttl).as_secs_f64() / 3600.0
    );
    let q = rec
        .db
        .query_scalar(crate::schema::q(EXPIRED_SQL))
        .bind(reason)
        .bind(EXPIRED_PER_PASS);
    let dead: Vec<i64> = rec.db.run(async |c| q.fetch_all(c).await).await?;
    note_dead(report, &dead, "event not published again in time");
    Ok(())
}

/// Counts events the reconciler dead-lettered (`unaccounted_dead`) and logs each as an error.
fn note_dead(report: &mut AccountingReport, dead: &[i64], what: &str) {
    report.unaccounted_dead += dead.len() as u64;
    for id in dead {
        tracing::error!(outbox_id = id, "reconciler: {what}: dead letter recorded");
    }
}

/// A failed lookup ends the pass: counted, and (but for a 429, which is expected under load) reported.
fn stop(report: &mut AccountingReport, e: ManageError) -> Result<(), ReconcileError> {
    report.lookup_failures += 1;
    tracing::warn!(error = %e, "reconciler: QStash lookup failed; the next invocation goes on");
    match e {
        ManageError::RateLimited { .. } => Ok(()),
        other => Err(ReconcileError::Lookup(other)),
    }
}

async fn candidates(rec: &Reconciler<'_>) -> Result<Vec<Pending>, sqlx::Error> {
    let limit = i64::from(rec.cfg.max_lookups) * DLQ_IDS_PER_REQUEST as i64;
    let q = rec
        .db
        .query(crate::schema::q(CANDIDATES_SQL))
        .bind(rec.cfg.horizon.as_secs_f64())
        .bind(rec.cfg.horizon.as_secs_f64() / 4.0)
        .bind(limit);
    let rows = rec.db.run(async |c| q.fetch_all(c).await).await?;
    let mut out: Vec<Pending> = Vec::new();
    let mut index: HashMap<Option<String>, usize> = HashMap::new();
    for r in rows {
        let id: i64 = r.try_get("id")?;
        let seq: Option<i64> = r.try_get("seq")?;
        let message_id: Option<String> = r.try_get("qstash_message_id")?;
        let at = *index.entry(message_id.clone()).or_insert_with(|| {
            out.push(Pending {
                message_id,
                unordered: Vec::new(),
                ordered: Vec::new(),
            });
            out.len() - 1
        });
        match seq {
            Some(_) => out[at].ordered.push(id),
            None => out[at].unordered.push(id),
        }
    }
    Ok(out)
}

/// Records one DLQ entry exactly as its failure callback would have been recorded.
async fn record_entry(
    rec: &Reconciler<'_>,
    entry: &Value,
    report: &mut AccountingReport,
) -> Result<(), ReconcileError> {
    let body = callback_body_from_dlq(entry);
    let raw = serde_json::to_vec(&body).unwrap_or_default();
    let recorder = FailureRecorder {
        db: rec.db,
        consumer: &rec.cfg.consumer_name,
        policy: rec.policy,
    };
    match record_failure(&recorder, None, &raw).await {
        CallbackOutcome::DeadLetter { recorded } => match recorded {
            FailureRecorded::Recorded { .. } | FailureRecorded::Merged { .. } => {
                report.recorded_from_dlq += 1
            }
            FailureRecorded::Duplicate => report.already_recorded += 1,
        },
        CallbackOutcome::BatchDeadLetters(r) => {
            report.recorded_from_dlq += (r.dead_letters.len() + r.merged.len()) as u64;
            report.already_recorded += r.duplicates.len() as u64;
        }
        CallbackOutcome::Database(e) => return Err(ReconcileError::Record(e)),
        other => {
            return Err(ReconcileError::Record(format!(
                "unexpected outcome {other:?}"
            )));
        }
    }
    Ok(())
}

/// The failure-callback body QStash would have sent for a DLQ entry (decision record 0015): the entry is the
/// message plus the last response, and the callback describes the same two. A DLQ entry does not say how many
/// retries were made when the consumer answered 489 at once; without `retried`, `maxRetries` stands in.
pub(crate) fn callback_body_from_dlq(entry: &Value) -> Value {
    let get = |k: &str| entry.get(k).cloned().unwrap_or(Value::Null);
    let b64 = |text_key: &str, b64_key: &str| -> Value {
        match (
            entry.get(text_key).and_then(Value::as_str),
            entry.get(b64_key).and_then(Value::as_str),
        ) {
            (Some(t), _) => json!(STANDARD.encode(t.as_bytes())),
            (None, Some(b)) => json!(b),
            (None, None) => Value::Null,
        }
    };
    let mut o = Map::new();
    o.insert("status".into(), get("responseStatus"));
    o.insert("header".into(), get("responseHeader"));
    o.insert("body".into(), b64("responseBody", "responseBodyBase64"));
    let retried = entry
        .get("retried")
        .cloned()
        .filter(|v| !v.is_null())
        .unwrap_or_else(|| get("maxRetries"));
    o.insert("retried".into(), retried);
    o.insert("maxRetries".into(), get("maxRetries"));
    o.insert("dlqId".into(), get("dlqId"));
    o.insert("sourceMessageId".into(), get("messageId"));
    o.insert("url".into(), get("url"));
    o.insert("method".into(), get("method"));
    o.insert("sourceHeader".into(), get("header"));
    o.insert("sourceBody".into(), b64("body", "bodyBase64"));
    for k in [
        "notBefore",
        "createdAt",
        "topicName",
        "endpointName",
        "scheduleId",
    ] {
        if let Some(v) = entry.get(k).filter(|v| !v.is_null()) {
            o.insert(k.into(), v.clone());
        }
    }
    o.retain(|_, v| !v.is_null());
    Value::Object(o)
}

/// A message QStash does not know: its unordered events are published again (or, past the limits, become dead
/// letters); its ordered events are left to their key's evidence timeout, which republishes the head.
async fn unknown_to_qstash(
    rec: &Reconciler<'_>,
    m: &Pending,
    report: &mut AccountingReport,
) -> Result<(), ReconcileError> {
    if !m.ordered.is_empty() {
        report.left_to_evidence_timeout += m.ordered.len() as u64;
        execute_ids(rec, CHECKED_SQL, &m.ordered).await?;
    }
    if m.unordered.is_empty() {
        return Ok(());
    }
    let who = m
        .message_id
        .as_deref()
        .unwrap_or("(no message id recorded)");
    let reason = format!(
        "reconciler: QStash has no record of message {who} (not held, not in its DLQ) and no outcome was recorded \
         within {:.0} s of its acceptance",
        rec.cfg.horizon.as_secs_f64()
    );
    let window = rec.cfg.republish_window(rec.processed_ttl);
    let q = rec
        .db
        .query_scalar(crate::schema::q(REPUBLISH_SQL))
        .bind(&m.unordered)
        .bind(m.message_id.as_deref())
        .bind(format!("{reason}: published again"))
        .bind(rec.cfg.max_republish as i32)
        .bind(window.as_secs_f64());
    let republished: Vec<i64> = rec.db.run(async |c| q.fetch_all(c).await).await?;
    report.republished += republished.len() as u64;
    let rest: Vec<i64> = m
        .unordered
        .iter()
        .copied()
        .filter(|id| !republished.contains(id))
        .collect();
    if rest.is_empty() {
        return Ok(());
    }
    let q = rec
        .db
        .query_scalar(crate::schema::q(UNACCOUNTED_SQL))
        .bind(&rest)
        .bind(m.message_id.as_deref())
        .bind(format!(
            "{reason}; not published again: republished {} time(s) already (RELAY_RECONCILE_MAX_REPUBLISH), or \
             first claimed more than {:.1} h ago, so a new delivery could outlive the consumer's dedupe row of an \
             earlier application (PROCESSED_TTL_HOURS minus QStash's delivery window and a margin; an event \
             re-inserted by a redrive is never published again by the reconciler)",
            rec.cfg.max_republish,
            window.as_secs_f64() / 3600.0
        ))
        .bind(&rec.cfg.consumer_name);
    let dead: Vec<i64> = rec.db.run(async |c| q.fetch_all(c).await).await?;
    note_dead(report, &dead, "event unaccounted for");
    Ok(())
}

async fn execute_ids(
    rec: &Reconciler<'_>,
    sql: &'static str,
    ids: &[i64],
) -> Result<(), sqlx::Error> {
    if ids.is_empty() {
        return Ok(());
    }
    rec.db
        .execute(rec.db.query(crate::schema::q(sql)).bind(ids))
        .await?;
    Ok(())
}

/// Keeps management API requests at least `interval` apart.
struct Pace {
    interval: Duration,
    last: Option<Instant>,
}

impl Pace {
    fn new(interval: Duration) -> Pace {
        Pace {
            interval,
            last: None,
        }
    }

    async fn wait(&mut self) {
        if let Some(last) = self.last {
            let due = last + self.interval;
            let now = Instant::now();
            if due > now {
                tokio::time::sleep(due - now).await;
            }
        }
        self.last = Some(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dlq_entry_becomes_the_failure_callback_body_qstash_would_have_sent() {
        let entry = json!({
            "messageId": "msg_1", "dlqId": "1725323658779-0", "url": "https://c/events/audit?contract=2",
            "method": "POST", "header": {"Content-Type": ["application/json"]}, "body": "{\"v\":1}",
            "maxRetries": 3, "responseStatus": 489, "responseHeader": {"X": ["y"]},
            "responseBodyBase64": "AAE=", "createdAt": 1, "notBefore": 2
        });
        let b = callback_body_from_dlq(&entry);
        assert_eq!(b["sourceMessageId"], "msg_1");
        assert_eq!(b["dlqId"], "1725323658779-0");
        assert_eq!(b["status"], 489);
        assert_eq!(b["retried"], 3, "without `retried`, maxRetries stands in");
        assert_eq!(b["sourceBody"], STANDARD.encode(b"{\"v\":1}"));
        assert_eq!(b["body"], "AAE=");
        assert_eq!(b["sourceHeader"]["Content-Type"][0], "application/json");
        assert!(b.get("topicName").is_none());
        let parsed = crate::callbacks::parse_callback(&serde_json::to_vec(&b).unwrap()).unwrap();
        assert!(parsed.problems.is_empty(), "{:?}", parsed.problems);
    }
}
