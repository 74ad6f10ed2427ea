//! Counters, reported as [`crate::Stats`].

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters shared between the core and the HTTP layer.
#[derive(Default)]
pub(crate) struct Counters {
    pub publish_requests: AtomicU64,
    pub accepted: AtomicU64,
    pub deduplicated: AtomicU64,
    pub rejected: AtomicU64,
    pub delivered: AtomicU64,
    pub failed_to_dlq: AtomicU64,
    pub attempts: AtomicU64,
    pub callbacks_created: AtomicU64,
    pub cancelled: AtomicU64,
    pub duplicate_deliveries: AtomicU64,
    pub injected_publish_errors: AtomicU64,
    pub injected_dropped_responses: AtomicU64,
    pub injected_lost_messages: AtomicU64,
    pub publish_bytes: AtomicU64,
    pub api_requests: AtomicU64,
    pub retries: AtomicU64,
    pub callback_attempts: AtomicU64,
}

impl Counters {
    pub fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
    pub fn reset(&self) {
        for c in [
            &self.publish_requests,
            &self.accepted,
            &self.deduplicated,
            &self.rejected,
            &self.delivered,
            &self.failed_to_dlq,
            &self.attempts,
            &self.callbacks_created,
            &self.cancelled,
            &self.duplicate_deliveries,
            &self.injected_publish_errors,
            &self.injected_dropped_responses,
            &self.injected_lost_messages,
            &self.publish_bytes,
            &self.api_requests,
            &self.retries,
            &self.callback_attempts,
        ] {
            c.store(0, Ordering::Relaxed);
        }
    }
}
