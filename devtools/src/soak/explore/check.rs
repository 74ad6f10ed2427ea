//! The checker: the run's history ([`History`]: what the producers wrote and when, each subscription period,
//! every action) against what the run left behind ([`World`]: what each subscriber's consumer applied, with the
//! time and the copy; the outbox's copies, the dead letters and the lanes; the dev server's DLQ and lost
//! messages). It never asks the library what should have happened.
//!
//! | Per (event, subscriber) | Allowed at the end |
//! |---|---|
//! | *owed*: written after the subscriber was added and it was never removed after; or retained and at or after the `--from` of a finished replay of its current subscription | applied exactly once; or exactly one open dead letter with a cause; or its copy pending behind a dead head of its lane, or its dead letter purged by an operator |
//! | *may*: written while the subscriber was being added or removed, or during a subscription that was later removed, or covered by a replay that did not finish, or written up to 2 s before a replay's `--from` | applied at most once; when applied after a removal, it had a copy in flight at a removal (or was written during one), or its dead-lettered copy was redriven first, or a later subscription owes it |
//! | *not owed*: the subscriber was not on the topic while it was written, and no replay of it reached back to it (`--from` after it) | never applied |
//!
//! And for every run: per key of an ordered topic, each subscriber applies rising sequences; a dead letter has a
//! cause (the event is poison for that subscriber; QStash gave up on its message after faults, by the dev
//! server's DLQ; its message was lost by the dev server; or "no destination" while the subscriber was not on the
//! topic); poison is applied only after it was cured; no operator action changed a row outside its selection;
//! the pipeline drained.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use super::history::{History, Period, Written};
use super::schedule::{SUBSCRIBERS, Schedule, TOPICS, label};

/// One application by a subscriber's consumer (`soak_applied`).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Applied {
    pub ord: i64,
    pub outbox_id: i64,
    pub topic: String,
    pub partition_key: Option<String>,
    pub seq: Option<i64>,
    pub n: i64,
    pub subscriber: String,
    pub applied_at: DateTime<Utc>,
}

/// One outbox row (a copy of an event for one subscriber).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct CopyRow {
    pub id: i64,
    pub topic: String,
    pub partition_key: String,
    pub subscriber: String,
    pub n: Option<i64>,
    pub created_at: DateTime<Utc>,
    pub dispatched_at: Option<DateTime<Utc>>,
    pub delivered_at: Option<DateTime<Utc>>,
    pub dead_lettered_at: Option<DateTime<Utc>>,
}

/// One dead letter.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct DeadRow {
    pub id: i64,
    pub source: String,
    pub outbox_id: Option<i64>,
    pub topic: Option<String>,
    pub subscriber: String,
    pub n: Option<i64>,
    pub error: String,
    pub qstash_message_id: Option<String>,
    pub created_at: DateTime<Utc>,
    pub redriven_at: Option<DateTime<Utc>>,
    pub resolved_at: Option<DateTime<Utc>>,
}

impl DeadRow {
    fn open(&self) -> bool {
        self.redriven_at.is_none() && self.resolved_at.is_none()
    }
}

/// One ordered lane.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Lane {
    pub topic: String,
    pub partition_key: String,
    pub subscriber: String,
    pub blocked: bool,
    pub waiting: bool,
    /// The rest, as one line for reports.
    pub state: String,
}

/// What the run left behind.
#[derive(Debug, Default)]
pub struct World {
    pub applied: Vec<Applied>,
    pub copies: Vec<CopyRow>,
    pub dead: Vec<DeadRow>,
    pub lanes: Vec<Lane>,
    /// Copies in messages QStash gave up on after faults (not refused by the consumer), by the dev server's DLQ.
    pub given_up: BTreeSet<i64>,
    /// Messages the dev server lost on purpose.
    pub lost_messages: BTreeSet<String>,
    /// The pipeline drained before the bound.
    pub drained: bool,
}

