//! Server lifecycle: listener, connection handling, timer task, worker pool, and the library handle.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tower::ServiceExt;

use crate::config::{Config, Faults};
use crate::core::{Core, Counters, Effects, Job, Outcome};
use crate::deliver::{AttemptRec, HttpClient, JobQueue, new_client, worker};
use crate::types::{DeliveryAttempt, DlqEntryInfo, Stats};

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration is inconsistent.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Binding the listener failed.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// Address tried.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

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

struct AttemptLog {
    buf: VecDeque<AttemptRec>,
    seq: u64,
}

struct FaultState {
    faults: Faults,
    rng: StdRng,
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
    faults: Mutex<FaultState>,
    delivery_faults: std::sync::atomic::AtomicBool,
    /// The current key as a cheaply cloneable string (signing happens on every attempt).
    key_cache: Mutex<Arc<str>>,
    keys: RwLock<SigningKeys>,
    pub client: HttpClient,
    pub region_header: Option<http::HeaderValue>,
    pub started: std::time::Instant,
    timer_wake: Notify,
    idle: Notify,
    /// The address the listener is bound to (port resolved).
    pub bound: SocketAddr,
    pub base_url: String,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn new(cfg: Config, bound: SocketAddr) -> Shared {
        let counters = Arc::new(Counters::default());
        Shared {
            core: Mutex::new(Core::new(&cfg, counters.clone())),
            counters,
            jobs: JobQueue::new(),
            attempts: Mutex::new(AttemptLog {
                buf: VecDeque::new(),
                seq: 0,
            }),
            faults: Mutex::new(FaultState {
                faults: cfg.faults.clone(),
                rng: StdRng::seed_from_u64(cfg.seed ^ 0x5eed_fa17),
            }),
            delivery_faults: std::sync::atomic::AtomicBool::new(Self::has_delivery_faults(
                &cfg.faults,
            )),
            key_cache: Mutex::new(Arc::from(cfg.current_signing_key.as_str())),
            keys: RwLock::new(SigningKeys {
                current: cfg.current_signing_key.clone(),
                next: cfg.next_signing_key.clone(),
            }),
            client: new_client(&cfg),
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

    pub fn record_attempt(&self, mut a: AttemptRec) {
        Counters::inc(&self.counters.attempts);
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

    /// Draws one fault decision with probability `rate(faults)`.
    pub fn draw_fault(&self, rate: impl Fn(&Faults) -> f64) -> bool {
        let mut st = lock(&self.faults);
        let p = rate(&st.faults);
        if p <= 0.0 {
            return false;
        }
        st.rng.random::<f64>() < p
    }

    /// [`Faults::spare_final_attempt`].
    pub fn spares_final_attempt(&self) -> bool {
        lock(&self.faults).faults.spare_final_attempt
    }

    pub fn faults(&self) -> Faults {
        lock(&self.faults).faults.clone()
    }

    fn has_delivery_faults(f: &Faults) -> bool {
        f.duplicate_delivery_rate > 0.0
            || f.delivery_network_error_rate > 0.0
            || f.delivery_lost_response_rate > 0.0
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
        self.counters.reset();
        {
            let mut f = lock(&self.faults);
            f.rng = StdRng::seed_from_u64(self.cfg.seed ^ 0x5eed_fa17);
        }
        self.idle_changed();
    }

    pub fn dlq_entries(&self) -> Vec<DlqEntryInfo> {
        let mut core = self.core();
        core.purge_dlq();
        core.dlq_infos()
    }
}

async fn timer_loop(shared: Arc<Shared>) {
    loop {
        let mut fx = Effects::default();
        let next = {
            let mut core = shared.core();
            core.fire_timers(tokio::time::Instant::now(), &mut fx)
        };
        fx.wake_timer = false;
        shared.apply(fx);
        match next {
            Some(at) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(at) => {}
                    _ = shared.timer_wake.notified() => {}
                }
            }
            None => shared.timer_wake.notified().await,
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    router: axum::Router,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = shutdown.changed() => return,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(local) = stream.local_addr() else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let mut shutdown = shutdown.clone();
        tokio::spawn(async move {
            let kill = Arc::new(Notify::new());
            let ctx = ConnCtx {
                peer,
                local,
                kill: kill.clone(),
            };
            let svc = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
                req.extensions_mut().insert(ctx.clone());
                router.clone().oneshot(req)
            });
            let conn = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), svc);
            tokio::select! {
                _ = conn => {}
                // Dropping the connection future closes the socket: no response bytes at all.
                _ = kill.notified() => {}
                _ = shutdown.changed() => {}
            }
        });
    }
}

