//! The settings the core reads, copied from the [`Config`].

use std::time::Duration;

use super::clock::MAX_WAIT;
use crate::config::{Config, TimestampFormat, WaitlistOrder};

/// Settings the core reads (copied from [`Config`]).
pub(crate) struct Settings {
    pub time_scale: f64,
    pub default_retries: u32,
    pub max_retries: u32,
    pub waitlist_order: WaitlistOrder,
    pub deliver: bool,
    pub retry_after_consumes_retry: bool,
    pub callback_timestamps: TimestampFormat,
    pub dlq_retention: Duration,
    pub dedup_window: Duration,
}

impl Settings {
    pub fn from_config(c: &Config) -> Settings {
        Settings {
            time_scale: c.time_scale,
            default_retries: c.default_retries,
            max_retries: c.max_retries,
            waitlist_order: c.waitlist_order,
            deliver: c.deliver,
            retry_after_consumes_retry: c.retry_after_consumes_retry,
            callback_timestamps: c.callback_timestamps,
            dlq_retention: c.dlq_retention,
            dedup_window: c.dedup_window,
        }
    }

    pub fn scaled(&self, d: Duration) -> Duration {
        let d = d.min(MAX_WAIT);
        Duration::try_from_secs_f64(d.as_secs_f64() * self.time_scale)
            .unwrap_or(MAX_WAIT)
            .min(MAX_WAIT)
    }
}
