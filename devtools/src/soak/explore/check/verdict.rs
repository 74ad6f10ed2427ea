//! The verdict ([`check`]): every rule of the checker (the table of [`super`]) applied to the history against the
//! world, each broken one a [`Violation`], with the figures counted on the way.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::names::{one_line, sub_index, topic_index};
use super::owed::{Owed, owed, refused_in_order};
use super::world::{Applied, CopyRow, DeadRow, World};
use crate::soak::explore::history::{History, Period, Written};
use crate::soak::explore::schedule::{SUBSCRIBERS, TOPICS};

/// A broken guarantee.
#[derive(Debug, Clone, Serialize)]
pub struct Violation {
    pub kind: &'static str,
    /// The event's number, when it is about one event.
    pub n: Option<u64>,
    /// The subscriber (index), when it is about one.
    pub sub: Option<usize>,
    pub detail: String,
}

/// What the checker counted.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Figures {
    /// Events that exist (committed).
    pub events: u64,
    /// Producer transactions whose commit answer was lost.
    pub uncertain_commits: u64,
    pub copies: u64,
    pub applications: u64,
    /// (event, subscriber) pairs owed, and how each ended.
    pub owed: u64,
    pub owed_applied: u64,
    pub owed_dead_letter: u64,
    pub owed_pending_behind_dead_head: u64,
    pub owed_purged: u64,
    /// Pairs that may or may not be applied, and how many were.
    pub may: u64,
    pub may_applied: u64,
    pub dead_letters: u64,
    pub open_dead_letters: u64,
}

/// The verdict.
#[derive(Debug, Default, Serialize)]
pub struct Checked {
    pub figures: Figures,
    pub violations: Vec<Violation>,
}

