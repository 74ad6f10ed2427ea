//! Claim triage: which claimed events are published this cycle. Pure: no I/O, no settings beyond the retry
//! budget.
//!
//! Attempts are counted at claim ([`super::claim`]), so an event whose count is already past the budget was
//! claimed before and never settled (the relay died mid-attempt): it is not published again but dead-lettered.
//! An ordered key's claimed run shares its head's fate:
//!
//! | claimed event | triage | why |
//! |---|---|---|
//! | unordered, attempts within the budget | [`Triage::publish`] | the ordinary case |
//! | unordered, attempts past the budget | [`Triage::exhausted`] | its budget went to claims that never settled |
//! | ordered head, attempts within the budget | [`Triage::publish`] | the ordinary case |
//! | ordered head, attempts past the budget | [`Triage::exhausted`] | as unordered: the key's dead head (blocking or skipped per policy) |
//! | follower of a head within the budget | [`Triage::publish`] | its budget is its head's: followers only ride along |
//! | follower of an exhausted head | [`Triage::held_back`] | it must not overtake its dead head: given back untouched |
//!
//! A run is the events of one key under one lease token (their [`crate::ids::KeyLease`]); its head is the run's
//! lowest sequence.

use std::collections::HashMap;

use super::claim::ClaimedEvent;
use crate::ids::KeyLease;

/// A claim split by what happens to each event this cycle (each list keeps the claim's order).
#[derive(Debug, Clone, Default)]
pub struct Triage {
    /// Published this cycle.
    pub publish: Vec<ClaimedEvent>,
    /// Past the retry budget without another publish: dead letters.
    pub exhausted: Vec<ClaimedEvent>,
    /// Followers of an exhausted ordered head: given back without a publish.
    pub held_back: Vec<ClaimedEvent>,
    /// Ordered runs (key leases) in the claim: the ordered claim's size is counted in keys.
    pub ordered_runs: usize,
    /// Copies for a subscriber that is not live ([`crate::subscribers`]): each unordered one and each lane's head
    /// is dead-lettered, the rest of a lane's run given back. Filled by the relay, which knows the subscribers.
    pub orphans: Vec<ClaimedEvent>,
}

/// Splits a claim (see the module docs) with `max_attempts` publish attempts per event.
pub fn triage(events: Vec<ClaimedEvent>, max_attempts: i32) -> Triage {
    // An ordered event's run is its key lease ([`ClaimedEvent::key_lease`]); its head is the run's lowest sequence.
    let leases: Vec<Option<KeyLease>> = events.iter().map(ClaimedEvent::key_lease).collect();
    let mut heads: HashMap<&KeyLease, i64> = HashMap::new();
    for (e, lease) in events.iter().zip(&leases) {
        if let (Some(seq), Some(lease)) = (e.seq, lease) {
            let h = heads.entry(lease).or_insert(seq);
            *h = (*h).min(seq);
        }
    }
    let is_head = |e: &ClaimedEvent, lease: &Option<KeyLease>| match (e.seq, lease) {
        (Some(seq), Some(lease)) => heads.get(lease) == Some(&seq),
        _ => true,
    };
    let spent_runs: Vec<&KeyLease> = events
        .iter()
        .zip(&leases)
        .filter(|(e, lease)| is_head(e, lease) && e.attempts > max_attempts)
        .filter_map(|(_, lease)| lease.as_ref())
        .collect();
    let fates: Vec<Fate> = events
        .iter()
        .zip(&leases)
        .map(|(e, lease)| {
            let head = is_head(e, lease);
            if head && e.attempts > max_attempts {
                Fate::Exhausted
            } else if !head && lease.as_ref().is_some_and(|l| spent_runs.contains(&l)) {
                Fate::HeldBack
            } else {
                Fate::Publish
            }
        })
        .collect();
    let mut out = Triage {
        ordered_runs: heads.len(),
        ..Triage::default()
    };
    for (e, fate) in events.into_iter().zip(fates) {
        match fate {
            Fate::Publish => out.publish.push(e),
            Fate::Exhausted => out.exhausted.push(e),
            Fate::HeldBack => out.held_back.push(e),
        }
    }
    out
}

