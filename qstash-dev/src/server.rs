//! Server lifecycle and wiring: binds the listener, creates the shared state, spawns the delivery engine's timer
//! task and workers, serves the QStash and inspection routers behind one gate, and hands out the library handle.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tower::ServiceExt;

use crate::config::{Config, Faults};
use crate::deliver::{new_client, timer_loop, worker};
use crate::state::{ConnCtx, Shared, SigningKeys, WaitIdleTimeout};
use crate::types::{DeliveryAttempt, DlqEntryInfo, Stats};
use crate::{api, inspect};

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

/// The QStash API and the inspection API, both behind the gate ([`api::guarded`]).
fn router(shared: Arc<Shared>) -> axum::Router {
    // The inspection API needs the same token: it can reset the server, inject faults and read the token.
    api::guarded(api::router().merge(inspect::router()), shared)
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
        let client = new_client(&cfg);
        let shared = Arc::new(Shared::new(cfg, addr));
        let router = router(shared.clone());
        let (tx, rx) = watch::channel(false);
        let mut tasks = Vec::with_capacity(workers + 2);
        tasks.push(tokio::spawn(timer_loop(shared.clone())));
        for _ in 0..workers {
            tasks.push(tokio::spawn(worker(shared.clone(), client.clone())));
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
    /// The ids of the messages lost on purpose (`Faults::message_loss_rate`), oldest first.
    pub fn lost_messages(&self) -> Vec<String> {
        self.shared
            .lost_messages()
            .iter()
            .map(|i| i.to_string())
            .collect()
    }

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
