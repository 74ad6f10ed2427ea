//! What the server's tasks and handlers share: [`Shared`] (the core behind its mutex, the job queue, the attempt
//! log, fault settings, signing keys, idle notifications) and the per-connection [`ConnCtx`].
//!
//! It knows neither the routers nor how deliveries are made: `api`, `inspect` and `deliver` use it, `server`
//! creates it.

mod attempts;
mod jobs;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use tokio::sync::Notify;

use crate::config::{Config, Faults};
use crate::core::{Core, Counters, Effects, Job, Outcome};
use crate::draw::{FaultKind, Occurrences, uniform};
use crate::types::{AttemptKind, DeliveryAttempt, DlqEntryInfo, Stats};

pub(crate) use self::attempts::AttemptRec;

use self::attempts::AttemptLog;
use self::jobs::JobQueue;

/// `wait_idle` gave up.
#[derive(Debug, thiserror::Error)]
#[error("qstash-dev not idle after {timeout:?}: {stats:?}")]
pub struct WaitIdleTimeout {
    /// How long it waited.
    pub timeout: Duration,
    /// Stats at the time.
    pub stats: Stats,
}

/// The current and next signing keys.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SigningKeys {
    /// Signs deliveries.
    pub current: String,
    /// Accepted by receivers as the fallback.
    pub next: String,
}

struct FaultState {
    faults: Faults,
    /// How many publish requests with each key arrived while a publish fault was configured (the `n` of their
    /// draws, so that a client's retry of a failed request draws afresh).
    requests: Occurrences,
}

/// Publish request keys whose count is kept (see [`Occurrences`]).
const REQUEST_KEYS_KEPT: usize = 1 << 18;

/// The publish-side fault decisions for one request.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PublishDraw {
    /// Answer 500, store nothing.
    pub fail_5xx: bool,
    /// Process, then close the connection without a response.
    pub drop_response: bool,
}

/// Per-connection context handed to handlers (peer and local address; a switch that drops the connection).
#[derive(Clone)]
pub(crate) struct ConnCtx {
    pub peer: SocketAddr,
    /// The address this connection arrived on (the concrete one when bound to 0.0.0.0 or ::).
    pub local: SocketAddr,
    pub kill: Arc<Notify>,
}

pub(crate) struct Shared {
    pub cfg: Config,
    core: Mutex<Core>,
    pub counters: Arc<Counters>,
    pub jobs: JobQueue,
    attempts: Mutex<AttemptLog>,
    /// Messages lost on purpose (`Faults::message_loss_rate`), for `/__dev/lost`.
    lost: Mutex<Vec<Arc<str>>>,
    faults: Mutex<FaultState>,
    delivery_faults: std::sync::atomic::AtomicBool,
    /// The current key as a cheaply cloneable string (signing happens on every attempt).
    key_cache: Mutex<Arc<str>>,
    keys: RwLock<SigningKeys>,
    pub region_header: Option<http::HeaderValue>,
    pub started: std::time::Instant,
    /// Woken when an operation adds a deadline earlier than the timer task is sleeping until.
    pub timer_wake: Notify,
    idle: Notify,
    /// The address the listener is bound to (port resolved).
    pub bound: SocketAddr,
    pub base_url: String,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    pub fn new(cfg: Config, bound: SocketAddr) -> Shared {
        let counters = Arc::new(Counters::default());
        Shared {
            core: Mutex::new(Core::new(&cfg, counters.clone())),
            counters,
            jobs: JobQueue::new(),
            attempts: Mutex::new(AttemptLog {
                buf: VecDeque::new(),
                seq: 0,
            }),
            lost: Mutex::new(Vec::new()),
            faults: Mutex::new(FaultState {
                faults: cfg.faults.clone(),
                requests: Occurrences::new(REQUEST_KEYS_KEPT),
            }),
            delivery_faults: std::sync::atomic::AtomicBool::new(Self::has_delivery_faults(
                &cfg.faults,
            )),
            key_cache: Mutex::new(Arc::from(cfg.current_signing_key.as_str())),
            keys: RwLock::new(SigningKeys {
                current: cfg.current_signing_key.clone(),
                next: cfg.next_signing_key.clone(),
            }),
            region_header: cfg
                .region
                .as_deref()
                .and_then(|r| http::HeaderValue::from_str(r).ok()),
            started: std::time::Instant::now(),
            timer_wake: Notify::new(),
            idle: Notify::new(),
            bound,
            base_url: format!("http://{bound}"),
            cfg,
        }
    }