enum Fate {
    Publish,
    Exhausted,
    HeldBack,
}

impl Triage {
    /// Every event, in the order the relay settles them: published, exhausted, held back (what the settle's
    /// statements follow; the tests check it).
    #[cfg(test)]
    pub(crate) fn in_settle_order(&self) -> impl Iterator<Item = &ClaimedEvent> {
        self.publish
            .iter()
            .chain(&self.exhausted)
            .chain(&self.held_back)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: i32 = 3;

    fn event(
        id: i64,
        key: &str,
        seq: Option<i64>,
        attempts: i32,
        lease_token: i64,
    ) -> ClaimedEvent {
        ClaimedEvent {
            attempts,
            ..ClaimedEvent::for_test(id, "t", key, seq, lease_token)
        }
    }

    fn ids(events: &[ClaimedEvent]) -> Vec<i64> {
        events.iter().map(|e| e.id.get()).collect()
    }

    #[test]
    fn unordered_events_are_published_until_their_budget_is_spent() {
        let t = triage(
            vec![
                event(1, "a", None, 1, 10),
                event(2, "a", None, MAX, 10),
                event(3, "b", None, MAX + 1, 10),
            ],
            MAX,
        );
        assert_eq!(
            ids(&t.publish),
            vec![1, 2],
            "the last attempt is still made"
        );
        assert_eq!(ids(&t.exhausted), vec![3]);
        assert!(t.held_back.is_empty());
        assert_eq!(t.ordered_runs, 0);
    }

    #[test]
    fn followers_ride_on_their_heads_budget() {
        // The followers' own counts are past the budget; their head's is not: the whole run goes out.
        let t = triage(
            vec![
                event(11, "k", Some(5), MAX, 7),
                event(12, "k", Some(6), MAX + 4, 7),
                event(13, "k", Some(7), MAX + 9, 7),
            ],
            MAX,
        );
        assert_eq!(ids(&t.publish), vec![11, 12, 13]);
        assert!(t.exhausted.is_empty() && t.held_back.is_empty());
        assert_eq!(t.ordered_runs, 1);
    }

    #[test]
    fn an_exhausted_head_is_a_dead_letter_and_its_followers_are_held_back() {
        // The claim need not come in sequence order: the head is the run's lowest sequence.
        let t = triage(
            vec![
                event(12, "k", Some(6), 1, 7),
                event(11, "k", Some(5), MAX + 1, 7),
                event(13, "k", Some(7), 1, 7),
            ],
            MAX,
        );
        assert!(t.publish.is_empty());
        assert_eq!(ids(&t.exhausted), vec![11]);
        assert_eq!(ids(&t.held_back), vec![12, 13]);
        assert_eq!(t.ordered_runs, 1);
    }

    #[test]
    fn runs_are_told_apart_by_key_topic_and_lease() {
        let mut other_topic = event(31, "k", Some(6), 1, 7);
        other_topic.topic = "u".into();
        let t = triage(
            vec![
                event(11, "k", Some(5), MAX + 1, 7),
                event(12, "k", Some(6), 1, 7),
                // Same key, another lease: another run whose head (seq 6) is within budget.
                event(21, "k", Some(6), 1, 8),
                // Same key and lease on another topic: its own head.
                other_topic,
                event(41, "j", Some(6), 1, 7),
                event(51, "u", None, MAX + 1, 0),
            ],
            MAX,
        );
        assert_eq!(ids(&t.publish), vec![21, 31, 41]);
        assert_eq!(ids(&t.exhausted), vec![11, 51]);
        assert_eq!(ids(&t.held_back), vec![12]);
        assert_eq!(t.ordered_runs, 4);
        let order: Vec<i64> = t.in_settle_order().map(|e| e.id.get()).collect();
        assert_eq!(order, vec![21, 31, 41, 11, 51, 12]);
    }

    #[test]
    fn an_empty_claim_triages_to_nothing() {
        let t = triage(Vec::new(), MAX);
        assert!(t.publish.is_empty() && t.exhausted.is_empty() && t.held_back.is_empty());
        assert_eq!(t.ordered_runs, 0);
    }
}
