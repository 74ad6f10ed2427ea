//! The settle's input: what to record for each claimed event of a cycle ([`Settlement`]), from the claim's
//! [`Triage`] and what publishing found ([`Published`]). Pure: no I/O (the backoff draws from the thread's
//! random generator).
//!
//! | event | settlement | why |
//! |---|---|---|
//! | accepted by QStash | dispatched, with QStash's message id | the key (ordered) now waits for its delivery evidence |
//! | refused by QStash (permanent) | dead letter | retrying will not help |
//! | transient failure, budget left | retry after full-jitter backoff ([`super::backoff`]) | QStash's hint (`Retry-After`) wins, capped |
//! | transient failure on the last attempt | dead letter | the retry budget (`RELAY_MAX_ATTEMPTS`) is spent |
//! | its request failed at request level, or it was not sent | released, attempt unspent | the outcome says nothing about the event (decision record 0012) |
//! | follower in an ordered run's message | its head's settlement; a dead head's followers are released | the run shares its head's fate; only the head is the key's dead head |
//! | exhausted at claim ([`Triage::exhausted`]) | dead letter, without a publish | the relay stopped mid-attempt until the budget was gone |
//! | held back ([`Triage::held_back`]) | released | it must not overtake its dead head |
//!
//! A dead letter of an ordered topic blocks its key, or skips it on a topic in `RELAY_SKIP_DEAD_HEAD_TOPICS`.

use crate::config::{DeadHeadPolicy, RelayConfig};
use crate::qstash::PublishOutcome;

use super::backoff::Backoff;
use super::claim::ClaimedEvent;
use super::published::Published;
use super::settle::{SettleItem, Settlement};
use super::triage::Triage;

/// The settings a decision reads.
#[derive(Clone, Copy)]
pub(super) struct Decider<'a> {
    pub(super) cfg: &'a RelayConfig,
    pub(super) backoff: Backoff,
}

