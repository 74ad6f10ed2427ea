//! A violation's report: the seed and how to run it again, the schedule, then each kind of violation with the
//! history of its events (their write, copies, applications, dead letters, lanes, subscription periods, and the
//! actions and faults around them).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use chrono::{DateTime, Utc};

use super::names::{one_line, sub_index};
use super::verdict::{Checked, Violation};
use super::world::World;
use crate::soak::explore::history::History;
use crate::soak::explore::schedule::{SUBSCRIBERS, Schedule, TOPICS, label};

/// A violation's report: the seed and how to run it again, the schedule, then each kind of violation with up
/// to `per_kind` of them, each with the history of its event.
pub fn report(
    schedule: &Schedule,
    history: &History,
    world: &World,
    checked: &Checked,
    t0: DateTime<Utc>,
    per_kind: usize,
) -> String {
    let mut s = String::new();
    let rel = |t: DateTime<Utc>| (t - t0).num_milliseconds() as f64 / 1000.0;
    let _ = writeln!(
        s,
        "VIOLATIONS at seed {} ({:.0} s): rerun with `outbox-dev soak --schedule random --seed {} --minutes {}`",
        schedule.seed,
        schedule.length.as_secs_f64(),
        schedule.seed,
        schedule.length.as_secs_f64() / 60.0
    );
    let mut by_kind: BTreeMap<&str, Vec<&Violation>> = BTreeMap::new();
    for v in &checked.violations {
        by_kind.entry(v.kind).or_default().push(v);
    }
    for (kind, vs) in &by_kind {
        let _ = writeln!(s, "  {kind}: {}", vs.len());
    }
    let _ = write!(s, "{schedule}");
    for (kind, vs) in &by_kind {
        let _ = writeln!(s, "== {kind} ({}) ==", vs.len());
        for v in vs.iter().take(per_kind) {
            let _ = writeln!(
                s,
                "- event {} subscriber {}: {}",
                v.n.map_or("-".into(), |n| n.to_string()),
                v.sub.map_or("-", label),
                v.detail
            );
            if let Some(n) = v.n {
                s.push_str(&event_history(n, v.sub, history, world, &rel));
            }
        }
    }
    s
}

/// The history of event `n`: its write, its copies, its applications, its dead letters, the periods of
/// subscriber `sub` on its topic, and the actions and faults from its write to its last trace.
fn event_history(
    n: u64,
    sub: Option<usize>,
    history: &History,
    world: &World,
    rel: &dyn Fn(DateTime<Utc>) -> f64,
) -> String {
    let mut s = String::new();
    let Some(e) = history.written.iter().find(|w| w.n == n) else {
        return s;
    };
    let topic = TOPICS[e.topic].name();
    let _ = writeln!(
        s,
        "    written {:.3}–{:.3}s to {topic} k{} (committed {:?}{}{})",
        rel(e.start),
        rel(e.end),
        e.key,
        e.committed,
        if e.poison_for.is_empty() {
            String::new()
        } else {
            format!(
                ", poison for {:?}",
                e.poison_for.iter().map(|s| label(*s)).collect::<Vec<_>>()
            )
        },
        if e.delayed { ", delayed" } else { "" }
    );
    let mut last = e.end;
    let opt = |t: Option<DateTime<Utc>>| t.map_or("-".into(), |t| format!("{:.3}", rel(t)));
    for c in world.copies.iter().filter(|c| c.n == Some(n as i64)) {
        let _ = writeln!(
            s,
            "    copy {} for {}: created {:.3}, dispatched {}, delivered {}, dead {}",
            c.id,
            label(sub_index(&c.subscriber).unwrap_or(0)),
            rel(c.created_at),
            opt(c.dispatched_at),
            opt(c.delivered_at),
            opt(c.dead_lettered_at)
        );
        last = last.max(
            c.delivered_at
                .or(c.dead_lettered_at)
                .unwrap_or(c.created_at),
        );
    }
    for a in world.applied.iter().filter(|a| a.n == n as i64) {
        let _ = writeln!(
            s,
            "    applied by {} at {:.3} (copy {}, seq {:?})",
            label(sub_index(&a.subscriber).unwrap_or(0)),
            rel(a.applied_at),
            a.outbox_id,
            a.seq
        );
        last = last.max(a.applied_at);
    }
    for d in world.dead.iter().filter(|d| d.n == Some(n as i64)) {
        let _ = writeln!(
            s,
            "    dead letter {} for {} at {:.3} (copy {:?}, {}; redriven {}, resolved {}): {}",
            d.id,
            label(sub_index(&d.subscriber).unwrap_or(0)),
            rel(d.created_at),
            d.outbox_id,
            d.source,
            opt(d.redriven_at),
            opt(d.resolved_at),
            one_line(&d.error)
        );
        last = last.max(d.created_at);
    }
    if let Some(sub) = sub {
        let key = format!("k{}", e.key);
        for l in world.lanes.iter().filter(|l| {
            l.topic == topic && l.partition_key == key && l.subscriber == SUBSCRIBERS[sub]
        }) {
            let _ = writeln!(
                s,
                "    lane of {} on {topic} {key}: {}",
                label(sub),
                l.state
            );
        }
        for p in history.periods_of(e.topic, sub) {
            let _ = writeln!(
                s,
                "    {} on {topic}: added {}–{}{}{}",
                label(sub),
                opt(p.add_start),
                opt(p.add_end),
                p.replay.as_ref().map_or(String::new(), |r| format!(
                    ", replay from {:.3} ({} retained events owed{}{})",
                    rel(r.since),
                    r.retained.len(),
                    if r.retained.contains(&n) {
                        ", this one among them"
                    } else {
                        ""
                    },
                    if r.finished {
                        ", finished"
                    } else {
                        ", not finished"
                    }
                )),
                p.removal.as_ref().map_or(String::new(), |r| format!(
                    ", removed {}–{} ({} events in flight{})",
                    format_args!("{:.3}", rel(r.start)),
                    opt(r.end),
                    r.in_flight.len(),
                    if r.in_flight.contains(&n) {
                        ", this one among them"
                    } else {
                        ""
                    }
                ))
            );
        }
    }
    let from = e.start - chrono::Duration::seconds(2);
    let to = last + chrono::Duration::seconds(2);
    for r in history
        .records
        .iter()
        .filter(|r| r.end >= from && r.start <= to)
    {
        let _ = writeln!(
            s,
            "    {:>8.3}–{:.3}s {}: {:?}",
            rel(r.start),
            rel(r.end),
            r.what,
            r.outcome
        );
    }
    s
}
