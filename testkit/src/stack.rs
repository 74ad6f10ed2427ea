//! The local pipeline as a library: the QStash-compatible dev server (in process), the consumer and the
//! failure/delivery-callback handlers served on local ports through [`outbox::local`] (the same handler
//! functions the Lambdas run, called through the function-URL event), and the relay running simulated
//! invocations through its Lambda handler. `outbox-dev dev` and the whole-system tests build on it; by default it
//! runs the example application (`orders_example`), and any other registry and migrations can take its place
//! ([`StackOptions::registry`], [`StackOptions::migrators`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use lambda_runtime::{Context as LambdaContext, LambdaEvent};
use outbox::callbacks::handle_callback;
use outbox::config::{ConsumerConfig, ProcessEnv, QstashConfig, RelayConfig, Vars};
use outbox::consumer::{ConsumerState, ReceiverState, Registry, handle_event};
use outbox::db::{Db, DbConfig, Statements};
use outbox::qstash::QstashClient;
use outbox::receiver::{KeyRing, SigningKeys};
use outbox::relay::handler::{InvocationSummary, RelayState, handle};
use outbox::relay::{Relay, StopHandle};
use outbox::subscriber_keys::{OwnKey, SubscriberKeys};
use qstash_dev::DevServer;
use secrecy::SecretString;
use serde_json::json;
use sqlx::PgPool;
use sqlx::migrate::Migrator;
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;

/// How to build the stack.
pub struct StackOptions {
    /// The database (must exist; [`StackOptions::migrators`] are applied).
    pub database_url: String,
    /// The migrations applied at start, in order: the library's, then the application's (by default the
    /// example application's).
    pub migrators: Vec<&'static Migrator>,
    /// Dev server settings (port 0 = any free port; a port that is taken falls back to any,
    /// [`crate::ports::on_port_or_any`]).
    pub dev: qstash_dev::Config,
    pub relay: RelayConfig,
    /// `Upstash-Retries` the relay asks for.
    pub qstash_retries: u32,
    /// Messages per `/v2/batch` request (`QSTASH_BATCH_SIZE`).
    pub qstash_batch_size: u32,
    /// Parallelism of a subscriber's replay (`QSTASH_REPLAY_PARALLELISM`).
    pub replay_parallelism: u32,
    /// Length of one simulated relay invocation.
    pub invocation: Duration,
    /// Consumer name (dedupe namespace).
    pub consumer_name: String,
    /// The consumer's topic handlers.
    pub registry: Registry,
    /// Print the EMF metric lines (one per consumer request, one per relay invocation; noisy on a terminal).
    pub consumer_metrics: bool,
    /// The statement mode of every component (`DB_PERSISTENT_STATEMENTS` from the environment, default named
    /// prepared statements): [`Statements::Unnamed`] behind PgBouncer in transaction mode or RDS Proxy.
    pub statements: Statements,
    /// Keep a copy of every request the consumer and the callback receiver get, with the status they answered
    /// ([`LocalStack::recorded_requests`]): tests replay real signed deliveries from it. Off by default (it
    /// keeps every body in memory).
    pub record_requests: bool,
    /// Named subscribers served beside the default consumer, each by a consumer of its own (its name is its
    /// `CONSUMER_NAME`) on a port of its own, and made live for its topics at start ([`outbox::subscribers`]).
    pub subscribers: Vec<SubscriberOptions>,
    /// Give each named subscriber a key of its own ([`outbox::subscriber_keys`], decision record 0028): the relay
    /// signs its messages with it, its consumer accepts only those, the callback receiver checks callbacks about
    /// its copies with it. On by default; the default consumer has none (the single-subscriber setup).
    pub subscriber_keys: bool,
}

/// A named subscriber of the local pipeline ([`StackOptions::subscribers`]).
pub struct SubscriberOptions {
    /// Its name.
    pub name: String,
    /// The topics it subscribes to.
    pub topics: Vec<String>,
    /// Its consumer's handlers.
    pub registry: Registry,
}

/// The local pipeline's key for subscriber `name` ([`StackOptions::subscriber_keys`]).
fn local_subscriber_key(nonce: &str, name: &str) -> String {
    format!("local-{name}-{nonce}")
}

