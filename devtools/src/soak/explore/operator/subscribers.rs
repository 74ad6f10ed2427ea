//! The subscriber actions, as `outbox subscribers add`, `replay` and `remove` run them: an addition (with or
//! without `--from`, confirmed with `--again` when the subscriber existed before), its replay to the end or
//! interrupted after a few chunks, a removal with the copies it found in flight; each recorded as a subscription
//! period, and left to a follow-up when an older transaction or Postgres held it up.

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox::subscribers::{self, Start, SubscriberError};

use super::state::{FollowUp, Operator};
use crate::soak::explore::history::{Outcome, Period, Removal, ReplayCover};
use crate::soak::explore::retry::{TRIES, retry};
use crate::soak::explore::schedule::{From, ReplayMode, SUBSCRIBERS, TOPICS, label};

/// How long `add` and `remove` wait for older transactions (shorter than the longest long transaction, so both
/// ways happen).
pub const WAIT: Duration = Duration::from_secs(5);
/// Events copied per step of an interrupted replay.
const INTERRUPTED_CHUNK: i64 = 50;

impl Operator {
    pub(super) async fn add(
        &mut self,
        topic: usize,
        sub: usize,
        from: From,
        mode: ReplayMode,
    ) -> Outcome {
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
    pub(super) async fn add_since(
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
    pub(super) async fn replay(
        &mut self,
        topic: usize,
        sub: usize,
        chunks: Option<u32>,
    ) -> Outcome {
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

    pub(super) async fn remove(&mut self, topic: usize, sub: usize) -> Outcome {
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
    pub(super) async fn after(
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

    pub(super) async fn finish_removal(&mut self, topic: usize, sub: usize) -> Outcome {
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
}
