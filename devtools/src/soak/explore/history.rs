//! What the explorer itself saw happen, with wall-clock times (the database's clock is the same machine's): every
//! producer transaction, every subscription period (added when, replaying what, removed when, with what in
//! flight), every operator action and fault with its outcome, every cure. The checker ([`super::check`]) reads
//! this beside what the database and the dev server hold, and never the library's own idea of what should be.

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};
use serde::Serialize;

/// One producer transaction's events (an event per number: a transaction whose commit answer was lost is retried
/// with new numbers, so a number names at most one event).
#[derive(Debug, Clone, Serialize)]
pub struct Written {
    pub n: u64,
    pub topic: usize,
    pub key: u32,
    /// The subscribers whose consumer rejects it until cured ([`super::schedule::SUBSCRIBERS`] indexes).
    pub poison_for: Vec<usize>,
    pub delayed: bool,
    /// Before `BEGIN`.
    pub start: DateTime<Utc>,
    /// After the commit's answer (or the error).
    pub end: DateTime<Utc>,
    /// `Some(true)`: committed; `Some(false)`: failed before the commit; `None`: the commit's answer was lost.
    pub committed: Option<bool>,
}

/// A replay that a subscription period includes (`add --from`).
#[derive(Debug, Clone, Serialize)]
pub struct ReplayCover {
    /// The `--from` time.
    pub since: DateTime<Utc>,
    /// The events of the topic written at or after `since` that the outbox retained (any copy) when the replay was
    /// last called (read before each call: the first, each resume); with those written at or after `since` and
    /// committed after that read ([`Self::read_at`]), what it must deliver.
    pub retained: BTreeSet<u64>,
    /// When `retained` was last read.
    pub read_at: DateTime<Utc>,
    /// The last call of the replay finished it.
    pub finished: bool,
}

/// A removal (`subscribers remove`).
#[derive(Debug, Clone, Serialize)]
pub struct Removal {
    /// When the command started.
    pub start: DateTime<Utc>,
    /// When a call of it returned with its copies deleted (`None`: not finished).
    pub end: Option<DateTime<Utc>>,
    /// The events that had an unfinished copy for the subscriber just before the command.
    pub in_flight: BTreeSet<u64>,
}

/// A subscriber on a topic, from its addition to its removal.
#[derive(Debug, Clone, Serialize)]
pub struct Period {
    pub topic: usize,
    pub sub: usize,
    /// When `add` started (`None`: subscribed before any traffic).
    pub add_start: Option<DateTime<Utc>>,
    /// When `add` returned (its subscription was committed by then).
    pub add_end: Option<DateTime<Utc>>,
    pub replay: Option<ReplayCover>,
    pub removal: Option<Removal>,
}

/// What an action or a fault came to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Outcome {
    Done(String),
    /// Refused with a clear error, nothing changed (a filter that matched nothing is `Done`).
    Refused(String),
    /// Failed (Postgres down, …); retried or finished later when it says so.
    Failed(String),
}

/// One operator action or fault as it ran.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    /// Index of its step in the schedule (`None`: a follow-up the operator ran, like finishing a removal).
    pub step: Option<usize>,
    pub what: String,
    pub kind: String,
    pub start: DateTime<Utc>,
    pub end: DateTime<Utc>,
    pub outcome: Outcome,
}

/// Everything the explorer saw.
#[derive(Debug, Default, Serialize)]
pub struct History {
    pub written: Vec<Written>,
    pub periods: Vec<Period>,
    pub records: Vec<Record>,
    /// `(when, every poison event numbered up to this is accepted from then on)`.
    pub cures: Vec<(DateTime<Utc>, u64)>,
    /// The (event number, subscriber name) of each dead letter a purge deleted.
    pub purged: BTreeSet<(u64, String)>,
    /// The (event number, subscriber name) of each dead letter a redrive redrove, with when that redrive started:
    /// kept here because a prune may delete the redriven dead letter before the run ends.
    pub redriven: Vec<(u64, String, DateTime<Utc>)>,
    /// An operator action changed a row outside its selection (found when it ran).
    pub outside_selection: Vec<String>,
}

impl History {
    /// The periods of subscriber `sub` on `topic`.
    pub fn periods_of(&self, topic: usize, sub: usize) -> impl Iterator<Item = &Period> {
        self.periods
            .iter()
            .filter(move |p| p.topic == topic && p.sub == sub)
    }

    /// The open period (not removed) of `sub` on `topic`.
    pub fn open_period(&mut self, topic: usize, sub: usize) -> Option<&mut Period> {
        self.periods
            .iter_mut()
            .rev()
            .find(|p| p.topic == topic && p.sub == sub && p.removal.is_none())
    }

    /// The last removal's start of `sub` on `topic`.
    pub fn last_removal(&self, topic: usize, sub: usize) -> Option<DateTime<Utc>> {
        self.periods_of(topic, sub)
            .filter_map(|p| p.removal.as_ref().map(|r| r.start))
            .max()
    }
}