impl Decider<'_> {
    fn max_attempts(&self) -> i32 {
        self.cfg.max_attempts as i32
    }

    fn skip_key(&self, ev: &ClaimedEvent) -> bool {
        self.cfg.dead_head_policy(&ev.topic) == DeadHeadPolicy::Skip
    }

    /// What to record for each published event from its outcome alone (the first four rows of the module
    /// docs' table).
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // `internals::RelaySteps`
    pub(super) fn decide(
        &self,
        events: &[ClaimedEvent],
        outcomes: &[PublishOutcome],
    ) -> Vec<SettleItem> {
        let events: Vec<&ClaimedEvent> = events.iter().collect();
        self.decide_refs(&events, outcomes)
    }

    /// [`Decider::decide`] over borrowed events.
    fn decide_refs(
        &self,
        events: &[&ClaimedEvent],
        outcomes: &[PublishOutcome],
    ) -> Vec<SettleItem> {
        let mut rng = rand::rng();
        let max = self.max_attempts();
        events
            .iter()
            .zip(outcomes)
            .map(|(ev, outcome)| {
                let settlement = match outcome {
                    PublishOutcome::Accepted { message_id, .. } => Settlement::Dispatched {
                        message_id: message_id.clone(),
                    },
                    PublishOutcome::Permanent { status, error } => Settlement::Dead {
                        error: format!("QStash refused the message (HTTP {status}): {error}"),
                        status: Some(*status),
                        skip_key: self.skip_key(ev),
                    },
                    PublishOutcome::Transient { error, status, .. } if ev.attempts >= max => {
                        Settlement::Dead {
                            error: format!(
                                "retry budget of {max} attempts exhausted; last error: {error}"
                            ),
                            status: *status,
                            skip_key: self.skip_key(ev),
                        }
                    }
                    PublishOutcome::Transient {
                        error, retry_after, ..
                    } => Settlement::Retry {
                        delay: self.backoff.next_delay(
                            ev.attempts.max(0) as u32,
                            *retry_after,
                            &mut rng,
                        ),
                        error: format!("attempt {}: {error}", ev.attempts),
                    },
                };
                SettleItem {
                    id: ev.id,
                    lease_token: ev.lease_token,
                    settlement,
                }
            })
            .collect()
    }

    /// Every claimed event's settlement (the whole table), in [`Triage::in_settle_order`].
    #[cfg(test)]
    pub(super) fn settle_inputs(&self, triage: &Triage, published: &Published) -> Vec<SettleItem> {
        let all: Vec<usize> = (0..triage.publish.len()).collect();
        let mut items = self.settle_published(&triage.publish, published, &all);
        items.extend(self.settle_unpublished(triage));
        items
    }

    /// The settlements of the published events `which` (indexes into `events`, whole messages: a message's
    /// followers are decided with their head), in the order of `which`: the first five rows of the module docs'
    /// table.
    pub(super) fn settle_published(
        &self,
        events: &[ClaimedEvent],
        published: &Published,
        which: &[usize],
    ) -> Vec<SettleItem> {
        let chosen: Vec<&ClaimedEvent> = which.iter().map(|&i| &events[i]).collect();
        let outcomes: Vec<PublishOutcome> = which
            .iter()
            .map(|&i| published.events[i].outcome.clone())
            .collect();
        let mut items = self.decide_refs(&chosen, &outcomes);
        // Where each event of `which` is in `items`.
        let mut at: std::collections::HashMap<usize, usize> =
            std::collections::HashMap::with_capacity(which.len());
        for (pos, &i) in which.iter().enumerate() {
            at.insert(i, pos);
            if published.events[i].given_back() {
                items[pos].settlement = Settlement::Release;
            }
        }
        for members in &published.messages {
            if members.len() < 2 || events[members[0]].seq.is_none() {
                continue;
            }
            let Some(&head) = at.get(&members[0]) else {
                continue;
            };
            let follow = match &items[head].settlement {
                Settlement::Dead { .. } => Settlement::Release,
                other => other.clone(),
            };
            for i in &members[1..] {
                if let Some(&pos) = at.get(i) {
                    items[pos].settlement = follow.clone();
                }
            }
        }
        items
    }

    /// The settlements of the events not published this cycle: exhausted (dead letters), then held back
    /// (released), in [`Triage::in_settle_order`].
    pub(super) fn settle_unpublished(&self, triage: &Triage) -> Vec<SettleItem> {
        let mut items: Vec<SettleItem> = triage
            .exhausted
            .iter()
            .map(|ev| self.exhausted(ev))
            .collect();
        items.extend(triage.held_back.iter().map(|ev| SettleItem {
            id: ev.id,
            lease_token: ev.lease_token,
            settlement: Settlement::Release,
        }));
        items.extend(self.orphaned(&triage.orphans));
        items
    }

    /// Copies for a subscriber that is not live: an unordered one, or the head of a lane's run, is a dead letter
    /// saying so (redrive it once the subscriber is back); the rest of the run is given back behind its head.
    fn orphaned(&self, orphans: &[ClaimedEvent]) -> Vec<SettleItem> {
        let mut heads: std::collections::HashMap<crate::ids::KeyLease, i64> =
            std::collections::HashMap::new();
        for ev in orphans {
            if let (Some(lease), Some(seq)) = (ev.key_lease(), ev.seq) {
                let h = heads.entry(lease).or_insert(seq);
                *h = (*h).min(seq);
            }
        }
        orphans
            .iter()
            .map(|ev| {
                let head = match (ev.key_lease(), ev.seq) {
                    (Some(lease), Some(seq)) => heads.get(&lease) == Some(&seq),
                    _ => true,
                };
                let settlement = if head {
                    Settlement::Dead {
                        error: format!(
                            "no destination: subscriber {:?} of topic {} is not configured (removed, or never \
                             added with `outbox subscribers add`); add it and redrive this dead letter",
                            crate::subscribers::label(&ev.subscriber),
                            ev.topic
                        ),
                        status: None,
                        skip_key: self.skip_key(ev),
                    }
                } else {
                    Settlement::Release
                };
                SettleItem {
                    id: ev.id,
                    lease_token: ev.lease_token,
                    settlement,
                }
            })
            .collect()
    }

    /// The dead letter of an event whose budget was spent by claims that never settled.
    fn exhausted(&self, ev: &ClaimedEvent) -> SettleItem {
        SettleItem {
            id: ev.id,
            lease_token: ev.lease_token,
            settlement: Settlement::Dead {
                error: format!(
                    "retry budget of {} attempts exhausted (attempt {} was claimed but never settled: the relay \
                     stopped mid-attempt); last error: {}",
                    self.max_attempts(),
                    ev.attempts - 1,
                    ev.last_error.as_deref().unwrap_or("none")
                ),
                status: None,
                skip_key: self.skip_key(ev),
            },
        }
    }
}

