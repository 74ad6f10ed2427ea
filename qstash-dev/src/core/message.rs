//! A message's records (immutable data, live state), the deliveries handed to workers, and what goes in and out
//! of the core: a validated publish, its result, and the follow-up work of an operation.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method};

use crate::expr::RetryDelayExpr;
use crate::options::{CallbackSpec, FlowSpec, PublishOptions};
use crate::types::AttemptKind;

/// Immutable part of a message.
#[derive(Debug)]
pub(crate) struct MsgData {
    pub id: Arc<str>,
    pub kind: AttemptKind,
    pub url: String,
    pub method: Method,
    pub body: Bytes,
    pub content_type: Option<HeaderValue>,
    pub forward: Vec<(HeaderName, HeaderValue)>,
    pub max_retries: u32,
    pub retry_delay: Option<Arc<RetryDelayExpr>>,
    pub timeout: Option<Duration>,
    pub created_at_ms: u64,
    pub not_before_ms: u64,
    pub callback: Option<CallbackSpec>,
    pub failure_callback: Option<CallbackSpec>,
    pub flow: Option<FlowSpec>,
    pub queue: Option<String>,
    pub labels: Vec<String>,
    pub redact: Option<String>,
    pub caller_ip: Arc<str>,
    pub source_message_id: Option<Arc<str>>,
    /// The subject of this message's delivery fault draws (decision record 0114): derived from its identity
    /// (deduplication id or content) and how many messages with that identity came before, or from its parent's
    /// for callbacks and DLQ retries. Unlike `id`, the same in every run of the same workload.
    pub fault_id: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MsgState {
    /// Waiting for a timer (delay, not-before or retry backoff).
    Scheduled,
    /// In a queue's FIFO, waiting for a slot.
    WaitingQueue,
    /// In a flow-control key's waitlist.
    WaitingFlow,
    /// Handed to the worker pool.
    Ready,
}

pub(crate) struct Msg {
    pub data: Arc<MsgData>,
    pub retried: u32,
    pub extra_budget: u32,
    pub state: MsgState,
    pub hold: Option<u64>,
    pub planned_delay: Duration,
    pub cancel: Arc<AtomicBool>,
}

impl Msg {
    /// The delivery of its current attempt.
    pub fn job(&self) -> Job {
        Job {
            data: self.data.clone(),
            retried: self.retried,
            planned_delay: self.planned_delay,
            duplicate: false,
            cancel: self.cancel.clone(),
        }
    }
}

/// One delivery for the worker pool.
pub(crate) struct Job {
    pub data: Arc<MsgData>,
    pub retried: u32,
    pub planned_delay: Duration,
    pub duplicate: bool,
    pub cancel: Arc<AtomicBool>,
}

/// Follow-up work produced under the lock.
#[derive(Default)]
pub(crate) struct Effects {
    pub jobs: Vec<Job>,
    pub wake_timer: bool,
}

/// A message to publish (validated).
pub(crate) struct NewMessage {
    pub url: String,
    pub body: Bytes,
    pub opts: PublishOptions,
    pub queue: Option<String>,
    pub caller_ip: Arc<str>,
    /// [`message_identity`](super::dedup::message_identity) of the message (its publish request's fault
    /// key, and the root of its `fault_id`).
    pub identity: u64,
}

/// Result of one publish.
pub(crate) struct Accepted {
    pub message_id: Arc<str>,
    pub deduplicated: bool,
}