/// A named subscriber's consumer as started.
struct LocalSubscriber {
    name: String,
    url: String,
    down: Arc<AtomicBool>,
}

impl StackOptions {
    /// Defaults: dev server on a free port at real time, the example application's handlers and migrations, a
    /// relay with a short lease and poll interval suited to a laptop.
    pub fn new(database_url: &str) -> anyhow::Result<Self> {
        let empty: std::collections::HashMap<String, String> = std::collections::HashMap::new();
        let mut relay = RelayConfig::from_vars(&Vars::new(&empty), 3)?;
        relay.lease = Duration::from_secs(5);
        relay.poll_interval = Duration::from_millis(100);
        relay.deadline_margin = Duration::from_millis(500);
        relay.concurrency = 2;
        relay.evidence_timeout = Duration::from_secs(120);
        // A laptop-scale backoff: a failed publish is retried within seconds, not the production minutes.
        relay.backoff_base = Duration::from_millis(500);
        relay.backoff_cap = Duration::from_secs(10);
        // Likewise for a QStash outage (a stopped dev server): probe again within a second or two.
        relay.outage_probe_base = Duration::from_millis(200);
        relay.outage_probe_cap = Duration::from_secs(2);
        Ok(StackOptions {
            database_url: database_url.to_owned(),
            migrators: vec![&outbox::MIGRATOR, &orders_example::MIGRATOR],
            dev: qstash_dev::Config {
                port: 0,
                ..qstash_dev::Config::default()
            },
            statements: DbConfig::from_vars(&Vars::new(&ProcessEnv), "outbox-local")?.statements,
            relay,
            qstash_retries: 3,
            qstash_batch_size: 100,
            replay_parallelism: 4,
            invocation: Duration::from_secs(30),
            consumer_name: "consumer".into(),
            registry: orders_example::registry(),
            consumer_metrics: false,
            record_requests: false,
            subscribers: Vec::new(),
            subscriber_keys: true,
        })
    }
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
    relay_state: Arc<RelayState>,
    relay_stop: StopHandle,
    relay_task: Mutex<Option<JoinHandle<()>>>,
    last_summary: Arc<std::sync::Mutex<Option<InvocationSummary>>>,
    shutdown: watch::Sender<bool>,
    servers: Vec<JoinHandle<std::io::Result<()>>>,
    recorded: Option<Recorder>,
    callbacks_down: Arc<AtomicBool>,
    subscribers: Vec<LocalSubscriber>,
}

/// Which local receiver got a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Receiver {
    /// The consumer (`{consumer_url}/events/{topic}`).
    Consumer,
    /// The callback receiver (`{callback_url}/failure`, `/delivered`).
    Callbacks,
}

/// A request a local receiver got, as it arrived, and the status it answered ([`StackOptions::record_requests`]).
#[derive(Debug, Clone)]
pub struct RecordedRequest {
    pub receiver: Receiver,
    /// HTTP method.
    pub method: String,
    /// Path and query as requested (e.g. `/events/orders?contract=2`).
    pub path_and_query: String,
    /// Request headers (lower-case names), in order.
    pub headers: Vec<(String, String)>,
    /// The body, byte for byte.
    pub body: Vec<u8>,
    /// The status the receiver answered.
    pub status: u16,
}