impl World {
    /// Reads the database's part.
    pub async fn read(db: &PgPool) -> Result<World, sqlx::Error> {
        let applied = sqlx::query_as(
            "SELECT ord, outbox_id, topic, partition_key, seq, n, subscriber, applied_at FROM soak_applied ORDER BY ord",
        )
        .fetch_all(db)
        .await?;
        let copies = sqlx::query_as(
            "SELECT id, topic, partition_key, subscriber, (payload->>'n')::bigint AS n, created_at, dispatched_at, \
                    delivered_at, dead_lettered_at FROM outbox ORDER BY id",
        )
        .fetch_all(db)
        .await?;
        let dead = sqlx::query_as(
            "SELECT id, source, outbox_id, topic, subscriber, (payload->>'n')::bigint AS n, error, qstash_message_id, \
                    created_at, redriven_at, resolved_at FROM dead_letters ORDER BY id",
        )
        .fetch_all(db)
        .await?;
        let lanes = sqlx::query_as(
            "SELECT topic, partition_key, subscriber, blocked_at IS NOT NULL AS blocked, \
                    available_at = 'infinity' AS waiting, \
                    format('done_seq %s, available_at %s, locked_until %s, inflight_id %s, blocked_id %s', \
                           done_seq, available_at, locked_until, inflight_id, blocked_id) AS state \
             FROM outbox_keys",
        )
        .fetch_all(db)
        .await?;
        Ok(World {
            applied,
            copies,
            dead,
            lanes,
            ..World::default()
        })
    }

    /// Adds the dev server's part: the copies of the messages in its DLQ that it gave up on (not those the
    /// consumer refused with a 4xx), and the messages it lost.
    pub fn with_dev_server(mut self, dlq: &[qstash_dev::DlqEntryInfo], lost: Vec<String>) -> World {
        self.given_up = outbox_testkit::given_up::given_up(dlq)
            .iter()
            .filter(|m| !m.refused_by_the_consumer())
            .flat_map(|m| m.events.iter().copied())
            .collect();
        self.lost_messages = lost.into_iter().collect();
        self
    }
}

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owed {
    Must,
    May,
    No,
}

fn sub_index(name: &str) -> Option<usize> {
    SUBSCRIBERS.iter().position(|s| *s == name)
}

fn topic_index(name: &str) -> Option<usize> {
    TOPICS.iter().position(|t| t.name() == name)
}

/// Whether `e` is owed to the subscriber of `periods` (all its periods on `e`'s topic).
fn owed(e: &Written, periods: &[&Period]) -> Owed {
    let mut may = false;
    for p in periods {
        let before_add = p.add_start.is_some_and(|t| e.end < t);
        let after_add = p.add_end.is_none_or(|t| e.start > t);
        if !before_add {
            match &p.removal {
                None if after_add => return Owed::Must,
                None => may = true,
                Some(r) => {
                    if r.end.is_none_or(|end| e.start <= end) {
                        may = true;
                    }
                }
            }
        }
        if let Some(rc) = &p.replay {
            if rc.retained.contains(&e.n) || (e.start >= rc.since && e.end > rc.read_at) {
                if p.removal.is_none() && rc.finished {
                    return Owed::Must;
                }
                may = true;
            } else if e.end >= rc.since - chrono::Duration::seconds(2) {
                // Ids are not quite in time order: the replay's first id may be a little older than `--from`.
                may = true;
            }
        }
    }
    if may { Owed::May } else { Owed::No }
}

/// An ordered event a subscriber's consumer refused as late ("out of order") because the subscriber had applied a
/// later sequence of its key in an earlier subscription, before the one that replayed the event (a re-add `--from`
/// reaching further back than what it already applied: the consumer keeps its order; seed 118). A later sequence
/// applied within the same subscription does not count: that would be the relay letting live copies overtake
/// replayed ones (seed 111's defect).
fn refused_in_order(d: &DeadRow, n: u64, e: &Written, ps: &[&Period], world: &World) -> bool {
    // The consumer's refusal, in its words when the dead letter kept them, or by its status (489: not to be retried).
    if !(d.error.contains("out of order") || d.error.contains("last status 489")) {
        return false;
    }
    let topic = TOPICS[e.topic].name();
    let key = format!("k{}", e.key);
    let Some(seq) = world
        .applied
        .iter()
        .find(|a| a.n as u64 == n)
        .and_then(|a| a.seq)
    else {
        return false;
    };
    let Some(began) = ps
        .iter()
        .filter_map(|p| p.add_start)
        .filter(|t| *t <= d.created_at)
        .max()
    else {
        return false;
    };
    world.applied.iter().any(|a| {
        a.subscriber == d.subscriber
            && a.topic == topic
            && a.partition_key.as_deref() == Some(key.as_str())
            && a.seq.is_some_and(|x| x > seq)
            && a.applied_at < began
    })
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

fn one_line(s: &str) -> String {
    outbox_cli::util::one_line(s, 160)
}

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
