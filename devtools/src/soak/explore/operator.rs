//! The operator: runs the schedule's actions one at a time through the library calls the CLI makes
//! (`outbox::subscribers::{add, replay, replay_step, remove}`, `outbox::dead_letters::{redrive_matching, purge}`,
//! `outbox prune`'s own function, the relay's partition maintenance) — every second bulk redrive or purge through
//! the web console's pages instead (`console.rs`) — retries an action that failed because
//! Postgres was away, finishes what an older transaction held up (a replay whose end was not fixed, a removal
//! whose copies were not deleted) as an operator would by running the command again, and records each action
//! with what it selected.
//!
//! | Rule | Why |
//! |---|---|
//! | One action at a time | The before/after snapshots of an action's selection see only that action's changes (nothing else redrives, purges or deletes rows: the relays' own retention is long) |
//! | Before an action, the explorer reads what it must not touch (other subscribers' unfinished copies, pending and dead rows, dead letters outside the filter) with SQL of its own; after it, checks they are as they were | "No operator action touched a row outside its selection", judged without the library's filter code |
//! | A replay's must-deliver set is read before every call of it: the retained events written at or after `--from` | Replay reaches only retained events (an event pruned before the replay copied it is not owed) |
//! | A removal records the events with an unfinished copy for the subscriber just before it | What may still be applied after the removal: nothing else may |

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox::db::{Db, Statements};
use outbox::dead_letters::{self, Filter, PurgeError, RedriveError, RedriveOptions};
use outbox::subscribers::{self, Start, SubscriberError};
use sqlx::PgPool;

use super::console::{Bulk, ConsoleDriver};
use super::faults::Crasher;
use super::history::{History, Outcome, Period, Record, Removal, ReplayCover};
use super::schedule::{From, Op, ReplayMode, SUBSCRIBERS, Selection, TOPICS, label};

/// How long `add` and `remove` wait for older transactions (shorter than the longest long transaction, so both
/// ways happen).
pub const WAIT: Duration = Duration::from_secs(5);
/// Events copied per step of an interrupted replay.
const INTERRUPTED_CHUNK: i64 = 50;
/// How many times an action that failed for want of Postgres is tried again (a second apart).
const TRIES: u32 = 40;

/// Something to finish later, as the operator would run the command again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum FollowUp {
    /// The replay's end could not be fixed (older transactions): `subscribers replay`.
    Replay(usize, usize),
    /// The removal's copies were not deleted (older transactions): `subscribers remove` again.
    Remove(usize, usize),
    /// The addition could not finish the subscriber's earlier removal (older transactions) and recorded nothing:
    /// `subscribers add` again, with the same start.
    Add(usize, usize, Option<DateTime<Utc>>),
}