/// Logs each dead letter of `items` with its event (`events`, in the same order).
pub(super) fn log_dead_letters<'a>(
    items: &[SettleItem],
    events: impl IntoIterator<Item = &'a ClaimedEvent>,
) {
    for (item, ev) in items.iter().zip(events) {
        if let Settlement::Dead { error, .. } = &item.settlement {
            tracing::warn!(outbox_id = ev.id.get(), topic = %ev.topic, key = %ev.partition_key, attempt = ev.attempts,
                error = %error, "dead-lettering event");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use super::*;
    use crate::config::Vars;
    use crate::relay::published::{PublishedEvent, Reach};

    fn config() -> RelayConfig {
        let env: HashMap<&'static str, &'static str> = [
            ("RELAY_MAX_ATTEMPTS", "3"),
            ("RELAY_SKIP_DEAD_HEAD_TOPICS", "skipped"),
        ]
        .into_iter()
        .collect();
        RelayConfig::from_vars(&Vars::new(&env), 5).expect("relay settings")
    }

    fn decider(cfg: &RelayConfig) -> Decider<'_> {
        Decider {
            cfg,
            backoff: Backoff {
                base: Duration::from_secs(30),
                cap: Duration::from_secs(3600),
            },
        }
    }

    fn event(id: i64, topic: &str, seq: Option<i64>, attempts: i32) -> ClaimedEvent {
        ClaimedEvent {
            attempts,
            last_error: Some("boom".into()),
            ..ClaimedEvent::for_test(id, topic, "k", seq, 9)
        }
    }

    fn accepted(id: &str) -> PublishOutcome {
        PublishOutcome::Accepted {
            message_id: id.into(),
            deduplicated: false,
        }
    }

    fn refused() -> PublishOutcome {
        PublishOutcome::Permanent {
            status: 400,
            error: "bad".into(),
        }
    }

    fn transient() -> PublishOutcome {
        PublishOutcome::Transient {
            status: Some(500),
            retry_after: None,
            error: "later".into(),
            config_problem: false,
        }
    }

    fn result(outcome: PublishOutcome, reach: Reach) -> PublishedEvent {
        PublishedEvent { outcome, reach }
    }

    fn kinds(items: &[SettleItem]) -> Vec<(i64, &'static str)> {
        items
            .iter()
            .map(|i| {
                let kind = match &i.settlement {
                    Settlement::Dispatched { .. } => "dispatched",
                    Settlement::Retry { .. } => "retry",
                    Settlement::Dead { .. } => "dead",
                    Settlement::Release => "release",
                };
                (i.id.get(), kind)
            })
            .collect()
    }

    #[test]
    fn outcomes_become_settlements_within_the_budget() {
        let cfg = config();
        let events = vec![
            event(1, "t", None, 1),
            event(2, "t", None, 1),
            event(3, "t", None, 2),
            event(4, "t", None, 3),
            event(5, "skipped", Some(1), 1),
        ];
        let items = decider(&cfg).decide(
            &events,
            &[
                accepted("m1"),
                refused(),
                transient(),
                transient(),
                refused(),
            ],
        );
        assert_eq!(
            kinds(&items),
            vec![
                (1, "dispatched"),
                (2, "dead"),
                (3, "retry"),
                (4, "dead"),
                (5, "dead")
            ]
        );
        assert_eq!(
            items[0].settlement,
            Settlement::Dispatched {
                message_id: "m1".into()
            }
        );
        let Settlement::Retry { delay, error } = &items[2].settlement else {
            panic!("a retry: {:?}", items[2].settlement);
        };
        // Attempt 2: the window is min(3600, 30 · 2²) = 120 s, floored at 1 s.
        assert!(*delay >= Duration::from_secs(1) && *delay <= Duration::from_secs(120));
        assert_eq!(error, "attempt 2: later");
        let Settlement::Dead {
            error, skip_key, ..
        } = &items[3].settlement
        else {
            panic!("a dead letter: {:?}", items[3].settlement);
        };
        assert!(
            error.starts_with("retry budget of 3 attempts exhausted"),
            "{error}"
        );
        assert!(!skip_key);
        assert!(matches!(
            items[4].settlement,
            Settlement::Dead { skip_key: true, .. }
        ));
    }

    #[test]
    fn runs_follow_their_head_and_what_says_nothing_is_given_back() {
        let cfg = config();
        let triage = Triage {
            publish: vec![
                // A run of three accepted as one message.
                event(1, "o", Some(1), 1),
                event(2, "o", Some(2), 1),
                event(3, "o", Some(3), 1),
                // A run whose head QStash refused: the head dies, its follower goes back.
                event(4, "p", Some(1), 1),
                event(5, "p", Some(2), 1),
                // Its request failed at request level; not sent at all.
                event(6, "t", None, 1),
                event(7, "q", Some(4), 1),
            ],
            exhausted: vec![event(8, "t", None, 4)],
            held_back: vec![event(9, "r", Some(2), 1)],
            ordered_runs: 4,
            orphans: Vec::new(),
        };
        let published = Published {
            events: vec![
                result(accepted("m1"), Reach::Answered),
                result(accepted("m1"), Reach::Answered),
                result(accepted("m1"), Reach::Answered),
                result(refused(), Reach::Answered),
                result(refused(), Reach::Answered),
                result(transient(), Reach::RequestFailed),
                result(transient(), Reach::NotSent),
            ],
            messages: vec![vec![0, 1, 2], vec![3, 4], vec![5]],
            ..Published::default()
        };
        let items = decider(&cfg).settle_inputs(&triage, &published);
        assert_eq!(
            kinds(&items),
            vec![
                (1, "dispatched"),
                (2, "dispatched"),
                (3, "dispatched"),
                (4, "dead"),
                (5, "release"),
                (6, "release"),
                (7, "release"),
                (8, "dead"),
                (9, "release")
            ]
        );
        let Settlement::Dead { error, status, .. } = &items[7].settlement else {
            panic!("a dead letter: {:?}", items[7].settlement);
        };
        assert_eq!(*status, None);
        assert!(
            error.contains("attempt 3 was claimed but never settled") && error.ends_with("boom"),
            "{error}"
        );
    }
}
