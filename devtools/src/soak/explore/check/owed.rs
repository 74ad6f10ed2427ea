//! Whether an event is owed to a subscriber ([`Owed`]), from the subscriber's periods on the event's topic alone;
//! and the one refusal an owed event's dead letter may have for a cause: the consumer keeping its order.

use super::world::{DeadRow, World};
use crate::soak::explore::history::{Period, Written};
use crate::soak::explore::schedule::TOPICS;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Owed {
    Must,
    May,
    No,
}

/// Whether `e` is owed to the subscriber of `periods` (all its periods on `e`'s topic).
pub(super) fn owed(e: &Written, periods: &[&Period]) -> Owed {
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
pub(super) fn refused_in_order(
    d: &DeadRow,
    n: u64,
    e: &Written,
    ps: &[&Period],
    world: &World,
) -> bool {
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