/// The operator's state.
pub struct Operator {
    pub db: PgPool,
    odb: Db,
    url: String,
    /// Base URL of each subscriber's consumer (index 0, the default one, unused).
    urls: Vec<String>,
    pub history: Arc<Mutex<History>>,
    next_n: Arc<AtomicU64>,
    follow_ups: BTreeSet<FollowUp>,
    /// Replays stopped on purpose, waiting for their resume.
    interrupted: BTreeSet<(usize, usize)>,
    /// Crashes Postgres in the middle of an action ([`Op::CrashDuring`]).
    crasher: Arc<Crasher>,
    /// A crash to cause after the first chunk of the next replay: (step, what, down).
    crash_mid_replay: Option<(usize, String, Duration)>,
    /// The console bulk actions go through, once one has ([`Operator::via_console`]).
    console: Option<ConsoleDriver>,
    /// Bulk actions drawn so far: every second one goes through the console.
    bulk_actions: u64,
}

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
    pub fn new(
        db: PgPool,
        url: String,
        urls: Vec<String>,
        history: Arc<Mutex<History>>,
        next_n: Arc<AtomicU64>,
        crasher: Arc<Crasher>,
    ) -> Operator {
        Operator {
            odb: Db::new(db.clone(), Statements::Prepared),
            db,
            url,
            urls,
            history,
            next_n,
            follow_ups: BTreeSet::new(),
            interrupted: BTreeSet::new(),
            crasher,
            crash_mid_replay: None,
            console: None,
            bulk_actions: 0,
        }
    }

    /// Whether this bulk action goes through the console (every second one, so that a seed decides it): the
    /// console started on first use. `Err`: it could not be started (Postgres away for the whole retry window).
    async fn via_console(&mut self) -> Result<bool, String> {
        self.bulk_actions += 1;
        if self.bulk_actions % 2 == 1 {
            return Ok(false);
        }
        if self.console.is_none() {
            let (url, history) = (self.url.clone(), self.history.clone());
            let driver = retry(|| ConsoleDriver::start(&url, history.clone()))
                .await
                .map_err(|e| format!("starting the console: {e:#}"))?;
            self.console = Some(driver);
        }
        Ok(true)
    }

    fn history(&self) -> std::sync::MutexGuard<'_, History> {
        self.history.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(
        &self,
        step: Option<usize>,
        what: String,
        kind: String,
        start: DateTime<Utc>,
        outcome: Outcome,
    ) {
        self.history().records.push(Record {
            step,
            what,
            kind,
            start,
            end: Utc::now(),
            outcome,
        });
    }

    /// Runs one action of the schedule.
    pub async fn run(&mut self, step: usize, op: &Op) {
        if let Op::CrashDuring {
            action,
            after_ms,
            down_secs,
        } = op
        {
            let what = format!("postgres crash {after_ms} ms into: {action}");
            let (after, down) = (
                Duration::from_millis((*after_ms).into()),
                Duration::from_secs_f64(*down_secs),
            );
            if matches!(**action, Op::Add { from, .. } if from != From::Now) {
                // A replay of a few hundred events takes a hundred milliseconds: the crash comes after its first
                // chunk, so that it lands in the middle of it.
                self.crash_mid_replay = Some((step, what, down));
            } else if !self.crasher.crash(step, what, after, down) {
                tracing::warn!("a crash is under way: the action runs without one");
            }
            Box::pin(self.run(step, action)).await;
            self.crash_mid_replay = None;
            return;
        }
        let start = Utc::now();
        let outcome = match op {
            Op::Add {
                topic,
                sub,
                from,
                replay,
            } => self.add(*topic, *sub, *from, *replay).await,
            Op::Remove { topic, sub } => self.remove(*topic, *sub).await,
            Op::Resume { topic, sub } => {
                self.interrupted.remove(&(*topic, *sub));
                self.follow_ups.remove(&FollowUp::Replay(*topic, *sub));
                self.replay(*topic, *sub, None).await
            }
            Op::Cure => self.cure().await,
            Op::Redrive(sel) => self.redrive(sel).await,
            Op::Purge {
                selection,
                handled_only,
            } => self.purge(selection, *handled_only).await,
            Op::Prune { retention_secs } => self.prune(*retention_secs, false).await,
            Op::Partitions { retention_secs } => self.prune(*retention_secs, true).await,
            _ => Outcome::Refused("not an operator action".into()),
        };
        self.record(Some(step), op.to_string(), op.kind(), start, outcome);
    }

    /// Tries what is left to finish once (the operator running the command again).
    pub async fn follow_up(&mut self) {
        for f in std::mem::take(&mut self.follow_ups) {
            let start = Utc::now();
            let (what, outcome) = match f {
                FollowUp::Replay(t, s) => (
                    format!(
                        "subscribers replay {} {} (again)",
                        TOPICS[t].name(),
                        label(s)
                    ),
                    self.replay(t, s, None).await,
                ),
                FollowUp::Remove(t, s) => (
                    format!(
                        "subscribers remove {} {} (again)",
                        TOPICS[t].name(),
                        label(s)
                    ),
                    self.finish_removal(t, s).await,
                ),
                FollowUp::Add(t, s, since) => (
                    format!(
                        "subscribers add {} {}{} (again)",
                        TOPICS[t].name(),
                        label(s),
                        since.map_or(String::new(), |at| format!(" --from {at}"))
                    ),
                    self.add_since(t, s, since, ReplayMode::Whole).await,
                ),
            };
            let kind = match f {
                FollowUp::Replay(..) => "replay (resume)",
                FollowUp::Remove(..) => "remove",
                FollowUp::Add(..) => "add (again)",
            };
            self.record(None, what, kind.into(), start, outcome);
        }
    }

    /// Finishes everything: interrupted replays resumed, held-up replays and removals run again, until none is
    /// left or `within` has passed; stops the console. Returns what is still unfinished.
    pub async fn finish(&mut self, within: Duration) -> Vec<String> {
        for (t, s) in std::mem::take(&mut self.interrupted) {
            self.follow_ups.insert(FollowUp::Replay(t, s));
        }
        let until = std::time::Instant::now() + within;
        while !self.follow_ups.is_empty() && std::time::Instant::now() < until {
            self.follow_up().await;
            if !self.follow_ups.is_empty() {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
        if let Some(console) = self.console.take()
            && let Err(e) = console.stop().await
        {
            tracing::warn!(error = %e, "stopping the console");
        }
        self.follow_ups.iter().map(|f| format!("{f:?}")).collect()
    }

    async fn add(&mut self, topic: usize, sub: usize, from: From, mode: ReplayMode) -> Outcome {
        // An operator adding a subscriber back does not run its earlier, unfinished removal again afterwards (that
        // would remove it anew): the addition finishes that removal first, or, when it cannot yet, records nothing
        // and is run again later ([`FollowUp::Add`]).
        self.follow_ups.remove(&FollowUp::Remove(topic, sub));
        let since = match from {
            From::Now => None,
            From::Back { secs } => Some(Utc::now() - chrono::Duration::seconds(secs.into())),
            From::BeforeRemoval { secs } => Some(
                self.history()
                    .last_removal(topic, sub)
                    .unwrap_or_else(Utc::now)
                    - chrono::Duration::seconds(secs.into()),
            ),
        };
        self.add_since(topic, sub, since, mode).await
    }

    /// [`Self::add`] from `since` (`None`: from now on).
    async fn add_since(
        &mut self,
        topic: usize,
        sub: usize,
        since: Option<DateTime<Utc>>,
        mode: ReplayMode,
    ) -> Outcome {
        let t = TOPICS[topic].name();
        let name = SUBSCRIBERS[sub];
        let start = match since {
            None => Start::Now,
            Some(at) => Start::Since(at),
        };
        let add_start = Utc::now();
        let me = &*self;
        let read_at = Utc::now();
        let retained = match since {
            Some(at) => match retry(|| me.retained(topic, at)).await {
                Ok(r) => Some(r),
                Err(e) => return Outcome::Failed(format!("reading the retained events: {e}")),
            },
            None => None,
        };
        let url = self.urls.get(sub).filter(|_| sub > 0).map(String::as_str);
        let mut tries = 0;
        // An operator told that the subscriber existed before reads what will and will not be replayed, and
        // confirms with --again.
        let mut again = false;
        let mut unfinished_removal = false;
        let (committed, fixed, mut outcome) = loop {
            let added = if again {
                subscribers::add_again(&self.odb, t, name, url, start, WAIT).await
            } else {
                subscribers::add(&self.odb, t, name, url, start, WAIT).await
            };
            match added {
                Ok(a) => {
                    let again = if again { " again (--again)" } else { "" };
                    break (
                        true,
                        true,
                        Outcome::Done(match a.to_replay {
                            Some(n) => format!("added{again}; {n} events to replay"),
                            None => format!("added{again}"),
                        }),
                    );
                }
                Err(SubscriberError::ReAdd { .. }) if !again => again = true,
                // An earlier try committed before its connection went (Postgres crashed under it, and the look
                // whether it had committed failed too): the subscriber is added; its replay is finished as after
                // any interrupted addition.
                Err(SubscriberError::Exists { .. }) if tries > 0 => {
                    break (
                        true,
                        false,
                        Outcome::Failed("database error after the add committed".into()),
                    );
                }
                Err(e @ SubscriberError::OldTransactions { .. }) => {
                    break (true, false, Outcome::Failed(e.to_string()));
                }
                // Nothing recorded: the operator runs the same command again later.
                Err(e @ SubscriberError::RemovalUnfinished { .. }) => {
                    unfinished_removal = true;
                    break (false, false, Outcome::Failed(e.to_string()));
                }
                Err(SubscriberError::Database(e)) if tries < TRIES => {
                    tries += 1;
                    // Did it commit before the connection went?
                    if let Ok(s) = subscribers::get(&self.odb, t, name).await
                        && s.removed_at.is_none()
                        && s.added_at.is_some_and(|a| a >= add_start)
                    {
                        break (
                            true,
                            false,
                            Outcome::Failed(format!("database error after the add committed: {e}")),
                        );
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(e @ SubscriberError::Database(_)) => {
                    break (false, false, Outcome::Failed(e.to_string()));
                }
                Err(e) => break (false, false, Outcome::Refused(e.to_string())),
            }
        };
        let add_end = Utc::now();
        if unfinished_removal {
            self.follow_ups.insert(FollowUp::Add(topic, sub, since));
        }
        if !committed {
            return outcome;
        }
        self.history().periods.push(Period {
            topic,
            sub,
            add_start: Some(add_start),
            add_end: Some(add_end),
            replay: match (since, retained) {
                (Some(since), Some(retained)) => Some(ReplayCover {
                    since,
                    retained,
                    read_at,
                    finished: false,
                }),
                _ => None,
            },
            removal: None,
        });
        if since.is_none() {
            return outcome;
        }
        if !fixed {
            self.follow_ups.insert(FollowUp::Replay(topic, sub));
            return outcome;
        }
        let replayed = match mode {
            ReplayMode::Whole => self.replay(topic, sub, None).await,
            ReplayMode::Interrupted { chunks } => {
                self.interrupted.insert((topic, sub));
                self.replay(topic, sub, Some(chunks)).await
            }
        };
        if let (Outcome::Done(a), Outcome::Done(b)) = (&outcome, &replayed) {
            outcome = Outcome::Done(format!("{a}; {b}"));
        } else if !matches!(replayed, Outcome::Done(_)) {
            outcome = replayed;
        }
        outcome
    }

    /// Runs a subscriber's replay: to the end (`subscribers replay`, which also fixes an end that an older
    /// transaction kept open), or only `chunks` small steps (interrupted). The must-deliver set is narrowed to
    /// what is still retained first.
    async fn replay(&mut self, topic: usize, sub: usize, chunks: Option<u32>) -> Outcome {
        let t = TOPICS[topic].name();
        let name = SUBSCRIBERS[sub];
        let since = self
            .history()
            .open_period(topic, sub)
            .and_then(|p| p.replay.as_ref().map(|r| r.since));
        let Some(since) = since else {
            return Outcome::Done("no replay under way".into());
        };
        let me = &*self;
        let read_at = Utc::now();
        match retry(|| me.retained(topic, since)).await {
            Ok(now) => {
                if let Some(r) = self
                    .history()
                    .open_period(topic, sub)
                    .and_then(|p| p.replay.as_mut())
                {
                    // An event that was not copied yet and is not retained any more (pruned) is not owed; one
                    // copied already is retained by its copy.
                    r.retained = now;
                    r.read_at = read_at;
                }
            }
            Err(e) => {
                self.follow_ups.insert(FollowUp::Replay(topic, sub));
                return Outcome::Failed(format!("reading the retained events: {e}"));
            }
        }
        if chunks.is_none()
            && let Some((step, what, down)) = self.crash_mid_replay.take()
        {
            let _ = subscribers::replay_step(&self.odb, t, name, INTERRUPTED_CHUNK).await;
            if self.crasher.crash(step, what, Duration::ZERO, down) {
                // Until Postgres is down: the rest of the replay meets the crash.
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
        let mut tries = 0;
        loop {
            let result = match chunks {
                None => subscribers::replay(&self.odb, t, name, WAIT, |_| {}).await,
                Some(n) => {
                    let mut last = None;
                    for _ in 0..n {
                        match subscribers::replay_step(&self.odb, t, name, INTERRUPTED_CHUNK).await
                        {
                            Ok(Some(p)) => {
                                let done = p.finished;
                                last = Some(p);
                                if done {
                                    break;
                                }
                            }
                            Ok(None) => break,
                            Err(e) => {
                                last = None;
                                tracing::warn!(error = %e, "replay step");
                                break;
                            }
                        }
                    }
                    Ok(last)
                }
            };
            match result {
                Ok(p) => {
                    let finished = p.is_some_and(|p| p.finished)
                        || matches!(subscribers::get(&self.odb, t, name).await,
                            Ok(s) if s.replay.as_ref().is_some_and(|r| r.done_at.is_some()));
                    if finished {
                        self.interrupted.remove(&(topic, sub));
                        if let Some(r) = self
                            .history()
                            .open_period(topic, sub)
                            .and_then(|p| p.replay.as_mut())
                        {
                            r.finished = true;
                        }
                    }
                    return Outcome::Done(match (p, finished) {
                        (Some(p), true) => format!("replay finished: {} copies", p.total),
                        (Some(p), false) => {
                            format!("replay interrupted at {} of {}", p.done_to, p.to)
                        }
                        (None, true) => "replay finished".into(),
                        (None, false) => "no replay step ran".into(),
                    });
                }
                Err(e) => {
                    if let Some(o) = self
                        .after(e, &mut tries, FollowUp::Replay(topic, sub))
                        .await
                    {
                        return o;
                    }
                }
            }
        }
    }

    async fn remove(&mut self, topic: usize, sub: usize) -> Outcome {
        let t = TOPICS[topic].name();
        let name = SUBSCRIBERS[sub];
        // An addition still to be run again is given up: the subscriber is to go.
        self.follow_ups
            .retain(|f| !matches!(f, FollowUp::Add(a, b, _) if (*a, *b) == (topic, sub)));
        let start = Utc::now();
        let db = &self.db;
        let snapshot = retry(|| async move {
            let in_flight: Vec<i64> = sqlx::query_scalar(
                "SELECT DISTINCT (payload->>'n')::bigint FROM outbox \
                 WHERE topic = $1 AND subscriber = $2 AND delivered_at IS NULL AND dead_lettered_at IS NULL",
            )
            .bind(t)
            .bind(name)
            .fetch_all(db)
            .await?;
            let others: Vec<i64> = sqlx::query_scalar(
                "SELECT id FROM outbox WHERE topic = $1 AND subscriber <> $2 \
                 AND delivered_at IS NULL AND dead_lettered_at IS NULL",
            )
            .bind(t)
            .bind(name)
            .fetch_all(db)
            .await?;
            Ok::<_, sqlx::Error>((in_flight, others))
        })
        .await;
        let (in_flight, others) = match snapshot {
            Ok(s) => s,
            Err(e) => return Outcome::Failed(format!("reading the copies in flight: {e}")),
        };
        let mut tries = 0;
        let outcome = loop {
            match subscribers::remove(&self.odb, t, name, WAIT).await {
                Ok(r) => {
                    break Outcome::Done(format!(
                        "{} copies and {} lanes deleted",
                        r.copies_deleted, r.keys_deleted
                    ));
                }
                Err(e) => match self
                    .after(e, &mut tries, FollowUp::Remove(topic, sub))
                    .await
                {
                    Some(o @ Outcome::Refused(_)) => return o,
                    Some(o) => break o,
                    None => {}
                },
            }
        };
        let done = matches!(outcome, Outcome::Done(_));
        if let Some(p) = self.history().open_period(topic, sub) {
            p.removal = Some(Removal {
                start,
                end: done.then(Utc::now),
                in_flight: in_flight.into_iter().map(|n| n as u64).collect(),
            });
        }
        if let Some(gone) = self.gone(&others).await
            && gone > 0
        {
            self.history().outside_selection.push(format!(
                "subscribers remove {t} {}: {gone} unfinished copies of other subscribers were deleted",
                label(sub),
            ));
        }
        outcome
    }

    /// What to do after a subscriber command's error: try again a second later (Postgres away, tries left:
    /// `None`), leave it to `follow` (an older transaction held it up, or Postgres stayed away: failed), or stop
    /// (refused).
    async fn after(
        &mut self,
        e: SubscriberError,
        tries: &mut u32,
        follow: FollowUp,
    ) -> Option<Outcome> {
        match e {
            SubscriberError::Database(_) if *tries < TRIES => {
                *tries += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
                None
            }
            e @ (SubscriberError::OldTransactions { .. } | SubscriberError::Database(_)) => {
                self.follow_ups.insert(follow);
                Some(Outcome::Failed(e.to_string()))
            }
            e => Some(Outcome::Refused(e.to_string())),
        }
    }

    async fn finish_removal(&mut self, topic: usize, sub: usize) -> Outcome {
        let t = TOPICS[topic].name();
        match subscribers::remove(&self.odb, t, SUBSCRIBERS[sub], WAIT).await {
            Ok(r) => {
                let now = Utc::now();
                let mut h = self.history();
                if let Some(r) = h
                    .periods
                    .iter_mut()
                    .rev()
                    .find(|p| p.topic == topic && p.sub == sub)
                    .and_then(|p| p.removal.as_mut())
                {
                    r.end.get_or_insert(now);
                }
                Outcome::Done(format!("{} copies deleted", r.copies_deleted))
            }
            Err(e @ (SubscriberError::OldTransactions { .. } | SubscriberError::Database(_))) => {
                self.follow_ups.insert(FollowUp::Remove(topic, sub));
                Outcome::Failed(e.to_string())
            }
            Err(e) => Outcome::Refused(e.to_string()),
        }
    }

    /// The events of `topic` written at or after `since` (by the producers' own clock) that some copy in the
    /// outbox still holds.
    async fn retained(
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

    async fn cure(&mut self) -> Outcome {
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
            topic: sel.topic.map(|t| TOPICS[t].name().to_owned()),
            subscriber: sel.subscriber.map(|s| SUBSCRIBERS[s].to_owned()),
            key: sel.key.map(|k| format!("k{k}")),
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

    async fn redrive(&mut self, sel: &Selection) -> Outcome {
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

    async fn purge(&mut self, sel: &Selection, handled_only: bool) -> Outcome {
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

    /// `outbox prune` (the command's own function) at a short outbox retention, or the partition maintenance
    /// alone with narrow partitions; then checks that no pending or dead row went.
    async fn prune(&mut self, retention_secs: u32, partitions_only: bool) -> Outcome {
        let keep: Vec<i64> = match retry(|| {
            sqlx::query_scalar(
                "SELECT id FROM outbox WHERE dispatched_at IS NULL OR dead_lettered_at IS NOT NULL",
            )
            .fetch_all(&self.db)
        })
        .await
        {
            Ok(k) => k,
            Err(e) => return Outcome::Failed(e.to_string()),
        };
        let retention = Duration::from_secs(retention_secs.into());
        let outcome = attempt(|| async {
            let r: anyhow::Result<String> = if partitions_only {
                let settings = outbox::relay::partitions::PartitionSettings {
                    min_rows: 200,
                    ..outbox::relay::partitions::PartitionSettings::new(
                        retention,
                        Duration::from_secs(10),
                    )
                };
                let rep = outbox::relay::partitions::maintain(&self.odb, settings).await;
                match rep.error {
                    Some(e) => Err(anyhow::anyhow!(e)),
                    None => Ok(format!(
                        "{} dropped, {} survivors moved, {} made, {} busy, {} held by a replay",
                        rep.dropped, rep.survivors_moved, rep.created, rep.busy, rep.held
                    )),
                }
            } else {
                let args = outbox_cli::prune::PruneArgs {
                    db: outbox_cli::util::DbArgs {
                        database_url: self.url.clone(),
                    },
                    outbox_hours: Some(f64::from(retention_secs) / 3600.0),
                    processed_hours: None,
                    dead_letters_days: 30.0,
                    batch: 1000,
                    json: false,
                };
                prune_command(args).await.map(|r| {
                    format!(
                        "{} partitions, {} rows pruned",
                        r.outbox_partitions, r.outbox
                    )
                })
            };
            r.map_err(|e| Failure::Transient(format!("{e:#}")))
        })
        .await;
        if let Some(gone) = self.gone(&keep).await
            && gone > 0
        {
            self.history().outside_selection.push(format!(
                "{}: {gone} pending or dead outbox rows were deleted",
                if partitions_only {
                    "partition maintenance"
                } else {
                    "prune"
                },
            ));
        }
        outcome
    }

    /// How many of the outbox rows `ids` are gone (`None`: Postgres did not answer).
    async fn gone(&self, ids: &[i64]) -> Option<i64> {
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

/// Why an action did not succeed: Postgres away (tried again), or refused.
pub(super) enum Failure {
    Transient(String),
    Refused(String),
}

/// Runs an action until it succeeds or is refused, trying again a second later while it fails for want of
/// Postgres (at most [`TRIES`] times).
async fn attempt<F, Fut>(mut f: F) -> Outcome
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<String, Failure>>,
{
    let mut tries = 0;
    loop {
        match f().await {
            Ok(done) => return Outcome::Done(done),
            Err(Failure::Transient(_)) if tries < TRIES => {
                tries += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(Failure::Transient(e)) => return Outcome::Failed(e),
            Err(Failure::Refused(e)) => return Outcome::Refused(e),
        }
    }
}

/// `outbox prune` itself, its output discarded. Its writer is not `Send`, so it runs on a runtime of its own.
async fn prune_command(
    args: outbox_cli::prune::PruneArgs,
) -> anyhow::Result<outbox_cli::prune::PruneReport> {
    tokio::task::spawn_blocking(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(outbox_cli::prune::run(args, &mut std::io::sink()))
    })
    .await?
}

/// Tries `f` until it succeeds, a second apart, at most [`TRIES`] times (Postgres may be restarting).
async fn retry<T, E, F, Fut>(mut f: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut tries = 0;
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if tries >= TRIES => return Err(e),
            Err(_) => {
                tries += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}
