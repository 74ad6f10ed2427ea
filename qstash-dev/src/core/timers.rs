//! The timer heap: every wait (delay, not-before, backoff, Retry-After, rate window) is one entry.

use std::cmp::Reverse;
use std::sync::Arc;

use tokio::time::Instant;

use super::{Core, Effects, MsgState};

#[derive(Debug)]
pub(super) enum TimerKind {
    Due(Arc<str>),
    FlowWindow(String),
}

pub(super) struct TimerEntry {
    at: Instant,
    seq: u64,
    kind: TimerKind,
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

impl Core {
    pub(super) fn add_timer(&mut self, at: Instant, kind: TimerKind, fx: &mut Effects) {
        if self.timers.peek().is_none_or(|Reverse(t)| at < t.at) {
            fx.wake_timer = true;
        }
        self.timer_seq += 1;
        self.timers.push(Reverse(TimerEntry {
            at,
            seq: self.timer_seq,
            kind,
        }));
    }

    /// Runs due timers; returns the next deadline.
    pub fn fire_timers(&mut self, now: Instant, fx: &mut Effects) -> Option<Instant> {
        while let Some(Reverse(top)) = self.timers.peek() {
            if top.at > now {
                break;
            }
            let Some(Reverse(entry)) = self.timers.pop() else {
                break;
            };
            match entry.kind {
                TimerKind::Due(id) => {
                    if matches!(self.msgs.get(&id), Some(m) if m.state == MsgState::Scheduled) {
                        self.make_due(&id, fx);
                    }
                }
                TimerKind::FlowWindow(key) => {
                    if let Some(f) = self.flows.get_mut(&key) {
                        f.window_armed = false;
                    }
                    self.pump_flow(&key, fx);
                }
            }
        }
        self.timers.peek().map(|Reverse(t)| t.at)
    }
}
