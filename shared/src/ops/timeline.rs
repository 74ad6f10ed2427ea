//! One event's whole life, for the operator console: its outbox row, its key, every dead letter of it, the
//! consumers' dedupe rows, the console actions taken on it — and, from their timestamps, a timeline. With fan-out
//! ([`crate::subscribers`]) an event has a copy (an outbox row) per subscriber: the row asked about is one copy,
//! and [`Timeline::copies`] lists every copy of its event with the copy's own state, lane and dead letter.
//!
//! What the database keeps is what can be shown: the outbox row records the *number* of publish attempts, the
//! current (or last) lease and the last error, not each attempt; every failure that ended an attempt round is a
//! dead letter with its own time, error and response. Every read is by primary key or an index on the event id.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgConnection;

use super::actions::{self, Action};
use crate::dead_letters::DeadLetter;
use crate::ids::DeadLetterId;
use crate::ids::{OutboxId, PartitionKey, TopicName};

/// The outbox row, every column.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct EventRow {
    pub id: OutboxId,
    pub topic: TopicName,
    pub partition_key: PartitionKey,
    /// The subscriber this row is the copy for (`''`: the default one; fan-out, [`crate::subscribers`]).
    pub subscriber: String,
    /// The event this row is a copy of (`None`: the row is the event's first copy; its id is the event's).
    pub event_id: Option<OutboxId>,
    /// Per-key sequence (ordered topics).
    pub seq: Option<i64>,
    pub payload: Value,
    pub headers: Value,
    pub created_at: DateTime<Utc>,
    /// Due from (a delay, backoff or the relay's lease).
    pub available_at: DateTime<Utc>,
    /// Accepted by QStash.
    pub dispatched_at: Option<DateTime<Utc>>,
    /// Delivery evidence.
    pub delivered_at: Option<DateTime<Utc>>,
    pub dead_lettered_at: Option<DateTime<Utc>>,
    /// Publish attempts of the current round.
    pub attempts: i32,
    /// The current (or last) lease's end.
    pub locked_until: Option<DateTime<Utc>>,
    pub lease_token: Option<i64>,
    pub last_error: Option<String>,
    /// The last message id QStash gave.
    pub qstash_message_id: Option<String>,
    pub redrive_count: i32,
    pub republish_count: i32,
    /// When the reconciler last found QStash still retrying it.
    pub reconciled_at: Option<DateTime<Utc>>,
}

impl EventRow {
    /// `pending`, `dispatched` (accepted by QStash, no outcome yet), `delivered` or `dead`, as
    /// [`crate::dead_letters::EventState::state`].
    pub fn state(&self) -> &'static str {
        crate::dead_letters::query::outbox_state(
            self.delivered_at,
            self.dead_lettered_at,
            self.dispatched_at,
        )
    }
}

/// One copy of the event: the outbox row of one subscriber, with its own state, lane and dead letter.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct EventCopy {
    /// The copy's outbox id.
    pub id: OutboxId,
    /// Its subscriber (`''`: the default one).
    pub subscriber: String,
    /// Per-key sequence (the event's; `None` after an out-of-order redrive or on an unordered topic).
    pub seq: Option<i64>,
    /// Publish attempts of the current round.
    pub attempts: i32,
    pub redrive_count: i32,
    pub dispatched_at: Option<DateTime<Utc>>,
    pub delivered_at: Option<DateTime<Utc>>,
    pub dead_lettered_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    /// Its lane (ordered topics, while the lane has work): done up to this sequence.
    pub lane_done_seq: Option<i64>,
    /// The event its lane waits on for delivery evidence.
    pub lane_inflight_id: Option<OutboxId>,
    /// The event that blocks its lane.
    pub lane_blocked_id: Option<OutboxId>,
    /// Its newest dead letter that needs an operator (neither redriven nor resolved).
    pub dead_letter_id: Option<i64>,
    /// When its subscriber's consumer applied the event (a dedupe row in the subscriber's namespace: its name, or
    /// for the default subscriber the namespaces asked about), if it did.
    pub applied_at: Option<DateTime<Utc>>,
}

impl EventCopy {
    /// `pending`, `dispatched`, `delivered` or `dead`, as [`EventRow::state`].
    pub fn state(&self) -> &'static str {
        crate::dead_letters::query::outbox_state(
            self.delivered_at,
            self.dead_lettered_at,
            self.dispatched_at,
        )
    }

    /// Its own dead head blocks its lane.
    pub fn blocks_its_lane(&self) -> bool {
        self.lane_blocked_id == Some(self.id)
    }
}

