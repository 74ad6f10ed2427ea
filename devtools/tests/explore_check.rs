//! The schedule explorer's checker (`outbox_devtools::soak::explore::check`) on histories and end states built by
//! hand, each with one known defect: an event applied twice, one owed and lost, one pending with no reason, a
//! dead letter with no cause (a "no destination" while the subscriber was on the topic), one applied out of
//! order, one applied after its subscriber's removal though it was not in flight, one applied though the
//! subscriber was never on its topic, one dead without an open dead letter, an operator action outside its
//! selection, a replay that missed an event it owed; and the same states without the defect, which pass. Each
//! defect is named by its kind, nothing else is reported.

use std::collections::BTreeSet;

use chrono::{DateTime, Duration, Utc};
use outbox_devtools::soak::explore::check::{Applied, CopyRow, DeadRow, Lane, World, check};
use outbox_devtools::soak::explore::history::{History, Period, Removal, ReplayCover, Written};
use outbox_devtools::soak::explore::schedule::{SUBSCRIBERS, TOPICS};

/// Topic indexes: an ordered topic and an unordered one.
const ORDERED: usize = 0;
const UNORDERED: usize = 2;
/// Subscriber indexes.
const DEFAULT: usize = 0;
const S1: usize = 1;

fn t(secs: i64) -> DateTime<Utc> {
    DateTime::<Utc>::from_timestamp(1_800_000_000, 0).unwrap() + Duration::seconds(secs)
}

/// A history where `subs` are on `topic` from the start, and the events `(n, topic, written at)`.
fn history(subs: &[(usize, usize)], events: &[(u64, usize, i64)]) -> History {
    let mut h = History::default();
    for &(topic, sub) in subs {
        h.periods.push(Period {
            topic,
            sub,
            add_start: None,
            add_end: None,
            replay: None,
            removal: None,
        });
    }
    for &(n, topic, at) in events {
        h.written.push(Written {
            n,
            topic,
            key: 1,
            poison_for: Vec::new(),
            delayed: false,
            start: t(at),
            end: t(at) + Duration::milliseconds(10),
            committed: Some(true),
        });
    }
    h
}

/// The first period of `sub` on `topic` (the one a test's history starts with).
fn first_period(h: &mut History, topic: usize, sub: usize) -> &mut Period {
    h.periods
        .iter_mut()
        .find(|p| p.topic == topic && p.sub == sub)
        .unwrap()
}

/// The world after a clean run: every event's copy for each subscriber delivered and applied once.
struct Builder {
    world: World,
    next_id: i64,
}

impl Builder {
    fn new() -> Builder {
        Builder {
            world: World {
                drained: true,
                ..World::default()
            },
            next_id: 1,
        }
    }

    /// A copy of event `n` for `sub`, in state `delivered` / `dead` / pending; returns its id.
    fn copy(&mut self, n: u64, topic: usize, sub: usize, delivered: bool, dead: bool) -> i64 {
        let id = self.next_id;
        self.next_id += 1;
        self.world.copies.push(CopyRow {
            id,
            topic: TOPICS[topic].name().to_owned(),
            partition_key: "k1".into(),
            subscriber: SUBSCRIBERS[sub].to_owned(),
            n: Some(n as i64),
            created_at: t(0),
            dispatched_at: (delivered || dead).then(|| t(1)),
            delivered_at: delivered.then(|| t(2)),
            dead_lettered_at: dead.then(|| t(2)),
        });
        id
    }

    /// `sub` applied copy `id` of event `n` (sequence `seq` on an ordered topic) at `at`.
    fn apply(&mut self, id: i64, n: u64, topic: usize, sub: usize, seq: Option<i64>, at: i64) {
        self.world.applied.push(Applied {
            ord: self.world.applied.len() as i64 + 1,
            outbox_id: id,
            topic: TOPICS[topic].name().to_owned(),
            partition_key: Some("k1".into()),
            seq,
            n: n as i64,
            subscriber: SUBSCRIBERS[sub].to_owned(),
            applied_at: t(at),
        });
    }

    /// Event `n` copied for `sub`, delivered and applied once.
    fn delivered(&mut self, n: u64, topic: usize, sub: usize, seq: Option<i64>) -> i64 {
        let id = self.copy(n, topic, sub, true, false);
        self.apply(id, n, topic, sub, seq, 2);
        id
    }