impl RecordedRequest {
    /// A request header by (case-insensitive) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

type Recorder = Arc<std::sync::Mutex<Vec<RecordedRequest>>>;

/// Copies what [`RecordedRequest`] keeps of a request (before the handler consumes it).
fn snapshot(receiver: Receiver, req: &lambda_http::Request) -> RecordedRequest {
    RecordedRequest {
        receiver,
        method: req.method().to_string(),
        path_and_query: req
            .uri()
            .path_and_query()
            .map_or_else(|| req.uri().path().to_owned(), |p| p.as_str().to_owned()),
        headers: req
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: req.body().as_ref().to_vec(),
        status: 0,
    }
}

/// Runs `handle`, recording the request and its status when `recorder` is set.
async fn recorded<F>(
    recorder: Option<&Recorder>,
    receiver: Receiver,
    req: lambda_http::Request,
    handle: impl FnOnce(lambda_http::Request) -> F,
) -> lambda_http::Response<lambda_http::Body>
where
    F: std::future::Future<Output = lambda_http::Response<lambda_http::Body>>,
{
    let Some(recorder) = recorder else {
        return handle(req).await;
    };
    let mut copy = snapshot(receiver, &req);
    let response = handle(req).await;
    copy.status = response.status().as_u16();
    if let Ok(mut r) = recorder.lock() {
        r.push(copy);
    }
    response
}

// The two listeners are spawned by plain functions so that the tasks' (deeply nested) future types are laid out
// here, in this crate, and never in the crates that await `LocalStack::start` (where they overflowed the default
// query depth limit of the test crates).

/// Serves the consumer handler on `listener` until `shutdown` turns true; while `down` is set, every delivery
/// is answered 503 without reaching it.
fn serve_consumer(
    listener: tokio::net::TcpListener,
    state: Arc<ConsumerState>,
    recorder: Option<Recorder>,
    down: Option<Arc<AtomicBool>>,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<std::io::Result<()>> {
    tokio::spawn(outbox::local::serve(
        listener,
        move |req| {
            let (c, rec, down) = (state.clone(), recorder.clone(), down.clone());
            async move {
                recorded(rec.as_ref(), Receiver::Consumer, req, async |req| {
                    if down.as_ref().is_some_and(|d| d.load(Ordering::SeqCst)) {
                        let mut r = lambda_http::Response::new(lambda_http::Body::from(
                            "consumer unavailable (test switch)",
                        ));
                        *r.status_mut() = lambda_http::http::StatusCode::SERVICE_UNAVAILABLE;
                        return r;
                    }
                    handle_event(&c, req).await
                })
                .await
            }
        },
        async move {
            let _ = shutdown.wait_for(|s| *s).await;
        },
    ))
}

/// Serves the failure and delivery callback handler on `listener` until `shutdown` turns true. While `down` is
/// set, every request is answered 503 without reaching the handler: the callback function throttled, or erroring
/// because its database is unreachable ([`LocalStack::set_callbacks_down`]).
fn serve_callbacks(
    listener: tokio::net::TcpListener,
    state: Arc<ReceiverState>,
    recorder: Option<Recorder>,
    down: Arc<AtomicBool>,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<std::io::Result<()>> {
    tokio::spawn(outbox::local::serve(
        listener,
        move |req| {
            let (c, rec, down) = (state.clone(), recorder.clone(), down.clone());
            async move {
                recorded(rec.as_ref(), Receiver::Callbacks, req, async |req| {
                    if down.load(Ordering::SeqCst) {
                        let mut r = lambda_http::Response::new(lambda_http::Body::from(
                            "callback function unavailable (test switch)",
                        ));
                        *r.status_mut() = lambda_http::http::StatusCode::SERVICE_UNAVAILABLE;
                        return r;
                    }
                    handle_callback(&c, req).await
                })
                .await
            }
        },
        async move {
            let _ = shutdown.wait_for(|s| *s).await;
        },
    ))
}

/// Whether every migration of `migrator` is recorded as applied in `table`. Unnamed statements in one
/// transaction: behind PgBouncer in transaction mode, sqlx's unnamed statement (parse, then bind in a second
/// round trip) only stays on one server connection inside a transaction.
async fn all_applied(pool: &PgPool, table: &str, migrator: &Migrator) -> anyhow::Result<bool> {
    let mut tx = pool
        .begin()
        .await
        .context("reaching Postgres (is it running and DATABASE_URL right?)")?;
    let exists: Option<String> = Statements::Unnamed
        .query_scalar("SELECT to_regclass($1)::text")
        .bind(table)
        .fetch_one(&mut *tx)
        .await?;
    if exists.is_none() {
        return Ok(false);
    }
    let versions: Vec<i64> = migrator.iter().map(|m| m.version).collect();
    let applied: i64 = Statements::Unnamed
        .query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(DISTINCT version) FROM {table} WHERE success AND version = ANY($1)"
        )))
        .bind(&versions)
        .fetch_one(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(applied == versions.len() as i64)
}

fn pool_for(url: &str, name: &str, max: u32, async_commit: bool) -> anyhow::Result<PgPool> {
    let mut cfg = DbConfig::defaults(name);
    cfg.max_connections = max;
    cfg.async_commit = async_commit;
    Ok(cfg.pool(&SecretString::from(url.to_owned()))?)
}

async fn listen() -> anyhow::Result<(tokio::net::TcpListener, String)> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", l.local_addr()?);
    Ok((l, url))
}