/// The relay's state of the event's ordered key.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct KeyPosition {
    /// Sequences up to this one are finished.
    pub done_seq: i64,
    /// The last sequence handed out.
    pub last_seq: Option<i64>,
    pub inflight_id: Option<OutboxId>,
    pub blocked_id: Option<OutboxId>,
    pub blocked_reason: Option<String>,
}

/// A consumer's dedupe row for the event: it applied it then.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct Applied {
    pub consumer: String,
    pub processed_at: DateTime<Utc>,
}

/// One thing that happened, with when.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Step {
    pub at: DateTime<Utc>,
    #[serde(flatten)]
    pub what: StepKind,
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StepKind {
    /// The producer committed it.
    Created,
    /// Due later than written (a delay or backoff), or after its lease: due from then on.
    Due { attempts: i32 },
    /// The relay's lease ends (or ended) then; `attempts` counted so far.
    LeaseEnds {
        attempts: i32,
        lease_token: Option<i64>,
    },
    /// Accepted by QStash.
    Dispatched { qstash_message_id: Option<String> },
    /// The reconciler found QStash still retrying it.
    Reconciled,
    /// Delivery evidence (callback, or the consumer's own word).
    Delivered,
    /// A consumer's dedupe row: applied.
    Applied { consumer: String },
    /// The outbox row was marked dead.
    DeadLettered { last_error: Option<String> },
    /// A dead letter was recorded.
    DeadLetterRecorded {
        dead_letter_id: DeadLetterId,
        source: String,
        error: String,
        status: Option<i32>,
    },
    /// That dead letter was redriven.
    Redriven { dead_letter_id: DeadLetterId },
    /// That dead letter turned out done after all.
    Resolved {
        dead_letter_id: DeadLetterId,
        resolution: Option<String>,
    },
    /// An action taken through the console.
    ConsoleAction {
        action_id: i64,
        actor: String,
        action: String,
        /// It reported its outcome (false: under way, or it stopped without reporting back).
        finished: bool,
    },
}

/// Everything about one event.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Timeline {
    pub outbox_id: OutboxId,
    /// The event the row is a copy of (its first copy's id; the row's own id without fan-out).
    pub event_id: OutboxId,
    /// Every copy of that event still in the outbox, by subscriber (more than one per subscriber when copies were
    /// made again, by a replay after a re-add, say).
    pub copies: Vec<EventCopy>,
    /// When it was read (database clock).
    pub now: DateTime<Utc>,
    /// `None`: the row is gone (pruned); what its dead letters kept is still shown.
    pub event: Option<EventRow>,
    /// Its ordered key, while the key has work.
    pub key: Option<KeyPosition>,
    /// Its dead letters, oldest first.
    pub dead_letters: Vec<DeadLetter>,
    /// The consumers (of those asked about) that applied it.
    pub applied: Vec<Applied>,
    pub actions: Vec<Action>,
    /// All of the above in time order (for equal times, in the order things happen).
    pub steps: Vec<Step>,
}

/// Reads everything about `outbox_id` (`consumers`: the dedupe namespaces, `CONSUMER_NAME`, to look in; a named
/// subscriber's copy is also looked up under its subscriber's name); `None` when neither the row nor any dead
/// letter of it exists.
pub async fn timeline(
    conn: &mut PgConnection,
    outbox_id: OutboxId,
    consumers: &[String],
) -> Result<Option<Timeline>, sqlx::Error> {
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *conn)
        .await?;
    let event = event_row(conn, outbox_id).await?;
    let dead_letters = dead_letters_of(conn, outbox_id).await?;
    if event.is_none() && dead_letters.is_empty() {
        return Ok(None);
    }
    let key = match &event {
        Some(e) if e.seq.is_some() => key_position(conn, e).await?,
        _ => None,
    };
    let namespaces = namespaces(consumers, event.as_ref());
    let applied = applied(conn, outbox_id, &namespaces).await?;
    let event_id = event.as_ref().and_then(|e| e.event_id).unwrap_or(outbox_id);
    let topic = match (&event, dead_letters.iter().find_map(|d| d.topic.as_ref())) {
        (Some(e), _) => Some(&e.topic),
        (None, t) => t,
    };
    let copies = match topic {
        Some(topic) => copies(conn, topic, event_id, consumers).await?,
        None => Vec::new(),
    };
    let actions = actions::for_event(conn, outbox_id).await?;
    let steps = steps(event.as_ref(), &dead_letters, &applied, &actions);
    Ok(Some(Timeline {
        outbox_id,
        event_id,
        copies,
        now,
        event,
        key,
        dead_letters,
        applied,
        actions,
        steps,
    }))
}

