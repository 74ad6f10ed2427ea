//! Queues: a FIFO with a parallelism limit. A message holds a slot ("hold") until it and the callbacks it
//! spawned are done. Moving messages through the waitlist is [`Core`](super::machine::Core)'s (`waitlists.rs`).

use std::collections::VecDeque;
use std::sync::Arc;

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
    pub(super) queue: String,
    pub(super) count: u32,
}