    /// A dead letter of copy `id` (event `n`, subscriber `sub`), open or redriven.
    fn dead_letter(&mut self, id: i64, n: u64, sub: usize, error: &str, open: bool) {
        self.world.dead.push(DeadRow {
            id: self.world.dead.len() as i64 + 1,
            source: "qstash".into(),
            outbox_id: Some(id),
            topic: None,
            subscriber: SUBSCRIBERS[sub].to_owned(),
            n: Some(n as i64),
            error: error.into(),
            qstash_message_id: None,
            created_at: t(3),
            redriven_at: (!open).then(|| t(4)),
            resolved_at: None,
        });
    }
}

/// The kinds of violation found, sorted.
fn kinds(h: &History, w: &World) -> Vec<&'static str> {
    let mut k: Vec<&'static str> = check(h, w).violations.iter().map(|v| v.kind).collect();
    k.sort();
    k
}

/// Two events (one ordered, one unordered) owed to the default subscriber and s1, each applied once.
fn clean() -> (History, Builder) {
    let h = history(
        &[
            (ORDERED, DEFAULT),
            (ORDERED, S1),
            (UNORDERED, DEFAULT),
            (UNORDERED, S1),
        ],
        &[(1, ORDERED, 1), (2, UNORDERED, 1)],
    );
    let mut b = Builder::new();
    for sub in [DEFAULT, S1] {
        b.delivered(1, ORDERED, sub, Some(1));
        b.delivered(2, UNORDERED, sub, None);
    }
    (h, b)
}

#[test]
fn a_clean_run_passes_and_counts_every_owed_pair_applied() {
    let (h, b) = clean();
    let c = check(&h, &b.world);
    assert!(c.violations.is_empty(), "{:?}", c.violations);
    assert_eq!(
        (c.figures.events, c.figures.owed, c.figures.owed_applied),
        (2, 4, 4)
    );
}

#[test]
fn an_event_applied_twice_by_one_subscriber_is_found() {
    let (h, mut b) = clean();
    let again = b.copy(2, UNORDERED, S1, true, false);
    b.apply(again, 2, UNORDERED, S1, None, 5);
    assert_eq!(kinds(&h, &b.world), ["applied more than once"]);
}

#[test]
fn an_owed_event_with_no_application_no_dead_letter_and_no_copy_is_lost() {
    let (h, mut b) = clean();
    b.world
        .applied
        .retain(|a| !(a.n == 2 && a.subscriber == SUBSCRIBERS[S1]));
    b.world
        .copies
        .retain(|c| !(c.n == Some(2) && c.subscriber == SUBSCRIBERS[S1]));
    assert_eq!(kinds(&h, &b.world), ["lost"]);
}

#[test]
fn a_pending_copy_passes_only_behind_a_dead_head_of_its_lane() {
    let mut h = history(&[(ORDERED, DEFAULT)], &[(1, ORDERED, 1), (3, ORDERED, 2)]);
    h.written[0].poison_for = vec![DEFAULT];
    let mut b = Builder::new();
    let head = b.copy(1, ORDERED, DEFAULT, false, true);
    b.dead_letter(head, 1, DEFAULT, "last status 489", true);
    b.copy(3, ORDERED, DEFAULT, false, false);
    assert_eq!(kinds(&h, &b.world), ["pending without a reason"]);
    b.world.lanes.push(Lane {
        topic: TOPICS[ORDERED].name().to_owned(),
        partition_key: "k1".into(),
        subscriber: SUBSCRIBERS[DEFAULT].to_owned(),
        blocked: true,
        waiting: false,
        state: String::new(),
    });
    let c = check(&h, &b.world);
    assert!(c.violations.is_empty(), "{:?}", c.violations);
    assert_eq!(
        (
            c.figures.owed_dead_letter,
            c.figures.owed_pending_behind_dead_head
        ),
        (1, 1)
    );
}