    pub fn core(&self) -> MutexGuard<'_, Core> {
        lock(&self.core)
    }

    /// Applies effects produced under the core lock (call after releasing it).
    pub fn apply(&self, fx: Effects) {
        self.jobs.push_all(fx.jobs);
        if fx.wake_timer {
            self.timer_wake.notify_one();
        }
        self.idle_changed();
    }

    /// Runs `f` on the core and applies its effects.
    pub fn with_core<R>(&self, f: impl FnOnce(&mut Core, &mut Effects) -> R) -> R {
        let mut fx = Effects::default();
        let r = {
            let mut core = self.core();
            f(&mut core, &mut fx)
        };
        self.apply(fx);
        r
    }

    pub fn complete(&self, job: &Job, outcome: Outcome, duplicate: bool) {
        self.with_core(|core, fx| core.on_done(job, outcome, duplicate, fx));
    }

    pub fn idle_changed(&self) {
        self.idle.notify_waiters();
    }

    /// Notes a message lost on purpose (`Faults::message_loss_rate`).
    pub fn note_lost(&self, id: &Arc<str>) {
        Counters::inc(&self.counters.injected_lost_messages);
        tracing::debug!(message_id = %id, "injected fault: message lost");
        lock(&self.lost).push(id.clone());
    }

    /// The ids of the messages lost on purpose, oldest first.
    pub fn lost_messages(&self) -> Vec<Arc<str>> {
        lock(&self.lost).clone()
    }

    pub fn record_attempt(&self, mut a: AttemptRec) {
        Counters::inc(&self.counters.attempts);
        if a.retried > 0 && !a.duplicate {
            Counters::inc(&self.counters.retries);
        }
        if a.data.kind != AttemptKind::Destination {
            Counters::inc(&self.counters.callback_attempts);
        }
        tracing::debug!(
            message_id = %a.data.id, url = %a.data.url, retried = a.retried, status = ?a.status,
            error = ?a.error, kind = ?a.data.kind, "delivery attempt"
        );
        let cap = self.cfg.attempt_log_capacity;
        if cap == 0 {
            return;
        }
        let mut log = lock(&self.attempts);
        log.seq += 1;
        a.seq = log.seq;
        if log.buf.len() >= cap {
            log.buf.pop_front();
        }
        log.buf.push_back(a);
    }

    /// Draws one delivery fault decision about message `fault_id`, try `n` (decision record 0114).
    pub fn draw_delivery(&self, kind: FaultKind, fault_id: u64, n: u64) -> bool {
        let p = {
            let st = lock(&self.faults);
            match kind {
                FaultKind::DeliveryNetworkError => st.faults.delivery_network_error_rate,
                FaultKind::DeliveryLostResponse => st.faults.delivery_lost_response_rate,
                FaultKind::DuplicateDelivery => st.faults.duplicate_delivery_rate,
                FaultKind::MessageLoss => st.faults.message_loss_rate,
                FaultKind::Publish5xx | FaultKind::PublishDropResponse => 0.0,
            }
        };
        p > 0.0 && uniform(self.cfg.seed, kind, fault_id, n) < p
    }

    /// Draws the publish faults of a request with this key: the `n`-th request with the key draws with `n`, so
    /// a retry draws afresh and the same sequence of requests draws the same way in every run (0114).
    pub fn draw_publish(&self, key: u64) -> PublishDraw {
        let mut st = lock(&self.faults);
        let (p5xx, pdrop) = (
            st.faults.publish_5xx_rate,
            st.faults.publish_drop_response_rate,
        );
        if p5xx <= 0.0 && pdrop <= 0.0 {
            return PublishDraw::default();
        }
        let n = u64::from(st.requests.next(key));
        drop(st);
        let seed = self.cfg.seed;
        let fail_5xx = p5xx > 0.0 && uniform(seed, FaultKind::Publish5xx, key, n) < p5xx;
        PublishDraw {
            fail_5xx,
            drop_response: !fail_5xx
                && pdrop > 0.0
                && uniform(seed, FaultKind::PublishDropResponse, key, n) < pdrop,
        }
    }

    pub fn faults(&self) -> Faults {
        lock(&self.faults).faults.clone()
    }

    fn has_delivery_faults(f: &Faults) -> bool {
        f.duplicate_delivery_rate > 0.0
            || f.delivery_network_error_rate > 0.0
            || f.delivery_lost_response_rate > 0.0
            || f.message_loss_rate > 0.0
    }

    /// Fast check so deliveries skip the fault lock when no delivery fault is configured.
    pub fn delivery_faults_active(&self) -> bool {
        self.delivery_faults.load(Ordering::Relaxed)
    }

    pub fn set_faults(&self, f: Faults) -> Result<(), String> {
        f.validate()?;
        self.delivery_faults
            .store(Self::has_delivery_faults(&f), Ordering::Relaxed);
        lock(&self.faults).faults = f;
        Ok(())
    }

    pub fn current_key(&self) -> Arc<str> {
        lock(&self.key_cache).clone()
    }

    pub fn signing_keys(&self) -> SigningKeys {
        self.keys.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn rotate_keys(&self) -> SigningKeys {
        let mut k = self.keys.write().unwrap_or_else(|e| e.into_inner());
        let fresh = format!("sig_{}", &crate::sign::new_jti()[4..]);
        k.current = std::mem::replace(&mut k.next, fresh);
        *lock(&self.key_cache) = Arc::from(k.current.as_str());
        k.clone()
    }

    pub fn attempts(&self) -> Vec<DeliveryAttempt> {
        let log = lock(&self.attempts);
        log.buf.iter().map(AttemptRec::view).collect()
    }

    pub fn attempts_for(&self, message_id: &str) -> Vec<DeliveryAttempt> {
        let log = lock(&self.attempts);
        log.buf
            .iter()
            .filter(|a| &*a.data.id == message_id)
            .map(AttemptRec::view)
            .collect()
    }

    pub fn clear_attempts(&self) {
        lock(&self.attempts).buf.clear();
    }

    pub fn stats(&self) -> Stats {
        let (waiting_core, dlq_size) = {
            let core = self.core();
            (core.counts().1, core.dlq.len())
        };
        let (queued, in_flight) = self.jobs.load();
        let c = &self.counters;
        let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        Stats {
            publish_requests: g(&c.publish_requests),
            accepted: g(&c.accepted),
            deduplicated: g(&c.deduplicated),
            rejected: g(&c.rejected),
            delivered: g(&c.delivered),
            failed_to_dlq: g(&c.failed_to_dlq),
            attempts: g(&c.attempts),
            callbacks_created: g(&c.callbacks_created),
            cancelled: g(&c.cancelled),
            duplicate_deliveries: g(&c.duplicate_deliveries),
            injected_publish_errors: g(&c.injected_publish_errors),
            injected_dropped_responses: g(&c.injected_dropped_responses),
            injected_lost_messages: g(&c.injected_lost_messages),
            publish_bytes: g(&c.publish_bytes),
            api_requests: g(&c.api_requests),
            retries: g(&c.retries),
            callback_attempts: g(&c.callback_attempts),
            in_flight: in_flight as u64,
            waiting: (waiting_core + queued) as u64,
            dlq_size: dlq_size as u64,
        }
    }

    pub fn is_idle(&self) -> bool {
        let live = self.core().msgs.len();
        if live > 0 {
            return false;
        }
        let (queued, in_flight) = self.jobs.load();
        queued == 0 && in_flight == 0
    }

    pub async fn wait_idle(&self, timeout: Duration) -> Result<(), WaitIdleTimeout> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_idle() {
                return Ok(());
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline) => {
                    if self.is_idle() {
                        return Ok(());
                    }
                    return Err(WaitIdleTimeout { timeout, stats: self.stats() });
                }
            }
        }
    }

    pub fn reset(&self) {
        self.jobs.clear();
        self.core().reset(self.cfg.seed);
        self.clear_attempts();
        lock(&self.lost).clear();
        self.counters.reset();
        lock(&self.faults).requests.clear();
        self.idle_changed();
    }

    pub fn dlq_entries(&self) -> Vec<DlqEntryInfo> {
        let mut core = self.core();
        core.purge_dlq();
        core.dlq_infos()
    }
}
