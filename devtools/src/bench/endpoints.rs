//! The real receivers in the benchmark process, each behind the function-URL adapter on a port of its own: the
//! consumer (signature, dedupe row, per-key sequence check, a no-op handler on the topics `bench_ordered` and
//! `bench`, evidence in the same transaction when asked) and the callback receiver. Each counts its invocations
//! and times each one as the Lambda runtime bills it: from the request handed to the handler to its response.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use outbox::ReceiverState;
use outbox::config::{ConsumerConfig, Vars};
use outbox::db::DbConfig;
use outbox::internals::receiver::{KeyRing, SigningKeys};
use tokio::sync::watch;

/// A receiver's invocations: how many, and each one's duration (handler start → response).
#[derive(Default)]
pub struct Invocations {
    count: AtomicU64,
    micros: std::sync::Mutex<Vec<u64>>,
}

impl Invocations {
    /// Invocations so far (counted when the request reaches the handler).
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn begin(&self) -> Instant {
        self.count.fetch_add(1, Ordering::Relaxed);
        Instant::now()
    }

    fn end(&self, started: Instant) {
        let us = started.elapsed().as_micros() as u64;
        self.micros
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(us);
    }

    /// The durations of the invocations that have answered so far, in ms, in the order they ended.
    pub fn durations_ms(&self) -> Vec<f64> {
        self.micros
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|us| *us as f64 / 1000.0)
            .collect()
    }
}

/// The real consumer and callback receiver on the benchmark database: their URLs, the switch that stops both,
/// and their invocations.
pub(crate) struct Endpoints {
    pub consumer_url: String,
    pub callback_url: String,
    pub stop: watch::Sender<bool>,
    pub consumer: Arc<Invocations>,
    pub callbacks: Arc<Invocations>,
}

/// A no-op topic handler: the consumer's own work (verify, dedupe row, sequence check, evidence) is what is
/// measured.
struct Noop;

impl outbox::consumer::Handler<serde_json::Value> for Noop {
    async fn handle(
        &self,
        _conn: &mut sqlx::PgConnection,
        _event: &outbox::consumer::Event<serde_json::Value>,
    ) -> Result<(), outbox::consumer::HandlerError> {
        Ok(())
    }
}

/// A receiver's state on `db_url` with the dev server's signing keys, URL `url` and `CONSUMER_NAME` `name`.
fn receiver(url: &str, name: &str, db: DbConfig, db_url: &str) -> anyhow::Result<ReceiverState> {
    let mut cfg = ConsumerConfig::from_vars(&Vars::new(&std::collections::HashMap::<
        String,
        String,
    >::new()))?;
    cfg.public_base_url = Some(url.to_owned());
    cfg.name = name.to_owned();
    Ok(ReceiverState::new(
        cfg,
        db.handle(&secrecy::SecretString::from(db_url.to_owned()))?,
        KeyRing::fixed(SigningKeys::new(
            qstash_dev::DEV_CURRENT_SIGNING_KEY,
            Some(qstash_dev::DEV_NEXT_SIGNING_KEY.to_owned()),
        )),
    )
    .with_metrics(false))
}

/// The callback receiver and the default consumer (`consumer`) on the benchmark database. Sending `true` on
/// `stop` stops both.
pub(crate) async fn ordered_endpoints(db_url: &str) -> anyhow::Result<Endpoints> {
    let (tx, rx) = watch::channel(false);
    let cb = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let cb_url = format!("http://{}", cb.local_addr()?);
    let mut db = DbConfig::defaults("bench-callbacks");
    db.async_commit = true;
    db.max_connections = 16;
    let state = Arc::new(receiver(&cb_url, "consumer", db, db_url)?);
    let callbacks = Arc::new(Invocations::default());
    let timed = callbacks.clone();
    let mut rx2 = rx.clone();
    tokio::spawn(outbox::local::serve(
        cb,
        move |req| {
            let s = state.clone();
            let timed = timed.clone();
            async move {
                let started = timed.begin();
                let response = outbox::internals::callbacks::handle_callback(&s, req).await;
                timed.end(started);
                response
            }
        },
        async move {
            let _ = rx2.wait_for(|s| *s).await;
        },
    ));
    let (consumer_url, consumer) = consumer_endpoint(db_url, "consumer", rx.clone()).await?;
    Ok(Endpoints {
        consumer_url,
        callback_url: cb_url,
        stop: tx,
        consumer,
        callbacks,
    })
}

/// The real consumer with `CONSUMER_NAME` `name` (a subscriber's name, fan-out), synchronous commits like the
/// consumer Lambda, until `rx` turns true. Returns its URL and its invocations.
pub(crate) async fn consumer_endpoint(
    db_url: &str,
    name: &str,
    rx: watch::Receiver<bool>,
) -> anyhow::Result<(String, Arc<Invocations>)> {
    switchable_consumer_endpoint(db_url, name, rx, Arc::new(AtomicBool::new(false))).await
}

/// [`consumer_endpoint`] that answers every request 503 without reading it while `down` is true: a consumer
/// that is down, as QStash sees it (fan-out's "B down" figures).
pub(crate) async fn switchable_consumer_endpoint(
    db_url: &str,
    name: &str,
    rx: watch::Receiver<bool>,
    down: Arc<AtomicBool>,
) -> anyhow::Result<(String, Arc<Invocations>)> {
    let cl = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let consumer_url = format!("http://{}", cl.local_addr()?);
    let mut cdb = DbConfig::defaults("bench-consumer");
    cdb.max_connections = 16;
    let consumer = Arc::new(outbox::consumer::ConsumerState::new(
        receiver(&consumer_url, name, cdb, db_url)?,
        outbox::consumer::Registry::new()
            .on("bench_ordered", Noop)
            .on("bench", Noop),
    ));
    let invocations = Arc::new(Invocations::default());
    let timed = invocations.clone();
    let mut rx3 = rx.clone();
    tokio::spawn(outbox::local::serve(
        cl,
        move |req| {
            let c = consumer.clone();
            let timed = timed.clone();
            let is_down = down.load(Ordering::SeqCst);
            async move {
                let started = timed.begin();
                let response = if is_down {
                    let mut unavailable = lambda_http::Response::new(lambda_http::Body::Empty);
                    *unavailable.status_mut() = lambda_http::http::StatusCode::SERVICE_UNAVAILABLE;
                    unavailable
                } else {
                    outbox::consumer::handle_event(&c, req).await
                };
                timed.end(started);
                response
            }
        },
        async move {
            let _ = rx3.wait_for(|s| *s).await;
        },
    ));
    Ok((consumer_url, invocations))
}