#[test]
fn a_dead_letter_needs_a_cause_poison_the_dev_servers_dlq_or_a_removed_subscriber() {
    let (h, mut b) = clean();
    b.world.applied.retain(|a| a.n != 2);
    let ids: Vec<i64> = b
        .world
        .copies
        .iter()
        .filter(|c| c.n == Some(2))
        .map(|c| c.id)
        .collect();
    for c in &mut b.world.copies {
        if c.n == Some(2) {
            c.delivered_at = None;
            c.dead_lettered_at = Some(t(2));
        }
    }
    b.dead_letter(
        ids[0],
        2,
        DEFAULT,
        "QStash gave up after 4 attempt(s); last status 503",
        true,
    );
    b.dead_letter(
        ids[1],
        2,
        S1,
        "no destination: subscriber \"s1\" of topic x.unordered is not configured",
        true,
    );
    assert_eq!(
        kinds(&h, &b.world),
        ["dead letter without a cause", "dead letter without a cause"]
    );
    // The dev server gave up on the first copy's message; the second copy's poison for s1.
    b.world.given_up.insert(ids[0]);
    let mut h2 = h;
    h2.written[1].poison_for = vec![S1];
    assert!(kinds(&h2, &b.world).is_empty());
    // "No destination" while s1 was removed is a cause too.
    h2.written[1].poison_for.clear();
    first_period(&mut h2, UNORDERED, S1).removal = Some(Removal {
        start: t(0),
        end: Some(t(1)),
        in_flight: BTreeSet::from([2]),
    });
    assert!(
        kinds(&h2, &b.world).is_empty(),
        "{:?}",
        check(&h2, &b.world).violations
    );
}

#[test]
fn a_lower_sequence_applied_after_a_higher_one_is_out_of_order() {
    let h = history(&[(ORDERED, DEFAULT)], &[(1, ORDERED, 1), (2, ORDERED, 2)]);
    let mut b = Builder::new();
    let second = b.copy(2, ORDERED, DEFAULT, true, false);
    b.apply(second, 2, ORDERED, DEFAULT, Some(2), 3);
    let first = b.copy(1, ORDERED, DEFAULT, true, false);
    b.apply(first, 1, ORDERED, DEFAULT, Some(1), 4);
    assert_eq!(kinds(&h, &b.world), ["applied out of order"]);
}

#[test]
fn after_a_removal_only_what_was_in_flight_may_still_be_applied() {
    let (mut h, mut b) = clean();
    // s1 removed from the unordered topic at 10 s; event 5, written before, applied by s1 at 20 s.
    h.written.push(Written {
        n: 5,
        ..h.written[1].clone()
    });
    first_period(&mut h, UNORDERED, S1).removal = Some(Removal {
        start: t(10),
        end: Some(t(11)),
        in_flight: BTreeSet::new(),
    });
    b.delivered(5, UNORDERED, DEFAULT, None);
    let late = b.copy(5, UNORDERED, S1, true, false);
    b.apply(late, 5, UNORDERED, S1, None, 20);
    assert_eq!(
        kinds(&h, &b.world),
        ["applied after its removal though not in flight"]
    );
    // A dead-lettered copy (a removal keeps it) redriven by an operator before the application is allowed too.
    let mut redriven = Builder::new();
    redriven.world = World {
        copies: b.world.copies.clone(),
        applied: b.world.applied.clone(),
        drained: true,
        ..World::default()
    };
    redriven.dead_letter(late, 5, S1, "QStash gave up after 4 attempt(s)", false);
    redriven.world.given_up.insert(late);
    assert!(kinds(&h, &redriven.world).is_empty());
    // The same once a prune deleted the redriven dead letter: the explorer's own record of its redrive counts
    // (seed 105 at 3 minutes: a prune 50 ms after the redrive), when the redrive came before the application.
    h.redriven.push((5, "s1".to_owned(), t(21)));
    assert_eq!(
        kinds(&h, &b.world),
        ["applied after its removal though not in flight"],
        "a redrive after the application explains nothing"
    );
    h.redriven[0].2 = t(15);
    assert!(kinds(&h, &b.world).is_empty());
    h.redriven.clear();
    if let Some(r) = h.periods.iter_mut().find_map(|p| p.removal.as_mut()) {
        r.in_flight.insert(5);
    }
    assert!(kinds(&h, &b.world).is_empty());
    // An event whose transaction the removal waited for (begun before it, committed during its wait): the
    // removal's snapshot could not see its copy, which a relay may publish before the removal deletes it (seed
    // 114: applied 6 ms after the removal ended). Committed before the removal began, it may not.
    if let Some(r) = h.periods.iter_mut().find_map(|p| p.removal.as_mut()) {
        r.in_flight.clear();
    }
    let w = h.written.iter_mut().find(|w| w.n == 5).unwrap();
    (w.start, w.end) = (t(5), t(11));
    assert!(kinds(&h, &b.world).is_empty());
    let w = h.written.iter_mut().find(|w| w.n == 5).unwrap();
    w.end = t(9);
    assert_eq!(
        kinds(&h, &b.world),
        ["applied after its removal though not in flight"]
    );
}