/// The outbox row, every column; `None` when it is gone.
async fn event_row(
    conn: &mut PgConnection,
    outbox_id: OutboxId,
) -> Result<Option<EventRow>, sqlx::Error> {
    sqlx::query_as(crate::schema::q(
        "SELECT id, topic, partition_key, subscriber, event_id, seq, payload, headers, created_at, available_at, dispatched_at, \
                delivered_at, dead_lettered_at, attempts, locked_until, lease_token, last_error, qstash_message_id, \
                redrive_count, republish_count, reconciled_at \
         FROM {schema}.outbox WHERE id = $1",
    ))
    .bind(outbox_id)
    .fetch_optional(&mut *conn)
    .await
}

/// The event's dead letters (the first 100), oldest first.
async fn dead_letters_of(
    conn: &mut PgConnection,
    outbox_id: OutboxId,
) -> Result<Vec<DeadLetter>, sqlx::Error> {
    let dead_ids: Vec<DeadLetterId> = sqlx::query_scalar(crate::schema::q(
        "SELECT id FROM {schema}.dead_letters WHERE outbox_id = $1 ORDER BY id LIMIT 100",
    ))
    .bind(outbox_id)
    .fetch_all(&mut *conn)
    .await?;
    let mut dead_letters = Vec::with_capacity(dead_ids.len());
    for id in dead_ids {
        if let Some(d) = crate::dead_letters::get(conn, id).await? {
            dead_letters.push(d);
        }
    }
    Ok(dead_letters)
}

/// The relay's state of the ordered event's lane, while it has work.
async fn key_position(
    conn: &mut PgConnection,
    e: &EventRow,
) -> Result<Option<KeyPosition>, sqlx::Error> {
    sqlx::query_as(crate::schema::q(
        "SELECT k.done_seq, s.last_seq, k.inflight_id, k.blocked_id, k.blocked_reason \
                 FROM {schema}.outbox_keys k LEFT JOIN {schema}.outbox_sequences s \
                   ON s.topic = k.topic AND s.partition_key = k.partition_key \
                 WHERE k.topic = $1 AND k.partition_key = $2 AND k.subscriber = $3",
    ))
    .bind(&e.topic)
    .bind(&e.partition_key)
    .bind(&e.subscriber)
    .fetch_optional(&mut *conn)
    .await
}

/// The dedupe namespaces to look in: `consumers`, and a named subscriber's copy's subscriber.
fn namespaces(consumers: &[String], event: Option<&EventRow>) -> Vec<String> {
    let mut namespaces = consumers.to_vec();
    if let Some(e) = event.filter(|e| !e.subscriber.is_empty())
        && !namespaces.contains(&e.subscriber)
    {
        namespaces.push(e.subscriber.clone());
    }
    namespaces
}

/// The dedupe rows in `namespaces` of the row or of its event: who applied it, and when.
async fn applied(
    conn: &mut PgConnection,
    outbox_id: OutboxId,
    namespaces: &[String],
) -> Result<Vec<Applied>, sqlx::Error> {
    sqlx::query_as(crate::schema::q(
        "SELECT consumer, processed_at FROM {schema}.processed_messages \
         WHERE consumer = ANY ($1) \
           AND message_id IN ($2, (SELECT coalesce(event_id, id)::text FROM {schema}.outbox WHERE id = $3)) \
         ORDER BY processed_at",
    ))
    .bind(namespaces)
    .bind(outbox_id.to_string())
    .bind(outbox_id)
    .fetch_all(&mut *conn)
    .await
}

