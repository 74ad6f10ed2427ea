//! The schedules kept in the repository: seeds whose runs found a defect (they pass once it is fixed) or that
//! cover a combination on purpose. `devtools/tests/explore.rs` runs each and checks that each still draws what it
//! covers; `docs/reliability.md` has the table.

use std::time::Duration;

use super::schedule::{DevFault, From, Op, ReplayMode, Schedule};

/// A combination a kept schedule is kept for, checked on the drawn schedule ([`Covers::drawn_in`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Covers {
    /// A Postgres crash in the middle of an `add --from`: its wait or its replay.
    CrashDuringReplay,
    /// A Postgres crash after the traffic stopped, while the relays catch up.
    CrashDuringDrain,
    /// A Postgres crash in the middle of partition maintenance: its drop.
    CrashDuringPartitionDrop,
    /// A subscriber removed, then added again with `--from` before its removal.
    ReAddFromBeforeRemoval,
    /// A subscriber added (from now) while events flow.
    AddDuringTraffic,
    /// An `add --from` while a producer transaction that began before it is still open on its topic.
    LongTransactionOverReplay,
    /// A redrive while the dev server loses messages.
    RedriveWhileLosingMessages,
    /// An interrupted `add --from`, a prune or partition maintenance, then the replay resumed.
    PruneBeforeReplayResumed,
    /// A subscriber removed and added again within seconds, both while a producer transaction that began before
    /// the removal is still open (the removal stops at its wait; the addition must finish it first).
    ReAddWhileRemovalWaits,
}

/// The step's time in seconds.
fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

impl Covers {
    /// Whether schedule `s` draws this combination.
    pub fn drawn_in(self, s: &Schedule) -> bool {
        let steps = &s.steps;
        // The action itself, whether or not Postgres crashed in the middle of it.
        let action = |op: &Op| -> Op {
            match op {
                Op::CrashDuring { action, .. } => (**action).clone(),
                o => o.clone(),
            }
        };
        let crash_during = |is: &dyn Fn(&Op) -> bool| {
            steps
                .iter()
                .any(|c| matches!(&c.op, Op::CrashDuring { action, .. } if is(action)))
        };
        match self {
            Covers::CrashDuringReplay => {
                crash_during(&|a| matches!(a, Op::Add { from, .. } if *from != From::Now))
            }
            Covers::CrashDuringDrain => {
                let end_of_traffic = steps
                    .iter()
                    .filter(|t| matches!(t.op, Op::Traffic { rate, .. } if rate > 0.0))
                    .map(|t| secs(t.at))
                    .fold(0.0, f64::max);
                steps.iter().any(|c| {
                    matches!(c.op, Op::PgCrash { .. } | Op::CrashDuring { .. })
                        && secs(c.at) > end_of_traffic + 1.0
                        && steps.iter().any(|t| {
                            matches!(t.op, Op::Traffic { rate, .. } if rate == 0.0)
                                && secs(t.at) <= secs(c.at)
                                && secs(t.at) >= end_of_traffic
                        })
                })
            }
            Covers::CrashDuringPartitionDrop => crash_during(&|a| matches!(a, Op::Partitions { .. })),
            Covers::ReAddFromBeforeRemoval => steps.iter().any(|a| {
                matches!(action(&a.op), Op::Add { from: From::BeforeRemoval { .. }, .. })
            }),
            Covers::AddDuringTraffic => steps.iter().any(|a| {
                matches!(action(&a.op), Op::Add { from: From::Now, .. })
                    && steps
                        .iter()
                        .rev()
                        .find(|t| t.at <= a.at && matches!(t.op, Op::Traffic { .. }))
                        .is_some_and(|t| matches!(t.op, Op::Traffic { rate, .. } if rate >= 10.0))
            }),
            Covers::LongTransactionOverReplay => steps.iter().any(|l| match l.op {
                Op::LongTransaction { secs: len, topic } => steps.iter().any(|a| {
                    matches!(action(&a.op), Op::Add { topic: t, from, .. } if t == topic && from != From::Now)
                        && secs(a.at) > secs(l.at)
                        && secs(a.at) < secs(l.at) + len
                }),
                _ => false,
            }),
            Covers::PruneBeforeReplayResumed => steps.iter().any(|a| match action(&a.op) {
                Op::Add {
                    topic,
                    sub,
                    replay: ReplayMode::Interrupted { .. },
                    ..
                } => steps.iter().any(|r| {
                    r.at > a.at
                        && matches!(action(&r.op), Op::Resume { topic: t, sub: u } if t == topic && u == sub)
                        && steps.iter().any(|p| {
                            p.at > a.at
                                && p.at < r.at
                                && matches!(action(&p.op), Op::Prune { .. } | Op::Partitions { .. })
                        })
                }),
                _ => false,
            }),
            Covers::ReAddWhileRemovalWaits => steps.iter().any(|r| match action(&r.op) {
                Op::Remove { topic, sub } => steps.iter().any(|a| {
                    matches!(action(&a.op), Op::Add { topic: t, sub: u, .. } if (t, u) == (topic, sub))
                        && a.at > r.at
                        && secs(a.at) < secs(r.at) + 10.0
                        && steps.iter().any(|l| {
                            matches!(l.op, Op::LongTransaction { secs: len, .. }
                                if l.at < r.at && secs(l.at) + len > secs(a.at))
                        })
                }),
                _ => false,
            }),
            Covers::RedriveWhileLosingMessages => steps.iter().any(|d| match d.op {
                Op::Dev {
                    fault: DevFault::LoseMessages,
                    secs: len,
                } => steps.iter().any(|r| {
                    matches!(action(&r.op), Op::Redrive(_))
                        && secs(r.at) >= secs(d.at)
                        && secs(r.at) <= secs(d.at) + len
                }),
                _ => false,
            }),
        }
    }
}