#[test]
fn an_event_applied_by_a_subscriber_never_on_its_topic_is_found() {
    let (h, mut b) = clean();
    let id = b.copy(2, UNORDERED, 2, true, false);
    b.apply(id, 2, UNORDERED, 2, None, 3);
    assert_eq!(
        kinds(&h, &b.world),
        ["applied though not owed (not subscribed, or before its --from)"]
    );
}

#[test]
fn a_dead_copy_whose_only_dead_letter_was_redriven_has_no_state() {
    let (h, mut b) = clean();
    b.world
        .applied
        .retain(|a| !(a.n == 2 && a.subscriber == SUBSCRIBERS[S1]));
    let id = b
        .world
        .copies
        .iter_mut()
        .find(|c| c.n == Some(2) && c.subscriber == SUBSCRIBERS[S1])
        .map(|c| {
            c.delivered_at = None;
            c.dead_lettered_at = Some(t(2));
            c.id
        })
        .unwrap();
    b.world.given_up.insert(id);
    b.dead_letter(id, 2, S1, "QStash gave up after 4 attempt(s)", false);
    assert_eq!(kinds(&h, &b.world), ["dead without an open dead letter"]);
    // The operator purged it: a state the checker accepts.
    let mut h = h;
    h.purged.insert((2, SUBSCRIBERS[S1].to_owned()));
    b.world.dead.clear();
    assert!(kinds(&h, &b.world).is_empty());
}

#[test]
fn a_replay_owes_the_retained_events_from_its_start_and_those_committed_after_it_read_them() {
    // s1 added to the unordered topic at 10 s with a replay from 0 s that read the retained events at 10 s:
    // event 2 (written at 1 s) was retained; event 7 (a long transaction from 5 s to 15 s) committed after.
    let mut h = history(
        &[(UNORDERED, DEFAULT)],
        &[(2, UNORDERED, 1), (7, UNORDERED, 5)],
    );
    h.written[1].end = t(15);
    h.periods.push(Period {
        topic: UNORDERED,
        sub: S1,
        add_start: Some(t(10)),
        add_end: Some(t(11)),
        replay: Some(ReplayCover {
            since: t(0),
            retained: BTreeSet::from([2]),
            read_at: t(10),
            finished: true,
        }),
        removal: None,
    });
    let mut b = Builder::new();
    for n in [2, 7] {
        b.delivered(n, UNORDERED, DEFAULT, None);
    }
    b.delivered(2, UNORDERED, S1, None);
    assert_eq!(kinds(&h, &b.world), ["lost"]);
    b.delivered(7, UNORDERED, S1, None);
    assert!(kinds(&h, &b.world).is_empty());
}

#[test]
fn an_action_outside_its_selection_and_a_run_that_did_not_drain_fail() {
    let (mut h, mut b) = clean();
    h.outside_selection.push(
        "dead-letters purge --subscriber s1: purged dead letters outside the selection: [3]".into(),
    );
    b.world.drained = false;
    assert_eq!(
        kinds(&h, &b.world),
        ["not drained", "operator action outside its selection"]
    );
}

