//! Time as the core counts it: now in Unix milliseconds, and the longest wait it schedules.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Longest wait we schedule (keeps `Instant` arithmetic far from overflow).
pub(super) const MAX_WAIT: Duration = Duration::from_secs(400 * 86_400);

pub(crate) fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

pub(crate) fn now_ms() -> u64 {
    unix_ms(SystemTime::now())
}