/// A running dev server. Dropping it without [`DevServer::shutdown`] leaves its tasks running until the
/// runtime ends.
pub struct DevServer {
    handle: Handle,
    addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl DevServer {
    /// Binds, spawns the timer task, the worker pool and the accept loop, and returns once listening.
    pub async fn start(cfg: Config) -> Result<DevServer, StartError> {
        cfg.validate().map_err(StartError::Config)?;
        let want = SocketAddr::new(cfg.bind, cfg.port);
        let listener = TcpListener::bind(want)
            .await
            .map_err(|source| StartError::Bind { addr: want, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| StartError::Bind { addr: want, source })?;
        let workers = if cfg.deliver { cfg.max_concurrency } else { 1 };
        let shared = Arc::new(Shared::new(cfg, addr));
        let router = crate::api::router(shared.clone());
        let (tx, rx) = watch::channel(false);
        let mut tasks = Vec::with_capacity(workers + 2);
        tasks.push(tokio::spawn(timer_loop(shared.clone())));
        for _ in 0..workers {
            tasks.push(tokio::spawn(worker(shared.clone())));
        }
        tasks.push(tokio::spawn(accept_loop(listener, router, rx)));
        tracing::info!(url = %shared.base_url, "qstash-dev listening");
        Ok(DevServer {
            handle: Handle { shared },
            addr,
            shutdown: tx,
            tasks,
        })
    }

    /// `http://127.0.0.1:PORT` (no trailing slash): the SDKs' `baseUrl` / `QSTASH_URL`.
    pub fn url(&self) -> String {
        self.handle.shared.base_url.clone()
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The accepted token (`QSTASH_TOKEN`).
    pub fn token(&self) -> &str {
        &self.handle.shared.cfg.token
    }

    /// Current and next signing keys (`QSTASH_CURRENT_SIGNING_KEY` / `QSTASH_NEXT_SIGNING_KEY`).
    pub fn signing_keys(&self) -> SigningKeys {
        self.handle.signing_keys()
    }

    /// A cloneable handle for inspection and fault injection.
    pub fn handle(&self) -> Handle {
        self.handle.clone()
    }

    /// Stops accepting, closes connections and stops the timer and workers (in-flight deliveries are dropped).
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        for t in &self.tasks {
            t.abort();
        }
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Inspection and control of a running server. `Clone + Send + Sync`.
#[derive(Clone)]
pub struct Handle {
    shared: Arc<Shared>,
}

impl Handle {
    /// Base URL.
    pub fn url(&self) -> String {
        self.shared.base_url.clone()
    }
    /// The accepted token.
    pub fn token(&self) -> String {
        self.shared.cfg.token.clone()
    }
    /// The configuration the server runs with (faults: the initial ones).
    pub fn config(&self) -> Config {
        self.shared.cfg.clone()
    }
    /// Current and next signing keys.
    pub fn signing_keys(&self) -> SigningKeys {
        self.shared.signing_keys()
    }
    /// Rotates: `current = next`, `next = fresh`. Returns the new keys.
    pub fn rotate_keys(&self) -> SigningKeys {
        self.shared.rotate_keys()
    }
    /// Replaces the fault-injection settings. Errors on rates outside `[0, 1]`.
    pub fn set_faults(&self, faults: Faults) -> Result<(), String> {
        self.shared.set_faults(faults)
    }
    /// Current fault-injection settings.
    pub fn faults(&self) -> Faults {
        self.shared.faults()
    }
    /// Every delivery attempt still in the log (oldest first).
    pub fn attempts(&self) -> Vec<DeliveryAttempt> {
        self.shared.attempts()
    }
    /// Attempts for one message id.
    pub fn attempts_for(&self, message_id: &str) -> Vec<DeliveryAttempt> {
        self.shared.attempts_for(message_id)
    }
    /// Empties the attempt log.
    pub fn clear_attempts(&self) {
        self.shared.clear_attempts()
    }
    /// Messages accepted so far (new ids; duplicates not counted).
    pub fn messages_accepted(&self) -> u64 {
        self.shared.counters.accepted.load(Ordering::Relaxed)
    }
    /// Counters and gauges.
    pub fn stats(&self) -> Stats {
        self.shared.stats()
    }
    /// The DLQ (oldest first).
    pub fn dlq_entries(&self) -> Vec<DlqEntryInfo> {
        self.shared.dlq_entries()
    }
    /// True when nothing is scheduled, waiting or in flight.
    pub fn is_idle(&self) -> bool {
        self.shared.is_idle()
    }
    /// Waits until [`Handle::is_idle`]; a paused queue with messages never becomes idle.
    pub async fn wait_idle(&self, timeout: Duration) -> Result<(), WaitIdleTimeout> {
        self.shared.wait_idle(timeout).await
    }
    /// Forgets all messages, DLQ entries, queues, flow-control keys, dedup ids, attempts and counters, and
    /// reseeds the RNGs. Fault settings stay.
    pub fn reset(&self) {
        self.shared.reset()
    }
}