#[test]
fn a_resolved_dead_letter_of_a_copy_a_removal_deleted_has_a_cause_an_open_one_does_not() {
    // s1 removed from the unordered topic while its copy of event 2 was in flight: the removal deleted the copy,
    // QStash later gave up on its message (the consumer refused it as late, 489: no dev-server fault).
    let (mut h, mut b) = clean();
    let gone = b
        .world
        .copies
        .iter()
        .find(|c| c.n == Some(2) && c.subscriber == SUBSCRIBERS[S1])
        .unwrap()
        .id;
    b.world.copies.retain(|c| c.id != gone);
    b.world.applied.retain(|a| a.outbox_id != gone);
    first_period(&mut h, UNORDERED, S1).removal = Some(Removal {
        start: t(2),
        end: Some(t(2) + Duration::milliseconds(100)),
        in_flight: [2].into(),
    });
    b.dead_letter(
        gone,
        2,
        S1,
        "QStash gave up after 1 attempt(s); last status 489",
        true,
    );
    assert_eq!(kinds(&h, &b.world), ["dead letter without a cause"]);
    // Recorded resolved (withdrawn), it has its cause.
    b.world.dead[0].resolved_at = Some(t(3));
    assert!(kinds(&h, &b.world).is_empty(), "{:?}", kinds(&h, &b.world));
    // Not when the removal did not find the event in flight.
    first_period(&mut h, UNORDERED, S1)
        .removal
        .as_mut()
        .unwrap()
        .in_flight
        .clear();
    assert_eq!(kinds(&h, &b.world), ["dead letter without a cause"]);
}

#[test]
fn an_event_replayed_by_a_later_subscription_may_be_applied_while_it_lasts() {
    // Seed 107 at 3 minutes: s1 removed at 10 s (event 5 written across it), added again at 12 s with a replay
    // that copied event 5, applied at 20 s, and that subscription removed at 30 s in its turn.
    let (mut h, mut b) = clean();
    h.written.push(Written {
        n: 5,
        start: t(9),
        end: t(10) + Duration::milliseconds(100),
        ..h.written[1].clone()
    });
    let first = first_period(&mut h, UNORDERED, S1);
    first.removal = Some(Removal {
        start: t(10),
        end: Some(t(11)),
        in_flight: BTreeSet::new(),
    });
    h.periods.push(Period {
        topic: UNORDERED,
        sub: S1,
        add_start: Some(t(12)),
        add_end: Some(t(13)),
        replay: Some(ReplayCover {
            since: t(5),
            retained: BTreeSet::from([5]),
            read_at: t(12),
            finished: true,
        }),
        removal: Some(Removal {
            start: t(30),
            end: Some(t(31)),
            in_flight: BTreeSet::new(),
        }),
    });
    b.delivered(5, UNORDERED, DEFAULT, None);
    let replayed = b.copy(5, UNORDERED, S1, true, false);
    b.apply(replayed, 5, UNORDERED, S1, None, 20);
    assert!(kinds(&h, &b.world).is_empty(), "{:?}", kinds(&h, &b.world));
    // Applied after that subscription ended too, without being in flight at its removal: a violation.
    b.world.applied.last_mut().unwrap().applied_at = t(40);
    assert_eq!(
        kinds(&h, &b.world),
        ["applied after its removal though not in flight"]
    );
    // Seed 113 (6 minutes): an event begun before the replay's `--from`, committed after it, so not in the
    // explorer's retained set; its copies' `created_at` came after the start, and the replay copied it. Applied
    // through that replayed copy, made during the later subscription: allowed. Through an older copy: not.
    b.world.applied.last_mut().unwrap().applied_at = t(20);
    let w = h.written.iter_mut().find(|w| w.n == 5).unwrap();
    (w.start, w.end) = (t(8), t(9) + Duration::milliseconds(500));
    let later = h.periods.last_mut().unwrap();
    later.removal = None;
    if let Some(r) = later.replay.as_mut() {
        (r.since, r.retained) = (t(9), BTreeSet::new());
    }
    b.world.copies.last_mut().unwrap().created_at = t(12) + Duration::milliseconds(500);
    assert!(kinds(&h, &b.world).is_empty(), "{:?}", kinds(&h, &b.world));
    b.world.copies.last_mut().unwrap().created_at = t(9);
    assert_eq!(
        kinds(&h, &b.world),
        ["applied after its removal though not in flight"]
    );
}