/// A kept schedule: `outbox-dev soak --schedule random --seed {seed} --minutes {minutes}`.
#[derive(Debug, Clone, Copy)]
pub struct Kept {
    pub name: &'static str,
    pub seed: u64,
    pub minutes: f64,
    /// What it covers (checked against the drawn schedule by the tests).
    pub covers: &'static [Covers],
    /// What it found on the code it was first run on, if anything.
    pub found: Option<&'static str>,
}

/// The kept schedules.
pub const KEPT: &[Kept] = &[
    Kept {
        name: "replay_misses_a_long_producer_transaction",
        seed: 5,
        minutes: 1.5,
        covers: &[
            Covers::LongTransactionOverReplay,
            Covers::ReAddFromBeforeRemoval,
            Covers::AddDuringTraffic,
            Covers::RedriveWhileLosingMessages,
        ],
        found: Some(
            "issue 35 #5: two `add --from` did not wait for a producer transaction of another role, whose event \
             then reached neither subscriber; #4: copies of a subscriber just added dead-lettered \"no \
             destination\"; #1 (ordered): a re-added subscriber's replayed events refused as late (489), its lane \
             then stuck at a gap",
        ),
    },
    Kept {
        name: "re_added_subscriber_applies_twice",
        seed: 8,
        minutes: 1.5,
        covers: &[
            Covers::ReAddFromBeforeRemoval,
            Covers::AddDuringTraffic,
            Covers::CrashDuringReplay,
        ],
        found: Some(
            "issue 35 #1 with #4: a subscriber removed with a copy in flight and added again `--from` before the \
             removal; the replayed copy dead-lettered \"no destination\" by a relay's cache, redriven, applied a \
             second time",
        ),
    },
    Kept {
        name: "subscriber_added_during_traffic_dead_lettered",
        seed: 9,
        minutes: 1.5,
        covers: &[
            Covers::AddDuringTraffic,
            Covers::ReAddFromBeforeRemoval,
            Covers::LongTransactionOverReplay,
        ],
        found: Some(
            "issue 35 #4: a subscriber added again `--from` while the relays' subscriber cache was warm: its \
             replayed copies dead-lettered \"no destination\" (in two runs; the second also applied events twice)",
        ),
    },
    Kept {
        name: "replay_from_a_time_reaches_older_events",
        seed: 10,
        minutes: 1.5,
        covers: &[
            Covers::ReAddFromBeforeRemoval,
            Covers::RedriveWhileLosingMessages,
        ],
        found: Some(
            "`add --from <time>` replayed events written before that time: another subscriber's replayed copies \
             of them are newer (`created_at`), and the start is the lowest event id of any copy written since; \
             also #1 (applied twice after a re-add)",
        ),
    },
    Kept {
        name: "sweep_leaves_a_dead_letter_open",
        seed: 2,
        minutes: 1.0,
        covers: &[Covers::AddDuringTraffic],
        found: Some(
            "a copy dead-lettered \"no destination\" while its subscriber was being removed, then marked \
             delivered by the applied sweep (the consumer had applied it): its dead letter stays open",
        ),
    },
    Kept {
        name: "crashes_during_a_replay_a_drain_and_a_partition_drop",
        seed: 82,
        minutes: 1.0,
        covers: &[
            Covers::CrashDuringReplay,
            Covers::CrashDuringDrain,
            Covers::CrashDuringPartitionDrop,
            Covers::ReAddFromBeforeRemoval,
            Covers::LongTransactionOverReplay,
        ],
        found: Some(
            "issue 35 #1: events in flight at a removal applied twice after the re-add `--from`",
        ),
    },
    Kept {
        name: "replay_resumed_after_a_prune_waits_at_gaps",
        seed: 109,
        minutes: 3.0,
        covers: &[Covers::PruneBeforeReplayResumed],
        found: Some(
            "an `add --from` interrupted after its first chunk, a prune and partition maintenance, then `subscribers \
             replay` resumed it: events of its range pruned meanwhile are never copied, and the subscriber's \
             ordered lanes wait forever at the gaps (808 events pending, not drained); fixed since: retention \
             keeps what a replay under way has still to read",
        ),
    },
    Kept {
        name: "ordered_re_adds_refused_out_of_order",
        seed: 111,
        minutes: 3.0,
        covers: &[Covers::ReAddFromBeforeRemoval],
        found: Some(
            "an ordered subscriber removed and added again `--from` three times in 40 s, one replay unfinished at \
             its removal: four replayed copies refused \"out of order\" (489) by the consumer and dead-lettered; \
             fixed since: `add` finishes an unfinished removal of the same subscriber first",
        ),
    },
    Kept {
        name: "re_add_while_its_removal_waits_never_adds",
        seed: 113,
        minutes: 6.0,
        covers: &[
            Covers::ReAddWhileRemovalWaits,
            Covers::ReAddFromBeforeRemoval,
        ],
        found: Some(
            "a subscriber removed while a long producer transaction was open, then added back `--from` at once: \
             the addition had to finish the removal, could not (the same transaction), and failed with the error \
             that says \"the change is recorded\" though nothing was; the operator resumed a replay and the \
             subscriber was never added back (589 events lost to it, 30 \"no destination\" dead letters); fixed \
             since: such an addition says \"not added … nothing changed\" (RemovalUnfinished) and is run again. \
             Its next run found a key waiting forever at an event already delivered (evidence out of order after \
             a crash), fixed since too",
        ),
    },
];