impl LocalStack {
    /// Applies migrations and starts every component.
    pub async fn start(opts: StackOptions) -> anyhow::Result<LocalStack> {
        outbox::install_crypto_provider();
        let pool = pool_for(&opts.database_url, "outbox-local", 8, false)?;
        for migrator in &opts.migrators {
            // The library's own migrations go into the process's outbox schema (OUTBOX_SCHEMA); the
            // application's run where its connection puts them.
            let library = std::ptr::eq(*migrator, &outbox::MIGRATOR);
            let table = if library {
                outbox::schema::current().table("_sqlx_migrations")
            } else {
                "_sqlx_migrations".to_owned()
            };
            // Nothing to apply, nothing to run: the migrator takes a session-level advisory lock and prepares
            // named statements, neither of which works through PgBouncer in transaction mode (a database the
            // stack reaches through one was migrated directly beforehand).
            if all_applied(&pool, &table, migrator).await? {
                continue;
            }
            let applied = if library {
                outbox::migrate(&pool, outbox::schema::current()).await
            } else {
                migrator.run(&pool).await
            };
            applied
                .context("applying migrations (is Postgres reachable and DATABASE_URL right?)")?;
        }
        let dev = crate::ports::on_port_or_any(opts.dev.port, |port| {
            let cfg = qstash_dev::Config {
                port,
                ..opts.dev.clone()
            };
            async move {
                DevServer::start(cfg)
                    .await
                    .context("starting the QStash dev server")
            }
        })
        .await?;
        let keys = dev.signing_keys();
        let (shutdown, _) = watch::channel(false);

        let (consumer_listener, consumer_url) = listen().await?;
        let (callback_listener, callback_url) = listen().await?;
        let base_config = ConsumerConfig::from_vars(&Vars::new(&std::collections::HashMap::<
            String,
            String,
        >::new()))?;
        let receiver_config = |public: &str| ConsumerConfig {
            name: opts.consumer_name.clone(),
            public_base_url: Some(public.to_owned()),
            skip_topics: opts.relay.skip_topics.clone(),
            ..base_config.clone()
        };
        let ring = || {
            KeyRing::fixed(SigningKeys::new(
                keys.current.clone(),
                Some(keys.next.clone()),
            ))
        };
        let consumer = Arc::new(ConsumerState::new(
            ReceiverState::new(
                receiver_config(&consumer_url),
                Db::new(
                    pool_for(&opts.database_url, "outbox-local-consumer", 16, false)?,
                    opts.statements,
                ),
                ring(),
            )
            .with_metrics(opts.consumer_metrics),
            opts.registry,
        ));
        // Each named subscriber's key: random per stack; the relay and the callback receiver hold them all.
        let nonce = format!("{:032x}", rand::random::<u128>());
        let subscriber_keys = if opts.subscriber_keys {
            opts.subscribers
                .iter()
                .fold(SubscriberKeys::none(), |keys, s| {
                    keys.with(&s.name, &[local_subscriber_key(&nonce, &s.name).as_str()])
                })
        } else {
            SubscriberKeys::none()
        };
        let callbacks = Arc::new(
            ReceiverState::new(
                receiver_config(&callback_url),
                Db::new(
                    pool_for(&opts.database_url, "outbox-local-callbacks", 8, true)?,
                    opts.statements,
                ),
                ring(),
            )
            .with_metrics(opts.consumer_metrics)
            .with_subscriber_keys(subscriber_keys.clone()),
        );
        let recorder: Option<Recorder> = opts.record_requests.then(Default::default);
        let callbacks_down = Arc::new(AtomicBool::new(false));
        let mut servers = vec![
            serve_consumer(
                consumer_listener,
                consumer,
                recorder.clone(),
                None,
                shutdown.subscribe(),
            ),
            serve_callbacks(
                callback_listener,
                callbacks,
                recorder.clone(),
                callbacks_down.clone(),
                shutdown.subscribe(),
            ),
        ];

        let mut subscribers = Vec::with_capacity(opts.subscribers.len());
        let admin = Db::new(pool.clone(), opts.statements);
        for sub in opts.subscribers {
            let (listener, url) = listen().await?;
            let mut receiver = ReceiverState::new(
                ConsumerConfig {
                    name: sub.name.clone(),
                    ..receiver_config(&url)
                },
                Db::new(
                    pool_for(&opts.database_url, "outbox-local-subscriber", 4, false)?,
                    opts.statements,
                ),
                ring(),
            )
            .with_metrics(opts.consumer_metrics);
            if opts.subscriber_keys {
                let key = local_subscriber_key(&nonce, &sub.name);
                receiver = receiver.with_own_key(OwnKey::new(SecretString::from(key), None)?);
            }
            let state = Arc::new(ConsumerState::new(receiver, sub.registry));
            let down = Arc::new(AtomicBool::new(false));
            servers.push(serve_consumer(
                listener,
                state,
                recorder.clone(),
                Some(down.clone()),
                shutdown.subscribe(),
            ));
            for topic in &sub.topics {
                outbox::subscribers::ensure(&admin, topic, &sub.name, &url)
                    .await
                    .with_context(|| format!("making {} a subscriber of {topic}", sub.name))?;
            }
            subscribers.push(LocalSubscriber {
                name: sub.name,
                url,
                down,
            });
        }

        let qstash = QstashConfig {
            base_url: dev.url(),
            retries: opts.qstash_retries,
            publish_timeout: Duration::from_secs(3),
            batch_size: opts.qstash_batch_size,
            delivery_timeout: None,
            flow_parallelism: 10,
            replay_parallelism: opts.replay_parallelism,
            flow_rate: None,
            flow_period: Duration::from_secs(1),
            consumer_url: consumer_url.clone(),
            callback_url: callback_url.clone(),
        };
        let client = QstashClient::new(
            &dev.url(),
            SecretString::from(dev.token().to_owned()),
            qstash.publish_timeout,
        )?;
        let relay_pool = pool_for(
            &opts.database_url,
            "outbox-local-relay",
            opts.relay.concurrency + 1,
            true,
        )?;
        let relay = Relay::new(
            Db::new(relay_pool, opts.statements),
            client,
            opts.relay,
            qstash,
        )
        .with_subscriber_keys(subscriber_keys.clone());
        let relay_stop = relay.stop_handle();
        let relay_state =
            Arc::new(RelayState::new(relay, "relay").with_metrics(opts.consumer_metrics));
        let last_summary = Arc::new(std::sync::Mutex::new(None));
        let relay_task = {
            let state = relay_state.clone();
            let stop = relay_stop.clone();
            let last = last_summary.clone();
            let invocation = opts.invocation;
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.is_stopped() {
                    n += 1;
                    let mut ctx = LambdaContext::default();
                    ctx.request_id = format!("local-{n}");
                    let deadline = SystemTime::now() + invocation;
                    ctx.deadline = deadline
                        .duration_since(UNIX_EPOCH)
                        .map(|d| d.as_millis() as u64)
                        .unwrap_or(0);
                    let event = LambdaEvent::new(
                        json!({"source": "outbox.local", "detail-type": "Scheduled Event"}),
                        ctx,
                    );
                    match handle(&state, event).await {
                        Ok(s) => {
                            // A QStash outage whose next probe does not fit in the invocation ends it at
                            // once: pause like the schedule would.
                            let outage = s.drain.stopped == "outage";
                            if let Ok(mut l) = last.lock() {
                                *l = Some(s);
                            }
                            if outage {
                                let pause = state.relay.config().outage_probe_base;
                                tokio::time::sleep(pause).await;
                            }
                        }
                        Err(e) => {
                            tracing::error!(error = %e, "relay invocation failed; retrying in 1 s");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                    }
                }
            })
        };
        Ok(LocalStack {
            pool,
            dev,
            consumer_url,
            callback_url,
            relay_state,
            relay_stop,
            relay_task: Mutex::new(Some(relay_task)),
            last_summary,
            shutdown,
            servers,
            recorded: recorder,
            callbacks_down,
            subscribers,
        })
    }

    /// A named subscriber's base URL ([`StackOptions::subscribers`]).
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
    /// (empty unless [`StackOptions::record_requests`]).
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