#[test]
fn a_no_destination_dead_letter_while_an_addition_has_not_returned_has_a_cause() {
    // Seed 111 at 3 minutes, after `add` learned to finish an earlier removal first: s1 is added again from 5 s
    // to 10 s (the addition waits with s1 still removed), and a relay dead-letters its copy "no destination" at 7 s.
    let (mut h, mut b) = clean();
    b.world
        .applied
        .retain(|a| !(a.n == 2 && a.subscriber == "s1"));
    let copy = b
        .world
        .copies
        .iter_mut()
        .find(|c| c.n == Some(2) && c.subscriber == "s1")
        .unwrap();
    copy.delivered_at = None;
    copy.dead_lettered_at = Some(t(7));
    let id = copy.id;
    let first = first_period(&mut h, UNORDERED, S1);
    first.removal = Some(Removal {
        start: t(2),
        end: None,
        in_flight: BTreeSet::from([2]),
    });
    h.periods.push(Period {
        topic: UNORDERED,
        sub: S1,
        add_start: Some(t(5)),
        add_end: Some(t(10)),
        replay: None,
        removal: None,
    });
    b.dead_letter(
        id,
        2,
        S1,
        "no destination: subscriber \"s1\" of topic x.unordered is not configured",
        true,
    );
    b.world.dead.last_mut().unwrap().created_at = t(7);
    assert!(
        kinds(&h, &b.world).is_empty(),
        "{:?}",
        check(&h, &b.world).violations
    );
    // Once the addition has returned, "no destination" has no cause.
    b.world.dead.last_mut().unwrap().created_at = t(11);
    assert!(kinds(&h, &b.world).contains(&"dead letter without a cause"));
}

#[test]
fn an_ordered_re_add_reaching_before_what_it_applied_may_be_refused_as_late() {
    // Seed 118 at 6 minutes: s1 removed at 3 s; event 7 (sequence 2) written at 5 s without a copy for it; s1 added
    // from then on at 6 s, applies event 8 (sequence 3) at 8 s, is removed at 9 s and added again at 10 s `--from`
    // 4 s: the replayed event 7 is refused as late by its consumer ("out of order") and dead-lettered. The consumer
    // keeps its order: a caused dead letter.
    let (mut h, mut b) = clean();
    first_period(&mut h, ORDERED, S1).removal = Some(Removal {
        start: t(3),
        end: Some(t(3)),
        in_flight: BTreeSet::new(),
    });
    for (n, at) in [(7, 5), (8, 7)] {
        h.written.push(Written {
            n,
            start: t(at),
            end: t(at) + Duration::milliseconds(10),
            ..h.written[0].clone()
        });
    }
    h.periods.push(Period {
        topic: ORDERED,
        sub: S1,
        add_start: Some(t(6)),
        add_end: Some(t(6)),
        replay: None,
        removal: Some(Removal {
            start: t(9),
            end: Some(t(9)),
            in_flight: BTreeSet::new(),
        }),
    });
    h.periods.push(Period {
        topic: ORDERED,
        sub: S1,
        add_start: Some(t(10)),
        add_end: Some(t(10)),
        replay: Some(ReplayCover {
            since: t(4),
            retained: BTreeSet::from([7]),
            read_at: t(10),
            finished: true,
        }),
        removal: None,
    });
    let d7 = b.copy(7, ORDERED, DEFAULT, true, false);
    b.apply(d7, 7, ORDERED, DEFAULT, Some(2), 5);
    let d8 = b.copy(8, ORDERED, DEFAULT, true, false);
    b.apply(d8, 8, ORDERED, DEFAULT, Some(3), 7);
    let s8 = b.copy(8, ORDERED, S1, true, false);
    b.apply(s8, 8, ORDERED, S1, Some(3), 8);
    let s7 = b.copy(7, ORDERED, S1, false, true);
    b.dead_letter(
        s7,
        7,
        S1,
        "QStash gave up after 1 attempt(s); last status 489; out of order: event has sequence 2 for key \"k1\"",
        true,
    );
    b.world.dead.last_mut().unwrap().created_at = t(12);
    assert!(kinds(&h, &b.world).is_empty(), "{:?}", kinds(&h, &b.world));
    // Sequence 3 applied after the re-add instead: live copies overtook the replayed one (seed 111's defect).
    b.world.applied.last_mut().unwrap().applied_at = t(11);
    assert!(
        kinds(&h, &b.world).contains(&"dead letter without a cause"),
        "{:?}",
        kinds(&h, &b.world)
    );
}
