//! What a soak run counts as it goes: kills, restarts, events written.

use std::sync::atomic::AtomicU64;

/// Counters shared by the chaos loop and the report.
#[derive(Default)]
pub(crate) struct Counts {
    pub(crate) relay_kills: AtomicU64,
    pub(crate) consumer_kills: AtomicU64,
    pub(crate) callback_kills: AtomicU64,
    pub(crate) backend_kills: AtomicU64,
    pub(crate) restarts: AtomicU64,
    pub(crate) worker_exits: AtomicU64,
    pub(crate) pg_restarts: AtomicU64,
    pub(crate) written: AtomicU64,
}
