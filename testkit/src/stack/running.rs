//! A running local pipeline ([`LocalStack`]): what it holds, the switches that take a receiver down, what it
//! recorded, the relay's figures, the wait until it is quiet, and its stop.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox::relay::{InvocationSummary, RelayState};
use outbox::relay::{Relay, StopHandle};
use qstash_dev::DevServer;
use sqlx::PgPool;
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;

use super::recording::{RecordedRequest, Recorder};

/// A named subscriber's consumer as started.
pub(super) struct LocalSubscriber {
    pub(super) name: String,
    pub(super) url: String,
    pub(super) down: Arc<AtomicBool>,
}

/// A running local pipeline.
pub struct LocalStack {
    /// A pool for producers, status queries and tests.
    pub pool: PgPool,
    /// The dev server.
    pub dev: DevServer,
    /// Where QStash delivers events (`{consumer_url}/events/{topic}`).
    pub consumer_url: String,
    /// Where QStash sends callbacks (`/failure`, `/delivered`).
    pub callback_url: String,
    pub(super) relay_state: Arc<RelayState>,
    pub(super) relay_stop: StopHandle,
    pub(super) relay_task: Mutex<Option<JoinHandle<()>>>,
    pub(super) last_summary: Arc<std::sync::Mutex<Option<InvocationSummary>>>,
    pub(super) shutdown: watch::Sender<bool>,
    pub(super) servers: Vec<JoinHandle<std::io::Result<()>>>,
    pub(super) recorded: Option<Recorder>,
    pub(super) callbacks_down: Arc<AtomicBool>,
    pub(super) subscribers: Vec<LocalSubscriber>,
}

impl LocalStack {
    /// A named subscriber's base URL ([`StackOptions::subscribers`](crate::stack::StackOptions::subscribers)).
    pub fn subscriber_url(&self, name: &str) -> Option<&str> {
        self.subscribers
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.url.as_str())
    }

    /// Takes a named subscriber's consumer down (every delivery answered 503 without reaching it, as a consumer
    /// whose database is out would) or brings it back. False when there is no such subscriber.
    pub fn set_subscriber_down(&self, name: &str, down: bool) -> bool {
        match self.subscribers.iter().find(|s| s.name == name) {
            Some(s) => {
                s.down.store(down, Ordering::SeqCst);
                true
            }
            None => false,
        }
    }

    /// Every request the consumer and the callback receiver got so far, in arrival order of their answers
    /// (empty unless [`StackOptions::record_requests`](crate::stack::StackOptions::record_requests)).
    pub fn recorded_requests(&self) -> Vec<RecordedRequest> {
        self.recorded
            .as_ref()
            .and_then(|r| r.lock().ok().map(|r| r.clone()))
            .unwrap_or_default()
    }

    /// Takes the callback receiver down (every request answered 503, as a throttled or failing callback
    /// function would) or brings it back.
    pub fn set_callbacks_down(&self, down: bool) {
        self.callbacks_down.store(down, Ordering::SeqCst);
    }

    /// The relay (for status figures).
    pub fn relay(&self) -> &Relay {
        &self.relay_state.relay
    }

    /// The summary of the last finished simulated invocation.
    pub fn last_invocation(&self) -> Option<InvocationSummary> {
        self.last_summary.lock().ok().and_then(|l| l.clone())
    }

    /// Waits until nothing is pending or awaiting evidence in the outbox and the dev server has nothing
    /// scheduled or in flight. Returns false on timeout.
    pub async fn wait_quiet(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let empty = self.relay().is_empty().await.unwrap_or(false);
            if empty && self.dev.handle().is_idle() {
                // Idle twice in a row: a callback may be between the dev server and the database.
                tokio::time::sleep(Duration::from_millis(100)).await;
                if self.relay().is_empty().await.unwrap_or(false) && self.dev.handle().is_idle() {
                    return true;
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the relay after its current cycle (every claim settled), then the listeners and the dev server.
    pub async fn stop(self) {
        self.relay_stop.stop();
        if let Some(t) = self.relay_task.lock().await.take() {
            let _ = t.await;
        }
        self.dev.shutdown().await;
        let _ = self.shutdown.send(true);
        for s in self.servers {
            let _ = s.await;
        }
    }
}