/// Checks a run.
pub fn check(history: &History, world: &World) -> Checked {
    let mut out = Checked::default();
    let mut v = |kind: &'static str, n: Option<u64>, sub: Option<usize>, detail: String| {
        out.violations.push(Violation {
            kind,
            n,
            sub,
            detail,
        })
    };
    let mut f = Figures::default();

    // The events: committed, or found anywhere (a commit whose answer was lost).
    let mut seen: BTreeSet<u64> = BTreeSet::new();
    seen.extend(world.copies.iter().filter_map(|c| c.n).map(|n| n as u64));
    seen.extend(world.applied.iter().map(|a| a.n as u64));
    seen.extend(world.dead.iter().filter_map(|d| d.n).map(|n| n as u64));
    let events: BTreeMap<u64, &Written> = history
        .written
        .iter()
        .filter(|w| w.committed == Some(true) || seen.contains(&w.n))
        .map(|w| (w.n, w))
        .collect();
    f.events = events.len() as u64;
    f.uncertain_commits = history
        .written
        .iter()
        .filter(|w| w.committed.is_none())
        .count() as u64;
    f.copies = world.copies.len() as u64;
    f.applications = world.applied.len() as u64;
    f.dead_letters = world.dead.len() as u64;
    f.open_dead_letters = world.dead.iter().filter(|d| d.open()).count() as u64;
    for n in &seen {
        if !history.written.iter().any(|w| w.n == *n) {
            v(
                "unknown event",
                Some(*n),
                None,
                "the database holds an event no producer wrote".into(),
            );
        }
    }

    let mut applied: BTreeMap<(u64, usize), Vec<&Applied>> = BTreeMap::new();
    for a in &world.applied {
        if let Some(s) = sub_index(&a.subscriber) {
            applied.entry((a.n as u64, s)).or_default().push(a);
        }
    }
    let mut copies: BTreeMap<(u64, usize), Vec<&CopyRow>> = BTreeMap::new();
    for c in &world.copies {
        if let (Some(n), Some(s)) = (c.n, sub_index(&c.subscriber)) {
            copies.entry((n as u64, s)).or_default().push(c);
        }
    }
    let mut dead: BTreeMap<(u64, usize), Vec<&DeadRow>> = BTreeMap::new();
    for d in &world.dead {
        if let (Some(n), Some(s)) = (d.n, sub_index(&d.subscriber)) {
            dead.entry((n as u64, s)).or_default().push(d);
        }
    }
    let blocked: BTreeSet<(&str, &str, &str)> = world
        .lanes
        .iter()
        .filter(|l| l.blocked)
        .map(|l| {
            (
                l.topic.as_str(),
                l.partition_key.as_str(),
                l.subscriber.as_str(),
            )
        })
        .collect();
    let waiting: BTreeSet<(&str, &str, &str)> = world
        .lanes
        .iter()
        .filter(|l| l.waiting)
        .map(|l| {
            (
                l.topic.as_str(),
                l.partition_key.as_str(),
                l.subscriber.as_str(),
            )
        })
        .collect();
    let periods: BTreeMap<(usize, usize), Vec<&Period>> = {
        let mut m: BTreeMap<(usize, usize), Vec<&Period>> = BTreeMap::new();
        for p in &history.periods {
            m.entry((p.topic, p.sub)).or_default().push(p);
        }
        m
    };
    let no_periods = Vec::new();

    for (&n, e) in &events {
        for (s, name) in SUBSCRIBERS.iter().enumerate() {
            let ps = periods.get(&(e.topic, s)).unwrap_or(&no_periods);
            let owe = owed(e, ps);
            let apps = applied.get(&(n, s)).map(Vec::as_slice).unwrap_or(&[]);
            let cs = copies.get(&(n, s)).map(Vec::as_slice).unwrap_or(&[]);
            let ds = dead.get(&(n, s)).map(Vec::as_slice).unwrap_or(&[]);
            let open: Vec<&&DeadRow> = ds.iter().filter(|d| d.open()).collect();
            if apps.len() > 1 {
                v(
                    "applied more than once",
                    Some(n),
                    Some(s),
                    format!(
                        "applied {} times, copies {:?}",
                        apps.len(),
                        apps.iter().map(|a| a.outbox_id).collect::<Vec<_>>()
                    ),
                );
            }
            if !apps.is_empty() && !open.is_empty() {
                v(
                    "applied yet an open dead letter",
                    Some(n),
                    Some(s),
                    format!(
                        "dead letters {:?}",
                        open.iter().map(|d| d.id).collect::<Vec<_>>()
                    ),
                );
            }
            if e.poison_for.contains(&s) {
                for a in apps {
                    let cured = history
                        .cures
                        .iter()
                        .any(|(t, upto)| *t <= a.applied_at && n <= *upto);
                    if !cured {
                        v(
                            "poison applied before it was cured",
                            Some(n),
                            Some(s),
                            format!("copy {}", a.outbox_id),
                        );
                    }
                }
            }
            match owe {
                Owed::Must => {
                    f.owed += 1;
                    if !apps.is_empty() {
                        f.owed_applied += 1;
                        continue;
                    }
                    match open.len() {
                        1 => {
                            f.owed_dead_letter += 1;
                            continue;
                        }
                        0 => {}
                        k => {
                            v(
                                "more than one open dead letter",
                                Some(n),
                                Some(s),
                                format!("{k} open dead letters"),
                            );
                            continue;
                        }
                    }
                    if history.purged.contains(&(n, (*name).to_owned())) {
                        f.owed_purged += 1;
                        continue;
                    }
                    let topic = TOPICS[e.topic].name();
                    let key = format!("k{}", e.key);
                    let pending: Vec<&&CopyRow> = cs
                        .iter()
                        .filter(|c| c.delivered_at.is_none() && c.dead_lettered_at.is_none())
                        .collect();
                    let lane = (topic, key.as_str(), *name);
                    if !pending.is_empty() && blocked.contains(&lane) {
                        f.owed_pending_behind_dead_head += 1;
                    } else if !pending.is_empty() && waiting.contains(&lane) {
                        v(
                            "pending: its lane waits for a replay that is over",
                            Some(n),
                            Some(s),
                            format!("copy {}", pending[0].id),
                        );
                    } else if !pending.is_empty() {
                        v(
                            "pending without a reason",
                            Some(n),
                            Some(s),
                            format!(
                                "copy {} {}",
                                pending[0].id,
                                if pending[0].dispatched_at.is_some() {
                                    "in flight"
                                } else {
                                    "not dispatched"
                                }
                            ),
                        );
                    } else if cs.iter().any(|c| c.dead_lettered_at.is_some()) {
                        v(
                            "dead without an open dead letter",
                            Some(n),
                            Some(s),
                            format!("{} dead letters, none open", ds.len()),
                        );
                    } else if cs.iter().any(|c| c.delivered_at.is_some()) {
                        v(
                            "delivered but never applied",
                            Some(n),
                            Some(s),
                            String::new(),
                        );
                    } else {
                        v(
                            "lost",
                            Some(n),
                            Some(s),
                            if cs.is_empty() {
                                "no copy for the subscriber, no application, no dead letter".into()
                            } else {
                                "no application, no dead letter".into()
                            },
                        );
                    }
                }
                Owed::May => {
                    f.may += 1;
                    if let Some(a) = apps.first() {
                        f.may_applied += 1;
                        // Applied after a removal: it had a copy in flight at a removal, or was written during
                        // one, or an operator redrove its dead-lettered copy (which a removal keeps), or a later
                        // subscription owes it.
                        let in_flight = ps
                            .iter()
                            .filter_map(|p| p.removal.as_ref())
                            .any(|r| r.in_flight.contains(&n));
                        // Seen on the dead letters left, or in the explorer's record of its redrives (a prune
                        // deletes handled dead letters).
                        let redriven =
                            ds.iter()
                                .any(|d| d.redriven_at.is_some_and(|r| r <= a.applied_at))
                                || history.redriven.iter().any(|(rn, rs, at)| {
                                    *rn == n && rs == name && *at <= a.applied_at
                                });
                        // Only an event committed before the removal began: one whose transaction the removal waited
                        // for (begun before it, committed during its wait) wrote a copy the removal's snapshot could
                        // not see, which a relay may publish before the removal deletes it.
                        let late = ps.iter().filter_map(|p| p.removal.as_ref()).find(|r| {
                            r.end.is_some_and(|end| a.applied_at > end)
                                && e.end < r.start
                                && !in_flight
                                && !redriven
                        });
                        // A later subscription that owes the event: the open one, or one removed later when
                        // the application came while it was live (after its addition began, before its removal
                        // ended) or the event was in flight at that removal.
                        // The application's copy, when it is still there: one made during a later subscription
                        // (by its replay) was that subscription's to deliver. A replay selects by the copies'
                        // `created_at`, which lies anywhere in the writing transaction, so an event begun just
                        // before a `--from` may be replayed (seed 113: begun 1.4 s before it, replayed, applied).
                        let made_at = world
                            .copies
                            .iter()
                            .find(|c| c.id == a.outbox_id)
                            .map(|c| c.created_at);
                        let covered_later = ps.iter().any(|p| {
                            let owes = p.add_start.is_none_or(|t| e.end >= t)
                                || p.replay.as_ref().is_some_and(|r| {
                                    r.retained.contains(&n)
                                        || (e.start >= r.since && e.end > r.read_at)
                                        || (e.end >= r.since
                                            && made_at
                                                .zip(p.add_start)
                                                .is_some_and(|(m, t)| m >= t))
                                });
                            let live_then = match &p.removal {
                                None => true,
                                Some(rm) => {
                                    p.add_start.is_some_and(|t| a.applied_at >= t)
                                        && (rm.end.is_none_or(|end| a.applied_at <= end)
                                            || rm.in_flight.contains(&n))
                                }
                            };
                            owes && live_then
                        });
                        if let Some(r) = late
                            && !covered_later
                        {
                            v(
                                "applied after its removal though not in flight",
                                Some(n),
                                Some(s),
                                format!("removed at {}, applied at {}", r.start, a.applied_at),
                            );
                        }
                    }
                }
                Owed::No => {
                    if !apps.is_empty() {
                        v(
                            "applied though not owed (not subscribed, or before its --from)",
                            Some(n),
                            Some(s),
                            format!("copy {}", apps[0].outbox_id),
                        );
                    }
                }
            }
        }
    }

    // Every dead letter has a cause.
    for d in &world.dead {
        let (Some(n), Some(s)) = (d.n.map(|n| n as u64), sub_index(&d.subscriber)) else {
            continue;
        };
        let Some(e) = events.get(&n) else { continue };
        let ps = periods.get(&(e.topic, s)).unwrap_or(&no_periods);
        // A poison event's dead letter says so only in the consumer's response, for one event per message.
        // A copy a removal deleted while QStash still held it: its failure, once QStash gives up, is recorded
        // resolved (nothing is owed; decision record 0070). Caused when the copy is gone from the outbox and the
        // subscriber's removal from the topic, started before the dead letter, found the event in flight.
        let withdrawn = || {
            !d.open()
                && d.outbox_id
                    .is_some_and(|id| !world.copies.iter().any(|c| c.id == id))
                && ps.iter().any(|p| {
                    p.removal
                        .as_ref()
                        .is_some_and(|r| r.start <= d.created_at && r.in_flight.contains(&n))
                })
        };
        let cause = if e.poison_for.contains(&s) || withdrawn() {
            true
        } else if d.error.starts_with("no destination") {
            // Not surely live then: before its addition returned (an addition that first finishes an earlier
            // removal waits with the subscriber still removed), or after its removal began.
            !ps.iter().any(|p| {
                (p.add_start.is_none() || p.add_end.is_some_and(|e| e <= d.created_at))
                    && p.removal.as_ref().is_none_or(|r| d.created_at < r.start)
            })
        } else {
            d.outbox_id.is_some_and(|id| world.given_up.contains(&id))
                || d.qstash_message_id
                    .as_ref()
                    .is_some_and(|m| world.lost_messages.contains(m))
                || refused_in_order(d, n, e, ps, world)
        };
        if !cause {
            v(
                "dead letter without a cause",
                Some(n),
                Some(s),
                format!(
                    "dead letter {} ({}): {}",
                    d.id,
                    d.source,
                    one_line(&d.error)
                ),
            );
        }
    }

    // Per key of an ordered topic, per subscriber: rising sequences in application order.
    let mut last: BTreeMap<(&str, &str, &str), (i64, i64)> = BTreeMap::new();
    for a in &world.applied {
        let (Some(seq), Some(key)) = (a.seq, a.partition_key.as_deref()) else {
            continue;
        };
        if topic_index(&a.topic)
            .is_none_or(|t| TOPICS[t].ordering() != outbox::TopicOrdering::PerKey)
        {
            continue;
        }
        let k = (a.topic.as_str(), key, a.subscriber.as_str());
        if let Some((prev_seq, prev_n)) = last.get(&k)
            && seq <= *prev_seq
        {
            v(
                "applied out of order",
                Some(a.n as u64),
                sub_index(&a.subscriber),
                format!(
                    "{} {key}: seq {seq} applied after seq {prev_seq} (event {prev_n})",
                    a.topic
                ),
            );
        }
        last.insert(k, (seq, a.n));
    }

    for o in &history.outside_selection {
        v(
            "operator action outside its selection",
            None,
            None,
            o.clone(),
        );
    }
    if !world.drained {
        v(
            "not drained",
            None,
            None,
            "the pipeline still had work when the drain's bound ran out".into(),
        );
    }
    out.figures = f;
    out
}
