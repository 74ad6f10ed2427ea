//! The timer heap's entries: every wait (delay, not-before, backoff, Retry-After, rate window) is one. The heap is
//! [`Core`](super::machine::Core)'s, and so are adding to it and firing what is due (`machine.rs`).

use std::sync::Arc;

use tokio::time::Instant;

#[derive(Debug)]
pub(super) enum TimerKind {
    Due(Arc<str>),
    FlowWindow(String),
}

pub(super) struct TimerEntry {
    pub(super) at: Instant,
    pub(super) seq: u64,
    pub(super) kind: TimerKind,
}

impl PartialEq for TimerEntry {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for TimerEntry {}
impl PartialOrd for TimerEntry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for TimerEntry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}
