//! The message state machine: publish, dedup, delay, queues, flow control, retries, callbacks, DLQ.
//!
//! Everything here runs under one mutex and never awaits. Operations report follow-up work in [`Effects`]
//! (deliveries to start, whether the timer task must re-check its deadline); the caller applies them after
//! releasing the lock. Pending messages cost only their record: waits are entries in one timer heap, and HTTP
//! requests are made by a fixed pool of workers (see `deliver.rs`).

mod callbacks;
mod clock;
mod counters;
mod dedup;
mod dlq;
mod dlq_entry;
mod flow;
mod headers;
mod ids;
mod machine;
mod message;
mod outcome;
mod queue;
mod settings;
mod timers;
mod waitlists;

// What the rest of the crate uses.
pub(crate) use self::clock::now_ms;
pub(crate) use self::counters::Counters;
pub(crate) use self::dedup::message_identity;
pub(crate) use self::dlq_entry::{DlqEntry, parse_dlq_id};
pub(crate) use self::flow::Flow;
pub(crate) use self::headers::{header_multimap, headermap_multimap};
pub(crate) use self::machine::Core;
pub(crate) use self::message::{Accepted, Effects, Job, MsgData, NewMessage};
pub(crate) use self::outcome::{Outcome, RETRY_AFTER_MAX};
pub(crate) use self::queue::Queue;
