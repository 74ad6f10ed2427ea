//! [`StopHandle`]: asks a relay's drains to stop after their current cycle (the local pipeline's Ctrl-C).

use std::sync::Arc;
use std::sync::atomic::Ordering as AtomicOrdering;

use tokio::sync::Notify;

/// The flag behind [`StopHandle`], shared by the relay and its handles.
#[derive(Default)]
pub(super) struct StopSignal {
    pub(super) flag: std::sync::atomic::AtomicBool,
    pub(super) notify: Notify,
}

impl StopSignal {
    pub(super) fn requested(&self) -> bool {
        self.flag.load(AtomicOrdering::SeqCst)
    }
}

/// Asks a [`Relay`]'s drains to stop after their current cycle.
#[derive(Clone)]
pub struct StopHandle(pub(super) Arc<StopSignal>);

impl StopHandle {
    /// Requests the stop (idempotent).
    pub fn stop(&self) {
        self.0.flag.store(true, AtomicOrdering::SeqCst);
        self.0.notify.notify_waiters();
    }

    /// Whether a stop was requested.
    pub fn is_stopped(&self) -> bool {
        self.0.requested()
    }
}