/// Every copy of `event_id` of `topic` (on `outbox_event_idx`), with its lane, its newest unhandled dead letter
/// and whether its subscriber applied it: a dedupe row keyed by the copy's id or the event's id, in the
/// subscriber's namespace (a named subscriber's name; for the default subscriber, `consumers`).
async fn copies(
    conn: &mut PgConnection,
    topic: &TopicName,
    event_id: OutboxId,
    consumers: &[String],
) -> Result<Vec<EventCopy>, sqlx::Error> {
    sqlx::query_as(crate::schema::q(
        "SELECT o.id, o.subscriber, o.seq, o.attempts, o.redrive_count, o.dispatched_at, o.delivered_at, \
                o.dead_lettered_at, o.last_error, k.done_seq AS lane_done_seq, k.inflight_id AS lane_inflight_id, \
                k.blocked_id AS lane_blocked_id, \
                (SELECT max(d.id) FROM {schema}.dead_letters d WHERE d.outbox_id = o.id \
                   AND d.redriven_at IS NULL AND d.resolved_at IS NULL) AS dead_letter_id, \
                (SELECT min(p.processed_at) FROM {schema}.processed_messages p \
                  WHERE p.consumer = ANY (CASE WHEN o.subscriber = '' THEN $3::text[] ELSE ARRAY[o.subscriber] END) \
                    AND p.message_id IN (o.id::text, $2::text)) AS applied_at \
         FROM {schema}.outbox o \
         LEFT JOIN {schema}.outbox_keys k ON o.seq IS NOT NULL AND k.topic = o.topic \
              AND k.partition_key = o.partition_key AND k.subscriber = o.subscriber \
         WHERE o.topic = $1 AND coalesce(o.event_id, o.id) = $2 ORDER BY o.subscriber, o.id LIMIT 1000",
    ))
    .bind(topic)
    .bind(event_id)
    .bind(consumers)
    .fetch_all(&mut *conn)
    .await
}

/// The timeline: every timestamp the rows hold, as steps in time order.
fn steps(
    event: Option<&EventRow>,
    dead_letters: &[DeadLetter],
    applied: &[Applied],
    actions: &[Action],
) -> Vec<Step> {
    let mut steps = Vec::new();
    if let Some(e) = event {
        event_steps(e, &mut steps);
    }
    steps.extend(applied.iter().map(applied_step));
    for d in dead_letters {
        dead_letter_steps(d, &mut steps);
    }
    steps.extend(actions.iter().map(action_step));
    // Stable: for equal times the order above (the order things happen) stays.
    steps.sort_by_key(|s| s.at);
    steps
}

/// The outbox row's steps, in the order things happen: created, due, lease, dispatched, reconciled, delivered, dead.
fn event_steps(e: &EventRow, steps: &mut Vec<Step>) {
    let mut push = |at: DateTime<Utc>, what: StepKind| steps.push(Step { at, what });
    push(e.created_at, StepKind::Created);
    if e.available_at > e.created_at && e.dispatched_at.is_none() && e.dead_lettered_at.is_none() {
        push(
            e.available_at,
            StepKind::Due {
                attempts: e.attempts,
            },
        );
    }
    if let Some(t) = e.locked_until {
        push(
            t,
            StepKind::LeaseEnds {
                attempts: e.attempts,
                lease_token: e.lease_token,
            },
        );
    }
    if let Some(t) = e.dispatched_at {
        push(
            t,
            StepKind::Dispatched {
                qstash_message_id: e.qstash_message_id.clone(),
            },
        );
    }
    if let Some(t) = e.reconciled_at {
        push(t, StepKind::Reconciled);
    }
    if let Some(t) = e.delivered_at {
        push(t, StepKind::Delivered);
    }
    if let Some(t) = e.dead_lettered_at {
        push(
            t,
            StepKind::DeadLettered {
                last_error: e.last_error.clone(),
            },
        );
    }
}

/// A consumer's dedupe row as a step.
fn applied_step(a: &Applied) -> Step {
    Step {
        at: a.processed_at,
        what: StepKind::Applied {
            consumer: a.consumer.clone(),
        },
    }
}

/// A dead letter's steps: recorded, then redriven or resolved.
fn dead_letter_steps(d: &DeadLetter, steps: &mut Vec<Step>) {
    let mut push = |at: DateTime<Utc>, what: StepKind| steps.push(Step { at, what });
    push(
        d.created_at,
        StepKind::DeadLetterRecorded {
            dead_letter_id: d.id,
            source: d.source.clone(),
            error: d.error.clone(),
            status: d.status,
        },
    );
    if let Some(t) = d.redriven_at {
        push(
            t,
            StepKind::Redriven {
                dead_letter_id: d.id,
            },
        );
    }
    if let Some(t) = d.resolved_at {
        push(
            t,
            StepKind::Resolved {
                dead_letter_id: d.id,
                resolution: d.resolution.clone(),
            },
        );
    }
}

/// A console action as a step.
fn action_step(a: &Action) -> Step {
    Step {
        at: a.at,
        what: StepKind::ConsoleAction {
            action_id: a.id,
            actor: a.actor.clone(),
            action: a.action.clone(),
            finished: a.finished_at.is_some(),
        },
    }
}
