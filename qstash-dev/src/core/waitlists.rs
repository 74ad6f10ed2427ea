//! Moving messages through the waitlists as slots free up: a queue's (FIFO, within its parallelism) and a
//! flow-control key's (within its parallelism and rate, in the configured order).

use rand::Rng;
use tokio::time::Instant;

use super::clock::now_ms;
use super::machine::Core;
use super::message::{Effects, MsgState};
use super::queue::Hold;
use super::timers::TimerKind;
use crate::config::WaitlistOrder;

impl Core {
    pub fn pump_queue(&mut self, name: &str, fx: &mut Effects) {
        loop {
            let Some(q) = self.queues.get_mut(name) else {
                return;
            };
            if q.paused || q.active >= q.parallelism {
                return;
            }
            let Some(id) = q.waitlist.pop_front() else {
                return;
            };
            let Some(msg) = self.msgs.get_mut(&id) else {
                continue;
            };
            q.active += 1;
            self.hold_seq += 1;
            let h = self.hold_seq;
            self.holds.insert(
                h,
                Hold {
                    queue: name.to_string(),
                    count: 1,
                },
            );
            msg.hold = Some(h);
            self.after_queue(&id, fx);
        }
    }

    pub(super) fn release_hold(&mut self, h: u64, fx: &mut Effects) {
        let Some(hold) = self.holds.get_mut(&h) else {
            return;
        };
        hold.count = hold.count.saturating_sub(1);
        if hold.count > 0 {
            return;
        }
        let queue = hold.queue.clone();
        self.holds.remove(&h);
        if let Some(q) = self.queues.get_mut(&queue) {
            q.active = q.active.saturating_sub(1);
        }
        self.pump_queue(&queue, fx);
    }

    pub fn pump_flow(&mut self, key: &str, fx: &mut Effects) {
        let order = self.settings.waitlist_order;
        loop {
            let Some(flow) = self.flows.get_mut(key) else {
                return;
            };
            if flow.paused || flow.waitlist.is_empty() {
                return;
            }
            if let Some(p) = flow.effective_parallelism()
                && flow.active >= p
            {
                return;
            }
            let rate = flow.effective_rate();
            if let Some((limit, period)) = rate {
                let period = self.settings.scaled(period);
                let now = Instant::now();
                let expired = match flow.window_start {
                    None => true,
                    Some(start) => now >= start + period,
                };
                if expired {
                    flow.window_start = Some(now);
                    flow.window_start_ms = now_ms();
                    flow.window_count = 0;
                }
                if flow.window_count >= limit {
                    if !flow.window_armed {
                        flow.window_armed = true;
                        let at = flow.window_start.unwrap_or(now) + period;
                        let k = key.to_string();
                        self.add_timer(at, TimerKind::FlowWindow(k), fx);
                    }
                    return;
                }
            }
            let Some(flow) = self.flows.get_mut(key) else {
                return;
            };
            let idx = match order {
                WaitlistOrder::Fifo => 0,
                WaitlistOrder::Shuffled => self.rng.random_range(0..flow.waitlist.len()),
            };
            let Some(id) = flow.waitlist.remove(idx) else {
                return;
            };
            let Some(msg) = self.msgs.get_mut(&id) else {
                continue;
            };
            flow.active += 1;
            if rate.is_some() {
                flow.window_count += 1;
            }
            msg.state = MsgState::Ready;
            fx.jobs.push(msg.job());
        }
    }
}
