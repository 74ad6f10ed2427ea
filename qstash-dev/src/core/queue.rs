//! Queues: a FIFO with a parallelism limit. A message holds a slot ("hold") until it and the callbacks it
//! spawned are done.

use std::collections::VecDeque;
use std::sync::Arc;

use super::{Core, Effects};

pub(crate) struct Queue {
    pub name: String,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    pub parallelism: u32,
    pub paused: bool,
    pub waitlist: VecDeque<Arc<str>>,
    pub active: u32,
}

pub(super) struct Hold {
    queue: String,
    pub(super) count: u32,
}

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
}
